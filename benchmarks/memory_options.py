"""Each memory option on one GPU: peak memory and step time of one full-width rank, beside the planner's prediction.

    python benchmarks/memory_options.py --json memory_options.json          # on the H200, about 3-4 minutes

One rank of a deep layout of the seed recipe (``examples/recipes/glm5.3_sft_32x8.yaml`` at PP26 x EP32, so that a
middle stage holds 3 GLM-5.3 MoE layers at full width with 8 local experts each, 2 micro-batches of 4096 tokens,
full recompute, the distributed optimizer) is run by ``benchmarks/rank_emulation.py`` (its docstring says how one
process stands for a rank of the layout: the real model chunks, DDP buffers and optimizer shard, a local
permutation for the dispatch, no communication), once per option set, each in a fresh process:

    none              the recipe as shipped (fp32 gradient buffers, optimizer state on the GPU)
    bf16-grads        --grad-reduce-dtype bf16
    offload           --optimizer-cpu-offload (fraction 1.0)
    offload+bf16      both

For each it prints the measured peak allocation (forward/backward and optimizer step), the weights + gradients +
optimizer state left allocated after a step, the step time and the optimizer step's time, next to the planner's
figures for the same rank (``planning.plan.make_plan``, which knows the options), and writes them all as JSON
(``--json``; stdout gets the same JSON last).  ``--configs`` runs a subset; ``--rank-emulation-flags`` replaces the
layout (e.g. ``--preset tiny`` ones for a CPU dry run, where the offload cannot step: megatron-core's
HybridDeviceOptimizer steps GPU parameters only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3

CONFIGS = {
    "none": [],
    "bf16-grads": ["--grad-reduce-dtype", "bf16"],
    "offload": ["--optimizer-cpu-offload"],
    "offload+bf16": ["--optimizer-cpu-offload", "--grad-reduce-dtype", "bf16"],
}
# a middle stage of 3 MoE layers: 78 = 3 + 24 x 3 + 3 over PP26; EP32 -> 8 local experts; world lcm(26, 32 x 26) = 832,
# DP 32: a global batch of 64 is 2 micro-batches per pipeline
WORLD = 832
LAYOUT = ["--config", str(REPO / "examples/recipes/glm5.3_sft_32x8.yaml"), "--pp", "26", "--ep", "32",
          "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3",
          "--global-batch-size", "64", "--attn", "triton"]


def run_one(name: str, extra, opts, out_dir: str) -> dict:
    path = os.path.join(out_dir, f"{name}.json")
    layout = shlex.split(opts.rank_emulation_flags) if opts.rank_emulation_flags else LAYOUT
    cmd = [sys.executable, str(REPO / "benchmarks/rank_emulation.py"), "--world-size", str(opts.world_size),
           "--steps", str(opts.steps), "--warmup", "1", "--gpu", opts.gpu, "--json", path, "--"] + layout + extra
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=opts.timeout)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not os.path.exists(path):
        return {"config": name, "flags": extra, "ok": False, "wall_s": wall, "returncode": r.returncode,
                "stderr_tail": r.stderr[-2000:]}
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    m, p = res["measured"], res["predicted"]
    mem = p["memory_bytes"]
    return {
        "config": name, "flags": extra, "ok": True, "wall_s": wall, "rank": res["rank"],
        "stage_layers": res["stage_layers"], "local_experts": res["local_experts"],
        "measured": {
            "peak_fwd_bwd_gib": m["peak_fwd_bwd_bytes"] / GIB,
            "peak_optimizer_step_gib": m["peak_optimizer_step_bytes"] / GIB,
            "static_after_step_gib": m["allocated_after_steps_bytes"] / GIB,
            "max_reserved_gib": m["max_memory_reserved_bytes"] / GIB,
            "step_s": m["step_s"], "optimizer_ms": m["optimizer_ms"]},
        "predicted": {
            "peak_fwd_bwd_gib": p["fwd_bwd_peak_without_dispatch_bytes"] / GIB,
            "peak_optimizer_step_gib": p["optimizer_step_peak_bytes"] / GIB,
            "static_gib": p["static_bytes"] / GIB,
            "gradients_gib": mem["gradients"] / GIB,
            "gpu_optimizer_state_gib": (mem["optimizer_main_params"] + mem["optimizer_moments"]) / GIB,
            "step_s": p["emulated_step_s"], "optimizer_ms": p["optimizer_s"] * 1e3},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--world-size", type=int, default=WORLD)
    p.add_argument("--rank-emulation-flags", default=None,
                   help="training flags of the layout instead of the default deep seed-recipe layout (one string)")
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    p.add_argument("--gpu", default="h200-141gb", help="the planner's GPU")
    p.add_argument("--timeout", type=int, default=150, help="seconds per option set")
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)

    import torch

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.configs:
            r = run_one(name, CONFIGS[name], opts, tmp)
            runs.append(r)
            if r["ok"]:
                me, pr = r["measured"], r["predicted"]
                print(f"{name:>13}: peak fwd/bwd {me['peak_fwd_bwd_gib']:.2f} GiB (planner "
                      f"{pr['peak_fwd_bwd_gib']:.2f}), optimizer step {me['peak_optimizer_step_gib']:.2f} "
                      f"({pr['peak_optimizer_step_gib']:.2f}); step {me['step_s']:.2f} s ({pr['step_s']:.2f}), "
                      f"optimizer {me['optimizer_ms']:.0f} ms ({pr['optimizer_ms']:.0f}); {r['wall_s']:.0f} s wall",
                      flush=True)
            else:
                print(f"{name:>13}: FAILED (exit {r['returncode']}): {r['stderr_tail'][-400:]}", flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "command": "python benchmarks/memory_options.py " + " ".join(map(shlex.quote, argv or sys.argv[1:])),
        "world_size": opts.world_size,
        "layout_flags": opts.rank_emulation_flags or " ".join(map(shlex.quote, LAYOUT)),
        "runs": runs,
    }
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
