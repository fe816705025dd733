"""Tests for megatron_glm5.arguments: defaults, aliases, --config YAML, validation messages, recipes, the
megatron-core mapping and the entry-script error guard.  Fast: no process groups, no model construction."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_glm5 import arguments as A
from megatron_glm5.arguments import (
    ArgumentError,
    args_to_overrides,
    build_parser,
    main_guard,
    parse_args,
    parse_data_blend,
    validate_args,
)
from megatron_glm5.config import ConfigError, GLM5Config
from megatron_glm5.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "recipes"
PY = sys.executable


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    """Validation sees a CPU-only machine unless a test says otherwise; no torchrun environment."""
    monkeypatch.setattr(A, "_cuda_available", lambda: False)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", A.TRACEBACK_ENV):
        monkeypatch.delenv(var, raising=False)


def ok(argv=(), world=1, mode="finetune", **kw):
    return validate_args(parse_args(list(argv), mode=mode), world, **kw)


def fails(argv=(), world=1, mode="finetune", **kw) -> ArgumentError:
    with pytest.raises(ArgumentError) as ei:
        ok(argv, world, mode, **kw)
    assert "\n" not in str(ei.value)
    return ei.value


# ------------------------------------------------------------------------------------------------ defaults


def test_finetune_defaults_are_a_tiny_cpu_run():
    args = parse_args([])
    assert args.mode == "finetune"
    assert args.preset == "tiny" and args.hf_config is None and args.tokenizer == "tiny"
    assert args.data_path == [A.asset_path("data", "chat_train.jsonl")]
    assert args.valid_data_path == [A.asset_path("data", "chat_valid.jsonl")]
    assert Path(args.data_path[0]).parent == REPO / "megatron_glm5" / "assets" / "data"
    assert args.save == os.path.join("runs", "finetune_tiny")
    assert (args.train_iters, args.lr, args.min_lr, args.lr_decay_style) == (300, 3e-3, 3e-4, "cosine")
    assert (args.seq_length, args.micro_batch_size, args.packing) == (128, 4, True)
    assert (args.eval_interval, args.log_interval, args.save_interval) == (50, 10, 100)
    assert (args.attn, args.dsa_stage, args.dsa_indexer_loss_coeff) == ("auto", "sparse", 1e-3)
    assert (args.moe_token_dispatcher_type, args.exit_signal, args.seed) == ("alltoall", "SIGTERM", 1234)
    assert (args.split, args.overlong, args.optimizer) == ("98,1,1", "truncate", "adam")

    validate_args(args, 1)
    assert args.world_size == 1 and args.data_parallel_size == 1 and args.num_microbatches == 1
    assert args.global_batch_size == 4
    assert args.params_dtype is torch.float32 and args.bf16 is False
    assert args.sequence_parallel is False and args.expert_tensor_parallel_size == 1
    assert args.lr_warmup_iters == 30 and args.lr_decay_iters == 300
    assert args.tensorboard_dir == os.path.join("runs", "finetune_tiny", "tensorboard")
    assert args.peak_tflops is None  # no MFU on CPU
    assert args.mtp is True  # the tiny preset has one MTP layer
    assert args.moe_router_load_balancing_type == "none"
    assert isinstance(args.model_config, GLM5Config) and args.model_config.num_hidden_layers == 4
    assert args.data_blend == ([A.asset_path("data", "chat_train.jsonl")], None)
    assert args.split_fractions == pytest.approx((0.98, 0.01, 0.01))


def test_pretrain_defaults():
    args = ok(mode="pretrain")
    assert args.data_path == [A.asset_path("data", "pretrain_a.jsonl")]
    assert args.valid_data_path is None and args.valid_data_blend is None
    assert args.save == os.path.join("runs", "pretrain_tiny")
    assert args.packing is True
    with pytest.raises(ArgumentError, match="unrecognized arguments: --no-packing"):
        parse_args(["--no-packing"], mode="pretrain")


def test_validate_is_idempotent():
    args = ok(["--tp", "2", "--recompute-granularity", "full"], world=2)
    before = dict(vars(args))
    validate_args(args, 2)
    assert dict(vars(args)) == before


def test_gpu_defaults(monkeypatch):
    monkeypatch.setattr(A, "_cuda_available", lambda: True)
    args = ok()
    assert args.bf16 is True and args.params_dtype is torch.bfloat16
    assert args.peak_tflops == A.DEFAULT_PEAK_TFLOPS == 989.0
    assert ok(["--no-bf16", "--peak-tflops", "400"]).params_dtype is torch.float32
    assert ok(["--peak-tflops", "400"]).peak_tflops == 400.0
    assert ok(["--attn", "cudnn"]).attn == "cudnn"


def test_save_and_tensorboard_defaults(tmp_path):
    assert ok(["--preset", "glm5.3"], world=256, check_device=False).save == os.path.join("runs", "finetune_glm5.3")
    args = ok(["--no-save"])
    assert args.save is None and args.tensorboard_dir is None
    args = ok(["--save", str(tmp_path / "ck")])
    assert args.tensorboard_dir == str(tmp_path / "ck" / "tensorboard")
    assert ok(["--save", "x", "--tensorboard-dir", "tb"]).tensorboard_dir == "tb"


def test_node_size_from_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parse_args([]).node_size == 4
    assert parse_args(["--node-size", "2"]).node_size == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert parse_args([]).node_size is None
    assert ok([], world=16).node_size == 8


def test_help_is_fast_and_does_not_import_megatron_core():
    code = (
        "import sys\n"
        "from megatron_glm5.arguments import parse_args\n"
        "try:\n    parse_args(['--help'], mode='pretrain')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'megatron.core' not in sys.modules\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: pretrain_glm5.py" in r.stdout and "--tensor-model-parallel-size N, --tp N" in r.stdout


# ------------------------------------------------------------------------------------------------ aliases


@pytest.mark.parametrize(
    "alias, dest",
    [
        ("--tp", "tensor_model_parallel_size"),
        ("--pp", "pipeline_model_parallel_size"),
        ("--vpp", "virtual_pipeline_model_parallel_size"),
        ("--ep", "expert_model_parallel_size"),
        ("--etp", "expert_tensor_parallel_size"),
        ("--cp", "context_parallel_size"),
    ],
)
def test_short_aliases_map_to_megatron_names(alias, dest):
    long = "--" + dest.replace("_", "-")
    assert getattr(parse_args([alias, "2"]), dest) == 2
    assert getattr(parse_args([long, "2"]), dest) == 2


def test_dispatcher_alias_and_choices():
    assert parse_args(["--dispatcher", "hybridep"]).moe_token_dispatcher_type == "hybridep"
    assert parse_args(["--moe-token-dispatcher-type", "allgather"]).moe_token_dispatcher_type == "allgather"
    with pytest.raises(ArgumentError, match="invalid choice: 'deepep'"):
        parse_args(["--dispatcher", "deepep"])


def test_boolean_pairs():
    assert parse_args(["--no-mtp"]).mtp is False and parse_args(["--mtp"]).mtp is True
    assert parse_args(["--no-packing"]).packing is False
    assert parse_args(["--no-sequence-parallel"]).sequence_parallel is False


def test_bad_values_raise_one_line_argument_errors():
    with pytest.raises(ArgumentError, match=r"--tp: must be a positive integer, got '0'"):
        parse_args(["--tp", "0"])
    with pytest.raises(ArgumentError, match="unrecognized arguments: --tensor-parallel"):
        parse_args(["--tensor-parallel", "2"])
    with pytest.raises(ArgumentError, match="--lr-warmup-fraction: must be in"):
        parse_args(["--lr-warmup-fraction", "1.5"])
    with pytest.raises(ArgumentError, match="expected an integer"):
        parse_args(["--seq-length", "4k"])
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, UserError)


def test_build_parser_modes():
    assert build_parser("finetune").prog == "finetune_glm5.py"
    assert "--packing" not in build_parser("pretrain")._option_string_actions
    with pytest.raises(ValueError, match="mode"):
        build_parser("sft")
    with pytest.raises(ValueError, match="mode"):
        parse_args([], mode="eval")


def test_no_abbreviations():
    with pytest.raises(ArgumentError, match="unrecognized"):
        parse_args(["--micro-batch", "2"])


# ------------------------------------------------------------------------------------------------ YAML config


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_accepts_every_spelling(tmp_path):
    cfg = write(tmp_path, (
        "tensor-model-parallel-size: 2\n"
        "pipeline_model_parallel_size: 2\n"
        "ep: 4\n"
        "--cp: 1\n"
        "dispatcher: allgather\n"
        "lr: 3e-4\n"          # PyYAML reads 3e-4 as a string: converted like the command line would
        "min_lr: 1.0e-5\n"
        "no-packing: true\n"
        "use-distributed-optimizer: true\n"
        "recompute-modules: [core_attn, mla_up_proj]\n"
        "recompute_granularity: selective\n"
        "data-path: 0.7 a.jsonl 0.3 b.jsonl\n"
        "valid-data-path: [v.jsonl]\n"
    ))
    args = parse_args(["--config", cfg])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.expert_model_parallel_size, args.context_parallel_size) == (4, 1)
    assert args.moe_token_dispatcher_type == "allgather"
    assert args.lr == 3e-4 and args.min_lr == 1e-5
    assert args.packing is False and args.use_distributed_optimizer is True
    assert args.recompute_modules == ["core_attn", "mla_up_proj"]
    assert args.data_path == ["0.7", "a.jsonl", "0.3", "b.jsonl"]
    assert args.valid_data_path == ["v.jsonl"]
    assert args.config == cfg
    validate_args(args, 8)
    assert args.data_blend == (["a.jsonl", "b.jsonl"], [0.7, 0.3])


def test_command_line_overrides_yaml(tmp_path):
    cfg = write(tmp_path, "tp: 2\nlr: 1.0e-3\nmin-lr: 1.0e-5\nmtp: false\nsave: from_yaml\nmicro-batch-size: 2\n")
    args = parse_args(["--tensor-model-parallel-size", "1", "--config", cfg, "--lr", "5e-4", "--mtp"])
    assert args.tensor_model_parallel_size == 1 and args.lr == 5e-4 and args.mtp is True
    assert args.min_lr == 1e-5 and args.save == "from_yaml" and args.micro_batch_size == 2
    assert parse_args([f"--config={cfg}"]).tensor_model_parallel_size == 2  # the = form too


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    cfg = write(tmp_path, "tp: 1\ntensor-parallel: 2\n", name="bad.yaml")
    with pytest.raises(ArgumentError) as ei:
        parse_args(["--config", cfg])
    msg = str(ei.value)
    assert cfg in msg and "'tensor-parallel'" in msg and ":2:" in msg  # file, line and key
    with pytest.raises(ArgumentError, match="did you mean 'micro-batch-size'"):
        parse_args(["--config", write(tmp_path, "micro_batch_sise: 2\n")])
    # a flag of the other mode is unknown here
    with pytest.raises(ArgumentError, match="unknown key 'packing'"):
        parse_args(["--config", write(tmp_path, "packing: false\n")], mode="pretrain")


@pytest.mark.parametrize(
    "text, match",
    [
        ("tp: two\n", r"tp: expected an integer"),
        ("tp: [1, 2]\n", r"tp: expected a single value"),
        ("attn: cuda\n", r"attn: invalid choice 'cuda'"),
        ("bf16: maybe\n", r"bf16: expected true or false"),
        ("freeze-indexer: 1\n", r"freeze-indexer: expected true or false"),
        ("tp: 2\ntensor_model_parallel_size: 2\n", r"sets the same flag as 'tp'"),
        ("config: other.yaml\n", r"cannot be nested"),
        ("- tp\n- 2\n", r"expected a mapping"),
        ("tp: [1\n", r"not valid YAML"),
        ("recompute-modules: [core_attn, 3]\n", None),  # 3 becomes "3": rejected later by validation
    ],
)
def test_yaml_bad_values(tmp_path, text, match):
    cfg = write(tmp_path, text)
    if match is None:
        with pytest.raises(ArgumentError, match="--recompute-modules: unknown module"):
            validate_args(parse_args(["--config", cfg, "--recompute-granularity", "selective"]), 1)
        return
    with pytest.raises(ArgumentError, match=match) as ei:
        parse_args(["--config", cfg])
    assert cfg in str(ei.value)


def test_yaml_missing_file(tmp_path):
    with pytest.raises(ArgumentError, match="--config .*nope.yaml: cannot read"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert parse_args(["--config", write(tmp_path, "")]).tensor_model_parallel_size == 1  # empty file: no-op


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "argv, world, needles",
    [
        # world size vs the dense and the expert layouts
        (["--tp", "2"], 3, ["world size 3", "--tp 2", "--pp 1", "--cp 1"]),
        (["--ep", "4"], 2, ["world size 2", "--etp 1", "--ep 4", "expert layout"]),
        (["--ep", "2", "--etp", "2"], 2, ["--etp 2", "--ep 2"]),
        # global batch vs micro-batch x data parallel: the numbers are spelled out
        (["--global-batch-size", "6"], 2, ["--global-batch-size 6", "--micro-batch-size 4", "data-parallel size 2",
                                           "= 8"]),
        # context parallel needs 2*cp | seq
        (["--cp", "2", "--seq-length", "130"], 2, ["--seq-length 130", "--cp 2", "= 4"]),
        # sequence parallel needs tp | seq
        (["--tp", "2", "--seq-length", "129"], 2, ["--seq-length 129", "--tp 2"]),
        (["--vpp", "2"], 1, ["--vpp 2 needs --pp > 1"]),
        (["--pp", "2", "--vpp", "4"], 2, ["--vpp 4", "2 layers"]),
        (["--overlap-param-gather", "--overlap-grad-reduce"], 1,
         ["--overlap-param-gather needs --use-distributed-optimizer"]),
        (["--overlap-param-gather", "--use-distributed-optimizer"], 1, ["needs --overlap-grad-reduce"]),
        (["--finetune"], 1, ["--finetune needs --load"]),
        (["--dsa-indexer-loss-coeff", "-0.1"], 1, ["--dsa-indexer-loss-coeff must be >= 0"]),
        (["--freeze-indexer", "--dsa-stage", "dense-warmup"], 1, ["--freeze-indexer", "--dsa-stage dense-warmup",
                                                                  "nothing to train"]),
        (["--dsa-stage", "dense-warmup", "--dsa-indexer-loss-coeff", "0"], 1,
         ["--dsa-stage dense-warmup", "--dsa-indexer-loss-coeff 0"]),
        (["--preset", "glm5", "--pp", "4"], 256, ["--pp 4", "78 layers", "--decoder-first-pipeline-num-layers 19",
                                                 "--decoder-last-pipeline-num-layers 19"]),
        (["--lr", "1e-4", "--min-lr", "1e-3"], 1, ["--lr 0.0001", "--min-lr 0.001"]),
        (["--train-iters", "20", "--lr-warmup-iters", "50"], 1, ["--lr-warmup-iters", "--train-iters 20"]),
        (["--lr-warmup-iters", "300"], 1, ["--lr-warmup-iters", "--lr-decay-iters 300"]),
        (["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.1"], 1, ["--lr-warmup-iters and --lr-warmup-fraction"]),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "290"], 1, ["--lr-wsd-decay-iters 290"]),
        (["--fp16"], 1, ["--fp16", "bf16"]),
        (["--preset", "glm6"], 1, ["--preset", "glm6", "tiny"]),
        # model layout divisibility (GLM5Config.validate_layout): heads / experts / expert width / layers
        (["--tp", "3", "--seq-length", "129"], 3, ["--tp 3", "num_attention_heads 4"]),
        (["--ep", "3"], 3, ["--ep 3", "n_routed_experts 8"]),
        (["--etp", "3"], 3, ["--etp 3", "moe_intermediate_size 32"]),
        (["--pp", "3"], 3, ["--pp 3", "4 layers", "--decoder-first-pipeline-num-layers 1",
                            "--decoder-last-pipeline-num-layers 1"]),
        # uneven pipeline stages
        (["--decoder-first-pipeline-num-layers", "2"], 1, ["--decoder-first-pipeline-num-layers needs --pp > 1"]),
        (["--pp", "2", "--decoder-first-pipeline-num-layers", "4"], 2,
         ["--decoder-first-pipeline-num-layers 4", "0 of the model's 4 layers", "sum to 4"]),
        (["--pp", "3", "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2"], 3,
         ["--decoder-first-pipeline-num-layers 3 + --decoder-last-pipeline-num-layers 2"]),
        (["--tp", "2", "--no-sequence-parallel"], 2, ["--no-sequence-parallel", "--tp 2"]),
        (["--moe-aux-loss-coeff", "1e-3", "--moe-router-load-balancing-type", "none"], 1,
         ["--moe-aux-loss-coeff 0.001", "--moe-router-load-balancing-type none"]),
        (["--moe-aux-loss-coeff", "-1"], 1, ["--moe-aux-loss-coeff must be >= 0"]),
        (["--adam-beta2", "1.0"], 1, ["--adam-beta2"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "router"], 1,
         ["--recompute-modules", "router is never recomputed"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "attn"], 1,
         ["--recompute-modules", "unknown module(s) attn"]),
        (["--recompute-modules", "core_attn"], 1, ["--recompute-modules needs --recompute-granularity selective"]),
        (["--recompute-method", "block"], 1, ["--recompute-method needs --recompute-granularity full"]),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
         ["--recompute-num-layers applies to --recompute-granularity full"]),
        (["--data-path", "0.5", "a.jsonl", "b.jsonl"], 1, ["--data-path", "alternates weights and paths"]),
        (["--valid-data-path", "0.5", "a", "-1", "b"], 1, ["--valid-data-path", "non-negative"]),
        (["--split", "98,x"], 1, ["--split '98,x'"]),
        (["--split", "1,2,3,4"], 1, ["--split"]),
        (["--dispatcher", "hybridep", "--node-size", "8"], 12, ["--node-size 8", "world size 12"]),
    ],
)
def test_validation_errors_name_the_flag(argv, world, needles):
    err = fails(argv, world)
    for needle in needles:
        assert needle in str(err), (needle, str(err))
    assert err.flag is None or err.flag.startswith("--")


def test_bf16_needs_cuda_unless_dry():
    err = fails(["--bf16"])
    assert str(err).startswith("--bf16 needs a CUDA GPU") and err.flag == "--bf16"
    args = ok(["--bf16"], check_device=False)
    assert args.bf16 is True and args.params_dtype is torch.bfloat16
    err = fails(["--attn", "cudnn"])
    assert "--attn cudnn needs a CUDA GPU" in str(err)
    assert ok(["--attn", "cudnn"], check_device=False).attn == "cudnn"
    assert ok(["--attn", "torch"]).attn == "torch"


def test_mtp_flag_against_the_model(tmp_path):
    GLM5Config.from_preset("tiny").replace(num_nextn_predict_layers=0).save_hf(tmp_path)
    err = fails(["--hf-config", str(tmp_path), "--mtp"])
    assert "--mtp" in str(err) and "num_nextn_predict_layers" in str(err)
    assert ok(["--hf-config", str(tmp_path)]).mtp is False
    assert ok(["--no-mtp"]).mtp is False


def test_hf_config(tmp_path):
    cfg = GLM5Config.from_preset("tiny-indexshare")
    cfg.save_hf(tmp_path / "m")
    args = ok(["--hf-config", str(tmp_path / "m"), "--preset", "glm5"])  # --hf-config wins over --preset
    assert args.model_config.indexer_types == cfg.indexer_types
    assert args.save == os.path.join("runs", "finetune_m")
    assert ok(["--hf-config", str(tmp_path / "m" / "config.json")]).model_config.num_hidden_layers == 4
    err = fails(["--hf-config", str(tmp_path / "missing")])
    assert str(err).startswith("--hf-config") and err.flag == "--hf-config"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama"}')
    err = fails(["--hf-config", str(tmp_path / "bad")])
    assert "--hf-config" in str(err) and "model_type" in str(err)


def test_unknown_preset_is_delegated_to_glm5config():
    err = fails(["--preset", "glm6"])
    assert err.flag == "--preset"
    with pytest.raises(ConfigError) as ei:
        GLM5Config.from_preset("glm6")
    assert str(ei.value) in str(err)


def test_derived_fields():
    args = ok(["--tp", "2", "--pp", "2", "--ep", "4", "--micro-batch-size", "2", "--global-batch-size", "16"], 8)
    assert args.data_parallel_size == 2 and args.expert_data_parallel_size == 1
    assert args.num_microbatches == 4 and args.sequence_parallel is True
    args = ok(["--cp", "2", "--micro-batch-size", "1"], 8)
    assert args.data_parallel_size == 4 and args.global_batch_size == 4 and args.num_microbatches == 1
    assert ok(["--sequence-parallel"]).sequence_parallel is False  # tp 1: ignored, as Megatron-LM does
    assert ok(["--moe-aux-loss-coeff", "1e-4"]).moe_router_load_balancing_type == "seq_aux_loss"
    assert ok(["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-3"]) \
        .moe_router_load_balancing_type == "global_aux_loss"
    assert ok(["--lr-warmup-fraction", "0.1"]).lr_warmup_iters == 30
    assert ok(["--train-iters", "20"]).lr_warmup_iters == 2  # the default warm-up shrinks for short runs
    assert ok(["--lr-decay-style", "WSD"]).lr_wsd_decay_iters == 30
    args = ok(["--recompute-granularity", "full"])
    assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)
    assert ok(["--pp", "2", "--vpp", "1"], 2).virtual_pipeline_model_parallel_size is None
    assert ok(["--pp", "2", "--vpp", "2"], 2).virtual_pipeline_model_parallel_size == 2
    args = ok(["--pp", "3", "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"], 3)
    assert args.decoder_first_pipeline_num_layers == 1
    assert ok(["--pp", "2", "--decoder-first-pipeline-num-layers", "1"], 2).decoder_last_pipeline_num_layers is None


def test_derived_record_is_computed_once_and_written_onto_args():
    args = parse_args(["--tp", "2", "--recompute-granularity", "full"])
    before = dict(vars(args))
    derived = A.derive_args(args, 2)
    assert dict(vars(args)) == before  # derive_args leaves the namespace alone
    assert isinstance(derived, A.DerivedArgs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        derived.world_size = 3
    assert (derived.sequence_parallel, derived.recompute_method, derived.recompute_num_layers) == (True, "uniform", 1)
    assert (derived.data_parallel_size, derived.global_batch_size, derived.num_microbatches) == (1, 4, 1)
    validate_args(args, 2)
    for f in dataclasses.fields(derived):
        assert getattr(args, f.name) == getattr(derived, f.name), f.name
    # a failed check writes nothing
    bad = parse_args(["--finetune"])
    before = dict(vars(bad))
    with pytest.raises(ArgumentError):
        validate_args(bad, 1)
    assert dict(vars(bad)) == before


def test_parse_data_blend():
    assert parse_data_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_data_blend(["1", "a", "3", "b"]) == (["a", "b"], [1.0, 3.0])
    assert parse_data_blend(None) is None
    with pytest.raises(ArgumentError, match="--data-path"):
        parse_data_blend(["1", "a", "b", "2"])


# ------------------------------------------------------------------------------------------------ recipes


def _recipe_mode(path: Path) -> str:
    text = path.read_text()
    return "pretrain" if "pretrain_glm5.py" in text.split("\n\n")[0] else "finetune"


def test_recipes_present():
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert {"glm5.3_sft_32x8.yaml", "glm5.2_32k_cp8.yaml", "tiny_cpu_sft.yaml", "tiny_cpu_pretrain.yaml"} <= set(names)


@pytest.mark.parametrize("name", ["glm5.3_sft_32x8", "glm5.2_32k_cp8"])
def test_big_recipes_validate_at_256_ranks(name):
    path = RECIPES / f"{name}.yaml"
    args = ok(["--config", str(path)], world=256, mode=_recipe_mode(path), check_device=False)
    cfg = args.model_config
    assert cfg.num_hidden_layers == 78
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle = (cfg.num_hidden_layers - first - last) / (pp - 2)
    assert middle == int(middle) and first + last + middle * (pp - 2) == 78
    assert args.expert_model_parallel_size == 64 and pp == 4
    assert args.bf16 and args.use_distributed_optimizer and args.attn == "cudnn"
    assert args.moe_token_dispatcher_type == "hybridep"
    assert args.recompute_granularity == "full" and args.recompute_method == "uniform"
    assert args.expert_tensor_parallel_size * args.expert_model_parallel_size * pp == 256
    assert args.num_microbatches >= pp
    if name == "glm5.3_sft_32x8":
        assert args.mode == "finetune" and args.seq_length == 4096 and args.preset == "glm5.3"
        assert args.data_parallel_size == 64 and args.packing
    else:
        assert args.mode == "pretrain" and args.seq_length == 32768 and args.context_parallel_size == 8
        assert args.preset == "glm5.2" and args.data_blend[1] is not None
    # without CUDA, a real (device-checked) validation refuses bf16
    with pytest.raises(ArgumentError, match="--bf16 needs a CUDA GPU"):
        validate_args(parse_args(["--config", str(path)], mode=_recipe_mode(path)), 256)
    # the recipe is tied to its world size
    with pytest.raises(ArgumentError, match="world size 128"):
        validate_args(parse_args(["--config", str(path)], mode=_recipe_mode(path)), 128, check_device=False)


@pytest.mark.parametrize("name, mode", [("tiny_cpu_sft", "finetune"), ("tiny_cpu_pretrain", "pretrain")])
def test_tiny_recipes_match_the_defaults(name, mode):
    path = RECIPES / f"{name}.yaml"
    assert _recipe_mode(path) == mode
    args = ok(["--config", str(path)], world=1, mode=mode)
    default = ok([], world=1, mode=mode)
    for key in ("preset", "tokenizer", "seq_length", "micro_batch_size", "lr", "min_lr", "train_iters",
                "lr_warmup_iters", "save", "data_path", "valid_data_path", "eval_interval", "bf16", "packing"):
        assert getattr(args, key) == getattr(default, key), key
    assert ok(["--config", str(path), "--ep", "2"], world=2, mode=mode).expert_model_parallel_size == 2


# ------------------------------------------------------------------------------------------------ megatron-core


def _tc_fields():
    from megatron_glm5.config import transformer_config_class

    return {f.name for f in dataclasses.fields(transformer_config_class()) if f.init}


def test_overrides_are_real_transformer_config_fields():
    overrides = args_to_overrides(ok(["--moe-router-dtype", "fp64", "--no-mtp"]))
    expected = {
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel",
        "params_dtype", "bf16", "dsa_stage", "dsa_indexer_loss_coeff", "dsa_freeze_indexer", "dsa_backend",
        "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_router_bias_update_rate",
        "moe_token_dispatcher_type", "mtp_loss_scaling_factor", "recompute_granularity", "recompute_method",
        "recompute_num_layers", "recompute_modules", "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage", "calculate_per_token_loss", "fp32_router_and_indexer_weights", "moe_router_dtype", "mtp_num_layers",
        "cross_entropy_fusion",
    }
    assert set(overrides) == expected
    assert set(overrides) <= _tc_fields()
    assert overrides["calculate_per_token_loss"] is True and overrides["mtp_num_layers"] is None
    assert overrides["dsa_backend"] == "auto" and overrides["moe_router_dtype"] == "fp64"


def test_overrides_build_a_tiny_transformer_config():
    args = ok(["--freeze-indexer", "--dsa-indexer-loss-coeff", "0.01", "--moe-aux-loss-coeff", "1e-4",
               "--mtp-loss-scaling-factor", "0.3", "--recompute-granularity", "selective",
               "--recompute-modules", "core_attn", "mla_up_proj", "--attn", "torch"])
    tc = GLM5Config.from_preset("tiny").to_transformer_config(**args_to_overrides(args))
    assert tc.tensor_model_parallel_size == 1 and tc.expert_tensor_parallel_size == 1
    assert tc.params_dtype is torch.float32 and tc.bf16 is False and tc.sequence_parallel is False
    assert tc.dsa_freeze_indexer is True and tc.dsa_indexer_loss_coeff == 0.01 and tc.dsa_backend == "torch"
    assert tc.moe_router_load_balancing_type == "seq_aux_loss" and tc.moe_aux_loss_coeff == 1e-4
    assert tc.mtp_loss_scaling_factor == 0.3 and tc.mtp_num_layers == 1
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn", "mla_up_proj"]
    assert tc.calculate_per_token_loss is True


def test_overrides_for_a_parallel_layout():
    args = ok(["--tp", "2", "--pp", "3", "--decoder-first-pipeline-num-layers", "1",
               "--decoder-last-pipeline-num-layers", "1", "--ep", "2", "--recompute-granularity", "full",
               "--bf16"], world=6, check_device=False)
    tc = args.model_config.to_transformer_config(**args_to_overrides(args))
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.expert_model_parallel_size) == (2, 3, 2)
    assert tc.sequence_parallel is True and tc.params_dtype is torch.bfloat16 and tc.pipeline_dtype is torch.bfloat16
    assert (tc.num_layers_in_first_pipeline_stage, tc.num_layers_in_last_pipeline_stage) == (1, 1)
    assert (tc.recompute_method, tc.recompute_num_layers) == ("uniform", 1)
    assert tc.expert_tensor_parallel_size == 1  # our default, not megatron-core's "= tp"


def test_dsa_stage_choices_are_the_config_s():
    import megatron_glm5.config as mc

    assert A.DSA_STAGES is mc.DSA_STAGES
    assert "{dense-warmup,sparse}" in build_parser().format_help()
    with pytest.raises(ArgumentError, match="invalid choice: 'x'"):
        parse_args(["--dsa-stage", "x"])


def test_overrides_dense_warmup_keeps_the_router_bias():
    assert args_to_overrides(ok(["--dsa-stage", "dense-warmup"]))["moe_router_bias_update_rate"] == 0.0
    assert args_to_overrides(ok(["--moe-router-bias-update-rate", "0.01"]))["moe_router_bias_update_rate"] == 0.01


def test_overrides_without_validation_use_documented_defaults():
    ov = args_to_overrides(parse_args(["--tp", "2"]))
    assert ov["sequence_parallel"] is True and ov["expert_tensor_parallel_size"] == 1
    assert ov["moe_router_load_balancing_type"] == "none" and ov["params_dtype"] is torch.float32
    assert "mtp_num_layers" not in ov


# ------------------------------------------------------------------------------------------------ main_guard


def test_main_guard_prints_one_line_and_exits_2(capsys):
    @main_guard
    def main(argv):
        validate_args(parse_args(argv), 1)
        return "ran"

    assert main([]) == "ran"
    with pytest.raises(SystemExit) as ei:
        main(["--finetune"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: --finetune needs --load (the checkpoint whose weights to start from)\n"


def test_main_guard_catches_package_errors_only(capsys):
    with pytest.raises(SystemExit):
        with main_guard():
            GLM5Config.from_preset("nope")  # ConfigError: a ValueError defined in megatron_glm5
    assert capsys.readouterr().err.startswith("error: unknown preset 'nope'")

    class DataError(UserError, ValueError):
        pass

    with pytest.raises(SystemExit):
        with main_guard():
            raise DataError("line 3 of x.jsonl: no 'messages' key")
    assert capsys.readouterr().err == "error: line 3 of x.jsonl: no 'messages' key\n"

    with pytest.raises(ValueError, match="a bug"):  # builtin ValueError: a bug, keeps its traceback
        with main_guard():
            raise ValueError("a bug")
    with pytest.raises(KeyError):
        with main_guard():
            raise KeyError("x")
    assert capsys.readouterr().err == ""


def test_main_guard_traceback_env_and_ranks(monkeypatch, capsys):
    monkeypatch.setenv(A.TRACEBACK_ENV, "1")
    with pytest.raises(ArgumentError):
        with main_guard():
            raise ArgumentError("x")
    monkeypatch.delenv(A.TRACEBACK_ENV)

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        with main_guard():
            raise ArgumentError("same on every rank")
    assert capsys.readouterr().err == ""  # rank 0 reports flag errors
    with pytest.raises(SystemExit):
        with main_guard():
            raise UserError("only here")
    assert capsys.readouterr().err == "error: [rank 3] only here\n"
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        with main_guard():
            raise ArgumentError("same on every rank")
    assert capsys.readouterr().err == "error: same on every rank\n"


def test_entry_script_error_is_one_line_without_traceback(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(
        "import sys\n"
        "from megatron_glm5.arguments import main_guard, parse_args, validate_args\n"
        "@main_guard\n"
        "def main():\n"
        "    validate_args(parse_args(sys.argv[1:], mode='pretrain'), 1)\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", A.TRACEBACK_ENV)}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([PY, str(script), "--tp", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert lines == ["error: argument --tensor-model-parallel-size/--tp: must be a positive integer, got '0' "
                     "(see pretrain_glm5.py --help)"], r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------ issue 21/20 flag cases


def test_yaml_repeated_key_names_both_lines(tmp_path):
    cfg = write(tmp_path, "lr: 1e-4\ntp: 2\nseed: 3\ntp: 4\n")
    with pytest.raises(ArgumentError) as ei:
        parse_args(["--config", cfg])
    assert str(ei.value) == f"--config {cfg}:4: key 'tp' is given twice (lines 2 and 4); keep one"
    cfg = write(tmp_path, "tp: 2\nseed: 3\ntensor_model_parallel_size: 2\n")
    with pytest.raises(ArgumentError) as ei:
        parse_args(["--config", cfg])
    assert str(ei.value) == (f"{cfg}:3: key 'tensor_model_parallel_size' sets the same flag as 'tp' (line 1); "
                             "keep one")


@pytest.mark.parametrize("mode, argv, message", [
    ("finetune", ["--seq-length", "1"], "--seq-length 1 is too short: the model trains on at least 2 tokens per "
                                        "sequence (a fine-tuning sample needs a prompt token and a target)"),
    ("pretrain", ["--seq-length", "1"], "--seq-length 1 is too short: the model trains on at least 2 tokens per "
                                        "sequence (the MTP layer needs a target 1 token(s) further on, --mtp-steps 1; "
                                        "--no-mtp lowers it to 1)"),
    ("finetune", ["--seq-length", "3", "--mtp-steps", "3"], "at least 4 tokens per sequence (the MTP layer needs a "
                                                            "target 3 token(s) further on, --mtp-steps 3; --no-mtp "
                                                            "lowers it to 2)"),
])
def test_seq_length_below_the_minimum(mode, argv, message):
    err = fails(argv, mode=mode)
    assert message in str(err) and err.flag == "--seq-length"
    minimum = int(message.split("at least ")[1].split()[0])  # the documented minimum itself is accepted
    assert ok(argv[:1] + [str(minimum)] + argv[2:], mode=mode).seq_length == minimum
    if mode == "pretrain":
        assert ok(["--seq-length", "1", "--no-mtp"], mode="pretrain").seq_length == 1


@pytest.mark.parametrize("mode, argv, needed", [
    ("finetune", ["--ep", "2"], 2),
    ("pretrain", ["--pp", "2"], 2),
    ("finetune", ["--tp", "2", "--ep", "4"], 4),
    ("finetune", ["--cp", "2", "--ep", "4", "--seq-length", "64"], 4),
])
def test_layout_error_in_one_process_says_how_to_launch(mode, argv, needed):
    err = fails(argv, world=1, mode=mode)
    assert str(err).startswith("world size 1 is not divisible by")
    assert str(err).endswith(f"; this is a single process: launch {needed} with torchrun, e.g. torchrun "
                             f"--nproc-per-node {needed} {mode}_glm5.py <the same flags>")
    assert "torchrun" not in str(fails(["--ep", "4"], world=2))  # under torchrun: the layout message alone


def test_repeated_data_path_is_warned_once(tmp_path, caplog):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text('{"text": "x"}\n')
    with caplog.at_level("WARNING", logger="megatron_glm5.arguments"):
        ok(["--data-path", str(a), str(b), str(tmp_path / "." / "a.jsonl")], mode="pretrain")
    warned = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert warned == [f"--data-path lists {tmp_path / '.' / 'a.jsonl'} twice (also as {a}): its samples are drawn "
                      "twice as often; list it once, or give blend weights"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_glm5.arguments"):
        ok(["--data-path", str(a), str(b)], mode="pretrain")
    assert not [r for r in caplog.records if "twice" in r.getMessage()]


def test_split_without_a_training_share_and_max_sample_bytes():
    err = fails(["--split", "0,1,0"], mode="pretrain")
    assert str(err).startswith("--split 0,1,0 gives the training split no share") and err.flag == "--split"
    assert ok([], mode="pretrain").max_sample_bytes == 8 * 1024 * 1024
    assert ok(["--max-sample-bytes", "1000"]).max_sample_bytes == 1000
    assert "--max-sample-bytes" in str(fails(["--max-sample-bytes", "0"]))
