"""LoRA on a frozen base (megatron_glm5/lora/): the flags' bad-input lines, the target names, and one set of real
fine-tuning runs of the tiny preset (a base checkpoint; LoRA run A; run B stopped half-way and resumed as C).

Must hold: the adapter checkpoint holds only adapter tensors and their optimizer state, and names its base and
LoRA config; the resumed run repeats the uninterrupted one bitwise; an adapter checkpoint refuses other --lora-*
flags in one line.
"""
from __future__ import annotations

import pytest

from training_helpers import check_ok, read_metrics, run_entries, run_entry, series

from megatron_glm5 import arguments
from megatron_glm5.lora import targets


def _check(*flags):
    args = arguments.parse_args(["--no-save", *flags], mode="finetune")
    return arguments.validate_args(args, world_size=1, check_device=False)


def test_target_names_resolve_and_match():
    assert targets.resolve(["attention"]) == ("kv_a", "kv_b", "o", "q_a", "q_b")
    assert targets.resolve(["o_proj", "experts_down"]) == ("experts_down", "o")
    assert targets.match("decoder.layers.3.self_attention.linear_q_up_proj", ("q_b", "o")) == ("q_b",)
    assert targets.match("decoder.layers.3.mlp.experts", targets.GROUPS["all"]) == ("experts_gate_up",
                                                                                    "experts_down")
    assert targets.match("mtp.layers.0.mtp_model_layer.self_attention.linear_proj", ("o",)) == ()


@pytest.mark.parametrize("flags,needle", [
    (["--lora-rank", "0"], "--lora-rank must be a positive integer, got 0"),
    (["--lora-rank", "4", "--lora-target-modules", "q_a,qkv"], "--lora-target-modules: unknown module 'qkv'; valid:"),
    (["--train-indexer"], "--train-indexer is for LoRA runs"),
    (["--lora-rank", "4", "--train-indexer", "--freeze-indexer"], "contradict"),
])
def test_bad_lora_flags_are_one_line(flags, needle):
    with pytest.raises(Exception) as info:
        _check(*flags)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert arguments.is_user_error(info.value)


def test_lora_flags_derive_config():
    args = _check("--lora-rank", "8", "--lora-target-modules", "attention,experts")
    assert args.lora.rank == 8 and args.lora.alpha == 16.0 and args.lora.scaling == 2.0
    assert "kv_b" in args.lora.targets and "gate_up" not in args.lora.targets
    assert arguments.args_to_overrides(args)["dsa_freeze_indexer"] is True
    assert arguments.args_to_overrides(args)["moe_router_bias_update_rate"] == 0.0


def test_adapter_checkpoint_of_another_base_or_rank_is_one_line():
    from megatron_glm5.lora.checkpoint import LoRACheckpointError, check_belongs
    from megatron_glm5.lora.config import LoRAConfig

    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=("o", "q_a"))
    record = {"lora": cfg.to_record(), "base": {"model_fingerprint": "aaaa", "checkpoint": "/b/glm5.2"}}
    check_belongs(record, "RUN", cfg, "aaaa", "BASE")
    with pytest.raises(LoRACheckpointError, match=r"^RUN: these adapters were trained on the base with model "
                                                  r"fingerprint aaaa \(/b/glm5.2\), but BASE has bbbb"):
        check_belongs(record, "RUN", cfg, "bbbb", "BASE")
    with pytest.raises(LoRACheckpointError, match=r"^--lora-rank 8 but the adapter checkpoint RUN was trained with 4"):
        check_belongs(record, "RUN", LoRAConfig(rank=8, alpha=8.0, dropout=0.0, targets=("o", "q_a")), "aaaa", "B")


def test_peft_export_refuses_dense_mlp_adapters():
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.lora.config import LoRAConfig
    from megatron_glm5.lora.export import LoRAExportError, peft_state

    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=targets.resolve(["all"]))
    with pytest.raises(LoRAExportError, match="export the merged model with --merge-lora instead"):
        peft_state(GLM5Config.from_preset("tiny"), lora, {})


LORA = ["--lora-rank", "4", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "4",
        "--save-interval", "2"]


