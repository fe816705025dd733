"""The layout planner (megatron_glm5/planning, tools/plan_layout.py).

The distributed test builds the tiny model at six layouts under gloo in ONE torchrun launch of 4 processes
(python -m megatron_glm5.planning.measure: model chunks, DDP, optimizer and its Adam state, exactly as training
builds them) and checks, rank by rank, that the planner predicts exactly the bytes megatron-core allocated: the
parameters, the fp32 gradient buffers, the distributed optimizer's parameter buffers, the fp32 main copies and the
Adam moments, and each rank's place in the pipeline / data-parallel / expert data-parallel groups.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glm5.arguments import parse_args, validate_args
from megatron_glm5.planning.buffers import rank_buffers, static_memory
from megatron_glm5.planning.gpus import GPUS
from megatron_glm5.planning.layout import build_layout
from megatron_glm5.planning.plan import make_plan, rank_coordinates

REPO = Path(__file__).resolve().parents[1]
RECIPE_32X8 = REPO / "examples" / "recipes" / "glm5.3_sft_32x8.yaml"
TINY = ["--preset", "tiny", "--attn", "torch", "--no-save", "--seq-length", "64", "--micro-batch-size", "2"]
# (flags, what it exercises) -- world size 4 each
LAYOUTS = [
    ("--tp 2 --pp 2 --use-distributed-optimizer --bf16", "TP2 x PP2, MTP's tied embedding, experts sharded over EDP2"),
    ("--ep 2 --use-distributed-optimizer --bf16", "EP2, dense state sharded over DP4 (padding per shard)"),
    ("--pp 2 --ep 2 --bf16", "PP2 x EP2 without the distributed optimizer (fp32 main copies of everything)"),
    ("--tp 2 --use-distributed-optimizer", "TP2 x DP2 in fp32 (the optimizer steps the parameters in place)"),
    ("--pp 2 --vpp 2 --use-distributed-optimizer --overlap-grad-reduce --bf16", "interleaved: two chunks per rank"),
    ("--cp 2 --ep 2 --use-distributed-optimizer --bf16", "CP2: dense state sharded over DP x CP"),
]


def _args(flags, world=4, mode="finetune"):
    return validate_args(parse_args(flags, mode=mode), world_size=world, check_device=False)


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_layout", REPO / "tools" / "plan_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_tool(argv, capsys):
    mod = _plan_tool()
    capsys.readouterr()
    try:
        rc = mod.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------ against megatron-core's real allocations


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("planner_measure")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
           "megatron_glm5.planning.measure", "--out", str(out)]
    for flags, _ in LAYOUTS:
        cmd += ["--"] + TINY + flags.split()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = out / "log.txt"
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    if r.returncode:
        pytest.fail(f"measure exited with {r.returncode}:\n{log.read_text()[-4000:]}")
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("n", range(len(LAYOUTS)), ids=[f.replace("--", "").replace(" ", "_") for f, _ in LAYOUTS])
def test_planner_bytes_equal_megatron_allocations(measured, n):
    flags, what = LAYOUTS[n]
    args = _args(TINY + flags.split())
    layout = build_layout(args)
    seen_shards = set()
    for rank in range(4):
        real = json.loads((measured / f"{n}.rank{rank}.json").read_text())
        p, d, e = rank_coordinates(layout, rank)
        assert (real["pp_rank"], real["dense_shard"], real["expert_shard"]) == (p, d, e), (what, rank)
        names = [(t.name, t.numel, t.expert) for c in layout.chunks[p] for t in c.tensors]
        assert names == [(x["name"], x["numel"], x["expert"]) for x in real["params"]], (what, rank)
        st = static_memory(rank_buffers(layout.chunks[p], pp_rank=p, dense_shards=layout.dense_shards,
                                        expert_shards=layout.edp,
                                        distributed_optimizer=args.use_distributed_optimizer,
                                        overlap_grad_reduce=args.overlap_grad_reduce),
                           dense_index=d, expert_index=e, bf16=args.bf16,
                           distributed_optimizer=args.use_distributed_optimizer)
        predicted = {"param_bytes": st.param_bytes, "grad_buffer_bytes": st.grad_bytes,
                     "param_buffer_bytes": st.weight_bytes if args.use_distributed_optimizer else 0,
                     "optimizer_main_param_bytes": st.optimizer_main_bytes,
                     "optimizer_moment_bytes": st.optimizer_moment_bytes}
        assert predicted == {k: real[k] for k in predicted}, (what, rank)
        seen_shards.add((p, st.optimizer_bytes))
    if args.use_distributed_optimizer and layout.dense_shards > 1:
        assert len(seen_shards) > layout.pp or n == 3, "the shards of one stage should differ (padding) somewhere"


# ------------------------------------------------------------------ unit tests (no processes)


def test_inventory_totals_come_from_config():
    """Summed over the stages of a PP4 layout, the tensors are count_parameters(include_mtp) plus the MTP stage's
    tied copy of the embedding; at TP1 each layer is GLM5Config.layer_parameters (inventory.py checks it)."""
    args = _args(["--config", str(RECIPE_32X8)], world=256)
    layout = build_layout(args)
    total = sum(t.numel for row in layout.chunks for c in row for t in c.tensors)
    cfg = args.model_config
    experts = sum(t.numel for row in layout.chunks for c in row for t in c.tensors if t.expert)
    ep = args.expert_model_parallel_size
    dense_total = total - experts
    assert dense_total + experts * ep == cfg.count_parameters(include_mtp=True) + cfg.vocab_size * cfg.hidden_size
    assert [len(layout.stage_layers(r)) for r in range(4)] == [18, 21, 21, 18]


def test_recipe_32x8_verdicts():
    args = _args(["--config", str(RECIPE_32X8)], world=256)
    h100 = make_plan(args, GPUS["h100-80gb"])
    h200 = make_plan(args, GPUS["h200-141gb"])
    assert h100.total_params == args.model_config.count_parameters(include_mtp=True)
    assert not h100.fits and h200.fits
    assert h100.peak_memory_gib == h200.peak_memory_gib  # same layout, same bytes
    # a middle stage before activations: bf16 weights + fp32 grads + its optimizer shard (experts unsharded: EDP1)
    mid = h200.stage_worst(1).memory.static
    assert mid.params["experts"] * 12 <= mid.optimizer_bytes < (mid.params["experts"] + mid.params["dense"]) * 12
    assert 75 < (mid.weight_bytes + mid.grad_bytes + mid.optimizer_bytes) / 2 ** 30 < 85


def test_interleaved_schedule_keeps_more_in_flight():
    from megatron_glm5.planning.memory import micro_batches_in_flight

    assert micro_batches_in_flight(4, 0, 1, 8) == 4 and micro_batches_in_flight(4, 3, 1, 8) == 1
    assert micro_batches_in_flight(4, 0, 1, 2) == 2
    assert micro_batches_in_flight(4, 0, 2, 8) == (2 * 3 + 4 + 1) / 2 > 4


def test_json_output(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc, text, err = _run_tool(["--config", str(RECIPE_32X8), "--gpu", "h100-80gb", "--json", str(out)], capsys)
    assert rc == 0, err
    assert "DOES NOT FIT" in text and "ESTIMATE" in text
    d = json.loads(out.read_text())
    for key in ("total_params", "per_rank", "peak_memory_gib", "fits", "step_time_s", "tokens_per_s_per_gpu"):
        assert key in d
    assert len(d["per_rank"]) == 256 and d["fits"] is False and d["world_size"] == 256
    assert max(r["peak_memory_gib"] for r in d["per_rank"]) == d["peak_memory_gib"]


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "tiny", "--pp", "3", "--world-size", "3"], "--pp 3"),
    (["--preset", "tiny", "--tp", "3", "--world-size", "3"], "--tp 3"),
    (["--preset", "tiny", "--ep", "3", "--world-size", "3"], "--ep 3"),
    (["--preset", "tiny", "--tp", "2", "--world-size", "3"], "--tp"),
    (["--preset", "tiny", "--gpu", "a100"], "--gpu 'a100'"),
    (["--preset", "tiny", "--world-size", "0"], "--world-size"),
])
def test_bad_input_is_one_line(argv, needle, capsys):
    rc, _, err = _run_tool(argv, capsys)
    lines = [l for l in err.splitlines() if l.strip() and "warn" not in l.lower()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_config_with_unknown_key_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: tiny\ntensor-paralel-size: 2\n")
    rc, _, err = _run_tool(["--config", str(bad)], capsys)
    lines = [l for l in err.splitlines() if l.strip() and "warn" not in l.lower()]
    assert rc == 2 and len(lines) == 1 and "tensor-paralel-size" in lines[0] and "bad.yaml:2" in lines[0], err


def test_check_fits_refuses_in_one_line():
    from megatron_glm5.planning.check import MemoryCheckError, check_fits

    args = _args(["--preset", "glm5.3"], world=1)
    with pytest.raises(MemoryCheckError) as e:
        check_fits(args, ["--preset", "glm5.3"])
    msg = str(e.value)
    assert "\n" not in msg and "GiB" in msg and "python tools/plan_layout.py --preset glm5.3 --world-size 1" in msg
    args.skip_memory_check = True
    check_fits(args)  # skipped
    check_fits(_args(TINY, world=1))  # the tiny model fits anywhere


def test_calibration_table_replaces_the_estimate(tmp_path, monkeypatch):
    """With a calibration table the layers' compute is the measured time and the output says so."""
    from megatron_glm5.planning import calibration

    args = _args(["--preset", "glm5.3", "--pp", "4", "--decoder-first-pipeline-num-layers", "18",
                  "--decoder-last-pipeline-num-layers", "18", "--ep", "64", "--seq-length", "4096",
                  "--micro-batch-size", "1", "--global-batch-size", "512", "--recompute-granularity", "full",
                  "--use-distributed-optimizer", "--bf16"], world=256)
    monkeypatch.setattr(calibration, "table_path", lambda name: str(tmp_path / "none.json"))
    estimate = make_plan(args, GPUS["h200-141gb"])
    assert estimate.calibration is None and estimate.time.basis.startswith("ESTIMATE")
    rows = [{"layer": kind, "local_experts": 8 if kind == "moe" else None, "tokens": t, "recompute": True,
             "fwd_bwd_ms": ms * t / 4096, "hidden": 6144, "attn": "triton"}
            for kind, ms in (("dense", 20.0), ("moe", 40.0)) for t in (2048, 8192)]
    table = tmp_path / "calibration_h200.json"
    table.write_text(json.dumps({"date": "2026-12-01", "device": "test", "command": "test", "rows": rows}))
    monkeypatch.setattr(calibration, "table_path", lambda name: str(table))
    measured = make_plan(args, GPUS["h200-141gb"])
    assert measured.time.basis.startswith("measured layer times") and "timed as 8" in measured.time.basis
    stage1 = measured.time.stages[1]  # 21 MoE layers at 40 ms (interpolated at 4096 tokens)
    assert stage1.measured_layers == 21 and stage1.estimated_layers == 0
    assert abs(stage1.compute_s - 21 * 0.040) < 1e-9


