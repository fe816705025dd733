"""The memory options (megatron_glm5/training/memory_options.py) change what they say and keep the numerics.

One subprocess builds the tiny model in bf16 (the flags refuse bf16 without a GPU, so the script sets it, as
tests/test_checkpoint_mixed_precision.py does) four times -- fp32 gradient reduction (the reference), bf16
reduction, the optimizer's CPU offload at fraction 1.0, and both -- through the trainer's own wrap_ddp /
build_optimizer / micro-batch loop with the distributed optimizer, and trains 3 steps of 2 micro-batches on the
same tokens.

* --grad-reduce-dtype bf16 (CPU): every DDP gradient buffer is bf16 (fp32 by default) and the planner's gradient
  bytes equal the buffers' exactly; step 1's loss is bit-equal (same weights), steps 2-3 within 1e-3 relative,
  step 3 not equal (bf16 gradients: the accumulation over micro-batches and the 1/tokens scaling round to 8 bits of
  mantissa; on CPU step 2 is still bit-equal -- Adam's first update is about the gradient's sign, which the
  rounding keeps -- and step 3 differs by 7e-6).
* --optimizer-cpu-offload, built on CPU: the optimizer is megatron-core's HybridDeviceOptimizer and the
  distributed optimizer keeps no fp32 main copies of its own (the planner's GPU optimizer bytes: 0).  It cannot
  step on CPU: megatron-core's HybridDeviceOptimizer treats every non-CUDA parameter as the host copy of a GPU one
  (``KeyError`` in ``_set_sub_optimizer_grads``: ``self.cpu_copys_map_gpu_param[param]``), so training with it is
  the GPU test's: the fp32 master weights and Adam moments live on the CPU, their bytes (with the gradients'
  pinned host copies, 16 per element) equal the planner's host bytes, and 3 steps' losses equal the reference's
  within 1e-3 relative -- not bit-equal: the host steps with torch's fused CPU AdamW, the reference with torch's
  foreach AdamW on the GPU (the same update rounded in another order, then rounded to bf16 weights).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron_glm5 import platform
    from megatron_glm5.mcore_patches import registry as mcore_patches
    from megatron_glm5.mcore_patches.record import Phase
    from megatron_glm5.arguments import parse_args, validate_args
    from megatron_glm5.planning.plan import plan_rank
    from megatron_glm5.training import loop
    from megatron_glm5.training.optim import build_optimizer

    mcore_patches.apply_phase(Phase.TRAINING)
    SEQ = 32
    g = torch.Generator().manual_seed(7)
    BATCHES = []
    for _ in range(6):
        t = torch.randint(0, 512, (1, SEQ + 1), generator=g)
        BATCHES.append(dict(tokens=t[:, :-1], labels=t[:, 1:], position_ids=torch.arange(SEQ)[None],
                            loss_mask=torch.ones(1, SEQ)))

    def run(grad_dtype, offload):
        args = parse_args(["--preset", "tiny", "--attn", "torch", "--seq-length", str(SEQ), "--micro-batch-size",
                           "1", "--global-batch-size", "2", "--no-mtp", "--use-distributed-optimizer",
                           "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "3"],
                          mode="pretrain")
        validate_args(args, world_size=1)
        args.bf16, args.params_dtype = True, torch.bfloat16  # the flags refuse bf16 without a GPU
        args.grad_reduce_dtype = grad_dtype
        args.optimizer_cpu_offload, args.optimizer_offload_fraction = offload, (1.0 if offload else None)
        torch.manual_seed(3)
        platform.initialize_model_parallel(seed=3)
        model = loop.wrap_ddp(args, loop.build_model_chunks(args))
        optimizer = build_optimizer(args, model)
        config = model[0].module.config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = model[0].no_sync
        buffers = [b for d in model for b in list(d.buffers) + list(d.expert_parallel_buffers)]
        out = dict(grad_dtypes=sorted({str(b.grad_data.dtype) for b in buffers}),
                   grad_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers))
        plan = plan_rank(args, 0).memory.static
        out.update(planned_grad_bytes=plan.grad_bytes, planned_gpu_optimizer_bytes=plan.optimizer_bytes,
                   planned_host_bytes=plan.host_optimizer_bytes)
        data = iter(BATCHES)
        losses = []
        train = not offload or torch.cuda.is_available()  # on CPU megatron-core's offload cannot step (docstring)
        for _ in range(3 if train else 0):
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            outputs = loop._run_microbatches(args, model, data, forward_only=False, num_microbatches=2)
            ok, _, _ = optimizer.step()
            assert ok
            losses.append(loop._reduce_lm_loss(outputs))
        out["losses"] = losses
        inner = [o.optimizer for o in optimizer.chained_optimizers]
        out["inner"] = sorted({type(o).__name__ for o in inner})
        out["own_main_copies"] = sum(p.numel() for o in optimizer.chained_optimizers
                                     for grp in o.shard_fp32_from_float16_groups for p in grp if p is not None)
        host = 0
        devs = set()
        for o in inner:
            for st in o.state.values():
                for k in ("master_param", "exp_avg", "exp_avg_sq"):
                    if k in st:
                        host += st[k].numel() * st[k].element_size()
                        devs.add(f"{k}:{st[k].device.type}:{str(st[k].dtype)}")
            host_grads = getattr(o, "cpu_copy_map_grad", {})
            host += sum(t.numel() * t.element_size() for t in host_grads.values())
        out["state_bytes"], out["state_devices"] = host, sorted(devs)
        ps.destroy_model_parallel()
        return out

    result = {name: run(*cfg) for name, cfg in (("fp32", ("fp32", False)), ("bf16", ("bf16", False)),
                                                ("offload", ("fp32", True)), ("offload_bf16", ("bf16", True)))}
    print("RESULT " + json.dumps(result))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("memory_options")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=cwd, capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
                            "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_bf16_grad_reduction_buffers_and_losses(runs):
    ref, bf16 = runs["fp32"], runs["bf16"]
    assert ref["grad_dtypes"] == ["torch.float32"]
    assert bf16["grad_dtypes"] == ["torch.bfloat16"]
    assert bf16["grad_bytes"] * 2 == ref["grad_bytes"]  # the same padded buffers, 2 bytes per element instead of 4
    for r in (ref, bf16):
        assert r["planned_grad_bytes"] == r["grad_bytes"]
    assert len(ref["losses"]) == len(bf16["losses"]) == 3
    assert bf16["losses"][0] == ref["losses"][0]
    assert bf16["losses"][2] != ref["losses"][2], "bf16 gradients should round somewhere (else the option did nothing)"
    for a, b in zip(bf16["losses"][1:], ref["losses"][1:]):
        assert _rel(a, b) < 1e-3


def test_optimizer_cpu_offload_builds_megatron_cores_hybrid_optimizer(runs):
    ref = runs["fp32"]
    assert ref["inner"] == ["AdamW"] and ref["own_main_copies"] > 0 and ref["planned_host_bytes"] == 0
    assert ref["planned_gpu_optimizer_bytes"] == ref["own_main_copies"] * 12  # fp32 main copy + Adam m, v
    for name in ("offload", "offload_bf16"):
        r = runs[name]
        assert r["inner"] == ["HybridDeviceOptimizer"], name
        assert r["own_main_copies"] == 0, name  # the precision-aware path: the master copies are the offload's
        assert r["planned_gpu_optimizer_bytes"] == 0, name
        assert r["planned_host_bytes"] == ref["own_main_copies"] * 16, name
    assert runs["offload_bf16"]["grad_dtypes"] == ["torch.bfloat16"]


@pytest.mark.gpu
def test_optimizer_cpu_offload_state_on_host_and_losses(runs):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: megatron-core's HybridDeviceOptimizer steps only GPU parameters")
    ref = runs["fp32"]
    for name in ("offload", "offload_bf16"):
        r = runs[name]
        assert r["state_devices"] == ["exp_avg:cpu:torch.float32", "exp_avg_sq:cpu:torch.float32",
                                      "master_param:cpu:torch.float32"], name
        assert r["state_bytes"] == r["planned_host_bytes"] == ref["own_main_copies"] * 16, name
        assert len(r["losses"]) == 3 and r["losses"][0] == ref["losses"][0], name
    for a, b in zip(runs["offload"]["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-3
    for a, b in zip(runs["offload_bf16"]["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-3


# ---- bad combinations: one line naming the flag (docs/bad_input.md), before anything is built

def _plan_layout_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_plan_layout_tool", REPO / "tools" / "plan_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


BAD = {  # case -> (entry, flags, words of the one error line)
    "offload_without_distributed_optimizer": ("plan", ["--optimizer-cpu-offload"],
                                              ["--optimizer-cpu-offload needs --use-distributed-optimizer"]),
    "offload_fp32": ("plan", ["--optimizer-cpu-offload", "--use-distributed-optimizer", "--no-bf16"],
                     ["--optimizer-cpu-offload needs bf16 parameters"]),
    "fraction_without_offload": ("plan", ["--optimizer-offload-fraction", "0.5"],
                                 ["--optimizer-offload-fraction needs --optimizer-cpu-offload"]),
    "overlap_without_offload": ("plan", ["--overlap-cpu-optimizer-d2h-h2d"],
                                ["--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"]),
    "fraction_out_of_range": ("plan", ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
                              ["--optimizer-offload-fraction", "[0, 1]"]),
    "bf16_reduction_of_fp32_training": ("finetune", ["--grad-reduce-dtype", "bf16", "--no-save"],
                                        ["--grad-reduce-dtype bf16 needs bf16 parameters"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_memory_option_combinations_are_one_line(case, capsys):
    from megatron_glm5.training.entry import main as train_main

    entry, flags, words = BAD[case]
    main = _plan_layout_main() if entry == "plan" else (lambda argv: train_main(entry, argv))
    capsys.readouterr()
    try:
        rc = main(flags)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