@pytest.mark.slow
def test_lora_runs_resume_bitwise_and_save_adapters_only(tmp_path):
    """Runs on the --seed base (no --load: one process round less); the base checkpoint path is the same code
    (lora/checkpoint.py loads it weights-only through training/checkpointing.py)."""
    a, b = run_entries([("finetune", [*LORA, "--save", "A"], tmp_path),
                        ("finetune", [*LORA, "--save", "B", "--exit-interval", "2"], tmp_path)])
    check_ok(a), check_ok(b)
    check_ok(run_entry("finetune", ["--resume", *LORA, "--save", "B"], tmp_path))
    loss_a = series(read_metrics(tmp_path / "A" / "tensorboard"), "lm-loss")
    loss_c = series(read_metrics(tmp_path / "B" / "tensorboard"), "lm-loss")
    assert sorted(loss_a) == [1, 2, 3, 4] and all(loss_a[i] == loss_c[i] for i in (3, 4)), (loss_a, loss_c)

    from megatron.core.dist_checkpointing import load_common_state_dict, load_tensors_metadata
    ckpt = tmp_path / "A" / "iter_0000004"
    keys = set(load_tensors_metadata(str(ckpt)))
    opt_keys = {k for k in keys if ".optimizer.state." in k}  # chained_N.optimizer.state.exp_avg.<param key>
    model_keys = keys - opt_keys
    assert model_keys and all(k.rsplit(".", 1)[-1].startswith("lora_") for k in model_keys), sorted(model_keys)[:5]
    assert opt_keys and all(k.rsplit(".", 1)[-1].startswith("lora_") for k in opt_keys), sorted(opt_keys)[:5]
    common = load_common_state_dict(str(ckpt))
    record = common["glm5_lora"]
    assert record["lora"]["rank"] == 4 and record["base"]["model_fingerprint"] == common["glm5"]["model_fingerprint"]


def test_planner_lora_terms_hand_computed_bytes():
    """GLM-5.3 sizes, rank 16: a frozen FP8 base keeps 1 byte per element + an fp32 scale per 128x128 block, no
    gradient and no optimizer state; the adapters have bf16 weights, fp32 gradients, 12 bytes of optimizer state."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.lora.config import LoRAConfig
    from megatron_glm5.planning.inventory import Tensor
    from megatron_glm5.planning.lora_terms import adapter_elements, lora_static_memory

    cfg = GLM5Config.from_preset("glm5.3")
    q_down = "decoder.layers.0.self_attention.linear_q_down_proj.weight"
    assert adapter_elements(cfg, q_down, ["q_a"], 16) == 16 * (6144 + 2048)  # 131072
    assert adapter_elements(cfg, "decoder.layers.0.self_attention.linear_proj.weight", ["o"], 16, tp=2) == 229376
    assert adapter_elements(cfg, "decoder.layers.3.mlp.experts.weight1", ["experts_gate_up"], 16, ep=8) == 5242880
    assert adapter_elements(cfg, q_down, ["o"], 16) == 0
    assert adapter_elements(cfg, "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight", ["o"], 16) == 0
    tensors = [Tensor(q_down, 6144 * 2048, "dense"), Tensor("decoder.layers.0.input_layernorm.weight", 6144, "dense"),
               Tensor("decoder.layers.3.mlp.experts.weight1", 256 * 2 * 2048 * 6144, "experts", expert=True)]
    lora = LoRAConfig(rank=16, alpha=32.0, dropout=0.0, targets=("experts_gate_up", "q_a"))
    s = lora_static_memory(cfg, tensors, lora, tp=1, ep=1, dtype_bytes=2, grad_bytes=4, fp8=True, dense_shards=1,
                           expert_shards=1, distributed_optimizer=True)
    # q_down 12582912 + 3072 scales; norm 6144 x 2; experts 6442450944 + 1572864 scales; adapters 42074112 x 2
    assert s.weight_bytes == 6_540_770_304
    assert s.grad_bytes == 168_296_448  # 42074112 adapter elements x 4
    assert s.optimizer_main_bytes + s.optimizer_moment_bytes == 504_889_344  # x 12
    assert s.optimizer_expert_elements == 41_943_040
    # the indexer stays in the parameter dtype on an FP8 base (model/dsa.py: plain bf16 linears), and with
    # --train-indexer it is trained: gradients and optimizer state, its weight counted once
    wq_b = Tensor("decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight", 2048 * 4096, "dense")
    frozen = lora_static_memory(cfg, [wq_b], lora, tp=1, ep=1, dtype_bytes=2, grad_bytes=4, fp8=True,
                                dense_shards=1, expert_shards=1, distributed_optimizer=True)
    assert frozen.weight_bytes == 16_777_216 and frozen.grad_bytes == 0  # 8388608 x 2 bytes, no FP8
    trained = lora_static_memory(cfg, [wq_b], LoRAConfig(rank=16, alpha=32.0, dropout=0.0, targets=("q_a",),
                                                         train_indexer=True),
                                 tp=1, ep=1, dtype_bytes=2, grad_bytes=4, fp8=True, dense_shards=1, expert_shards=1,
                                 distributed_optimizer=True)
    assert trained.weight_bytes == 16_777_216 and trained.grad_bytes == 33_554_432  # x 4
    assert trained.optimizer_main_bytes + trained.optimizer_moment_bytes == 100_663_296  # x 12