def test_smallest_search(capsys):
    from megatron_glm5.planning.search import uneven_split

    assert uneven_split(78, 4) == (19, 19) and uneven_split(78, 6) is None and uneven_split(78, 14) == (3, 3)
    with pytest.raises(ValueError):
        uneven_split(7, 2)
    rc, text, err = _run_tool(["--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "1",
                               "--global-batch-size", "8", "--gpu", "h100-80gb", "--smallest"], capsys)
    assert rc == 0, err
    assert text.startswith("smallest world size where a layout fits h100-80gb: 8 ")


def test_training_script_refuses_a_model_this_machine_cannot_hold(tmp_path):
    """`python finetune_glm5.py --preset glm5.3` on a CPU machine: one line with the estimate, the memory there is
    and the plan_layout command, before any model is built (it used to die in the allocator after 32 s)."""
    from training_helpers import assert_user_error, run_entry

    proc = run_entry("finetune", ["--preset", "glm5.3", "--train-iters", "2"], tmp_path, timeout=120)
    msg = assert_user_error(proc, "rank 0 (pipeline stage 0) needs about", "GiB", "tools/plan_layout.py",
                            "--skip-memory-check", workdir=tmp_path)
    assert "available memory" in msg


GIB_ = 1 << 30


@pytest.mark.parametrize("n_q,n_keys,heads,det,want", [
    (4096, 4096, 64, False, 2 * GIB_),  # dense, 1,024-row chunks of 2 x 4096 x 1024 x 64 x 2 B = 1 GiB, two (ahead)
    (8192, 8192, 64, False, GIB_),  # dense, n_keys > 2 x top-k: one 512-row buffer kept zero
    (32768, 32768, 64, False, GIB_),  # slots: 2,048 rows of 2 x 2048 x 64 x 2 B
    (32768, 32768, 64, True, GIB_),  # deterministic: dense (16 <= 20), kept, 128-row chunks
    (4096, 4096, 8, False, GIB_ // 2),  # TP8: one chunk of all 4,096 rows (2 x 4096 x 4096 x 8 x 2 B), no second
])
def test_sparse_backward_buffer_bytes(n_q, n_keys, heads, det, want):
    """The P / dS buffers our sparse-MLA backward holds (ops/sparse_bwd_budget.py), figures worked out by hand from
    its 1 GiB chunk budget and the formulation rules."""
    from megatron_glm5.ops.sparse_bwd_budget import backward_buffer_bytes

    assert backward_buffer_bytes(n_q, n_keys, heads, 2048, deterministic=det) == want


@pytest.mark.parametrize("n_keys,det,held,kept", [
    # atomic, slots (16 keys per slot) + the dense prefix's kept buffer: rows below 6 x 2048 = 12,288 keys, in
    # chunks sized for all 32,768 keys (128 rows): 2 x 12288 x 128 x 64 x 2 B = 384 MiB
    (32768, False, GIB_ + 384 * 2**20, 384 * 2**20),
    # 24,576 keys: 170-row chunks (1 GiB / (2 x 24576 x 64 x 2 B)): 2 x 12288 x 170 x 64 x 2 B
    (24576, False, GIB_ + 2 * 12288 * 170 * 64 * 2, 2 * 12288 * 170 * 64 * 2),
    (16384, False, GIB_, GIB_),  # dense for the whole (8 keys per slot), kept zero: no prefix
    (32768, True, GIB_, GIB_),  # deterministic: dense, no prefix by default
])
def test_sparse_backward_buffer_bytes_with_the_dense_prefix(n_keys, det, held, kept):
    """Our TileLang backward (BWD_CONFIG's default DENSE_PREFIX "atomic") keeps its dense prefix's buffer zero
    between backwards on top of the "slots" buffer; figures worked out by hand."""
    from megatron_glm5.ops.sparse_bwd_budget import backward_buffer_bytes, kept_buffer_bytes

    assert backward_buffer_bytes(n_keys, n_keys, 64, 2048, deterministic=det, dense_prefix=True) == held
    assert kept_buffer_bytes(n_keys, n_keys, 64, 2048, deterministic=det, dense_prefix=True) == kept
    assert kept_buffer_bytes(n_keys, n_keys, 64, 2048, deterministic=det) == (0 if n_keys > 16384 and not det
                                                                              else GIB_)


@pytest.mark.parametrize("seq,det,want", [(4096, False, "dense"), (16384, False, "dense"), (24576, False, "slots"),
                                          (32768, False, "slots"), (32768, True, "dense"), (65536, True, "slots")])
def test_the_backwards_dk_formulation_by_keys_per_slot(seq, det, want):
    """DK "auto" at causal lengths with top-k 2048: dense up to 8 keys per slot in atomic mode (16384; the H100's
    measured crossover lies between 8 and 12), 20 in deterministic mode."""
    from megatron_glm5.ops.sparse_bwd_budget import auto_dk_mode

    assert auto_dk_mode(seq, 2048, det) == want


def test_planner_counts_the_sparse_backward_buffers_in_the_working_set():
    """--attn triton at 4096 tokens: 2 GiB more working set than --attn cudnn (whose backward is cuDNN's) on a middle
    stage of the LoRA recipe; the dense warm-up stage runs no sparse backward; at 8192 tokens the kept buffer (1 GiB)
    also stays through the optimizer step."""
    from megatron_glm5.planning.memory import sparse_backward_bytes

    recipe = str(REPO / "examples" / "recipes" / "glm5.3_lora_1x8.yaml")
    plans = {attn: make_plan(_args(["--config", recipe, "--attn", attn], world=8), GPUS["h200-141gb"])
             for attn in ("triton", "cudnn")}
    mid = {attn: plan.stage_worst(1).memory for attn, plan in plans.items()}
    assert mid["triton"].working_bytes - mid["cudnn"].working_bytes == 2 * GIB_
    assert mid["triton"].optimizer_step_bytes == mid["cudnn"].optimizer_step_bytes
    args = _args(["--config", recipe, "--attn", "triton"], world=8)
    layout = build_layout(args)
    assert sparse_backward_bytes(args, layout) == (2 * GIB_, 0)
    long = _args(["--config", recipe, "--attn", "triton", "--seq-length", "8192"], world=8)
    assert sparse_backward_bytes(long, build_layout(long)) == (GIB_, GIB_)
    sparse = _args(["--config", str(RECIPE_32X8), "--attn", "triton"], world=256)
    warmup = _args(["--config", str(RECIPE_32X8), "--attn", "triton", "--dsa-stage", "dense-warmup"], world=256)
    assert sparse_backward_bytes(sparse, build_layout(sparse))[0] > 0
    assert sparse_backward_bytes(warmup, build_layout(warmup)) == (0, 0)
