"""Optimizer step time and memory: --optimizer muon against adam, built exactly as training builds them.

    python benchmarks/muon_step.py [--steps 5] [--json muon_step.json] [-- <training flags>]

Default training flags: on a GPU the 1-GPU full-width proxy (examples/proxy/config.json: GLM-5 width, 4 layers =
3 dense + 1 MoE with 32 experts, bf16, no MTP); on CPU the tiny preset in fp32 (a smoke run). Each variant (adam,
muon, muon --no-muon-split-heads) runs in a fresh subprocess: model chunks, DDP, optimizer and its zero state
(training/loop.py wrap_ddp, training/optim.py build_optimizer / ensure_optimizer_state), then --steps timed
optimizer.step() calls on random gradients after one warm-up (planning/measure.py time_optimizer_step: CUDA events,
median). Reported per variant: step ms, optimizer state bytes (Adam's two moments, Muon's momentum buffer), fp32
main-copy bytes, GPU memory allocated before the steps and the peak above it during them. JSON on stdout (and in
--json): figures, device, command.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROXY = ["--hf-config", str(REPO / "examples/proxy/config.json"), "--bf16", "--no-mtp", "--attn", "torch",
         "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "1", "--no-save"]
TINY = ["--preset", "tiny", "--attn", "torch", "--no-save"]
VARIANTS = {"adam": ["--optimizer", "adam"], "muon": ["--optimizer", "muon"],
            "muon-no-split-heads": ["--optimizer", "muon", "--no-muon-split-heads"]}


def _state_bytes(optimizer) -> dict:
    from megatron_glm5.training.muon_setup import leaf_optimizers

    model_storages = set()
    for opt in leaf_optimizers(optimizer):
        for group in getattr(opt, "float16_groups", []):
            model_storages.update(p.untyped_storage().data_ptr() for p in group)
    state = main = 0
    for opt in leaf_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                for v in inner.state[p].values():
                    if hasattr(v, "numel") and v.dim() > 0:
                        state += v.numel() * v.element_size()
        for group in getattr(opt, "fp32_from_float16_groups", []):
            main += sum(p.numel() * p.element_size() for p in group)
    return dict(optimizer_state_bytes=state, optimizer_main_param_bytes=main)


def one(flags, steps: int) -> dict:
    import torch

    from megatron_glm5 import platform
    from megatron_glm5.arguments import parse_args, validate_args
    from megatron_glm5.mcore_patches import registry as mcore_patches
    from megatron_glm5.mcore_patches.record import Phase
    from megatron_glm5.planning.measure import time_optimizer_step
    from megatron_glm5.training.loop import build_model_chunks, wrap_ddp
    from megatron_glm5.training.optim import build_optimizer, ensure_optimizer_state

    args = validate_args(parse_args(flags, mode="pretrain"), world_size=1)
    mcore_patches.apply_phase(Phase.TRAINING)
    platform.initialize_model_parallel(seed=args.seed)
    model = wrap_ddp(args, build_model_chunks(args))
    optimizer = build_optimizer(args, model)
    ensure_optimizer_state(optimizer)
    cuda = torch.cuda.is_available()
    out = dict(_state_bytes(optimizer), params=sum(p.numel() for m in model for p in m.parameters()))
    if cuda:
        torch.cuda.synchronize()
        out["allocated_before_steps_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out["optimizer_step_ms"] = time_optimizer_step(model, optimizer, steps)
    if cuda:
        out["step_peak_above_allocated_bytes"] = torch.cuda.max_memory_allocated() - out["allocated_before_steps_bytes"]
    return out


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="benchmarks/muon_step.py")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant, in its own subprocess
    opts = p.parse_args(argv[:split])
    train_flags = argv[split + 1:]
    if opts.one is not None:
        print("RESULT " + json.dumps(one(train_flags, opts.steps)), flush=True)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    base = train_flags or (PROXY if cuda else TINY)
    results = {}
    for name, extra in VARIANTS.items():
        cmd = [sys.executable, __file__, "--steps", str(opts.steps), "--one", name, "--", *base, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.stderr.write(r.stderr[-4000:])
            results[name] = {"error": f"exit {r.returncode}"}
            continue
        results[name] = json.loads(line[len("RESULT "):])
    report = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  command=" ".join(["python", "benchmarks/muon_step.py", *sys.argv[1:]]), flags=base,
                  steps=opts.steps, results=results)
    if "error" not in results["adam"] and "error" not in results["muon"]:
        a, m = results["adam"], results["muon"]
        report["muon_vs_adam"] = dict(step_time_ratio=m["optimizer_step_ms"] / a["optimizer_step_ms"],
                                      state_bytes_ratio=m["optimizer_state_bytes"] / a["optimizer_state_bytes"])
    text = json.dumps(report, indent=1)
    print(text)
    if opts.json:
        Path(opts.json).write_text(text + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
