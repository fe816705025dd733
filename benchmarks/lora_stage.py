"""One GPU's share of the one-node GLM-5.3 LoRA run (examples/recipes/glm5.3_lora_1x8.yaml): a middle pipeline stage
of PP8 (10 MoE layers at full width, all 256 experts each, frozen base in FP8 when --base-precision exists, LoRA
rank 16 on attention + routed experts, sequence 4096, full recompute), built directly on the GPU (no checkpoint),
trained for --steps optimizer steps; prints JSON with peak memory, ms per step and tokens/s, beside the planner's
prediction for that rank.

    python benchmarks/lora_stage.py --json lora_stage.json            # on one H200
    python benchmarks/lora_stage.py --tiny --steps 2 --json out.json  # tiny preset, on CPU (tests)

The stage runs through benchmarks/rank_emulation.py (rank 1 of a world of 8 on torch's fake process group: the
real model chunk, DDP and optimizer of that rank, built by training/loop.py; the MoE dispatch replaced by a
local permutation at the balanced load; one micro-batch per step, so a step is one forward + backward +
optimizer step of this stage).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-target-modules", "attention,experts"]
FULL = ["--preset", "glm5.3", "--pp", "8", "--decoder-first-pipeline-num-layers", "9",
        "--decoder-last-pipeline-num-layers", "9", "--bf16", "--attn", "triton", "--seq-length", "4096",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1", "--no-mtp"]
TINY = ["--preset", "tiny", "--pp", "2", "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", "--no-mtp",
        "--attn", "torch", "--lora-rank", "4", "--lora-target-modules", "attention,experts"]


def has_fp8_base_flag() -> bool:
    from megatron_glm5.arguments import build_parser

    return any("--base-precision" in a.option_strings for a in build_parser("finetune")._actions)  # noqa: SLF001


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny preset (CPU), PP2, rank 1")
    p.add_argument("--steps", type=int, default=50, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--bf16-base", action="store_true", help="a bf16 base even when --base-precision fp8 exists")
    opts = p.parse_args(argv)
    import rank_emulation

    fp8 = has_fp8_base_flag() and not opts.bf16_base and not opts.tiny
    flags = list(TINY if opts.tiny else FULL + LORA) + (["--base-precision", "fp8"] if fp8 else [])
    world = 2 if opts.tiny else 8
    if not fp8 and not opts.tiny:  # 10 layers of a bf16 base are 193 GB: a PP13 stage (6 layers) instead
        print("no frozen FP8 base (--base-precision fp8) in this tree: timing a bf16 base's PP13 stage (6 layers) "
              "instead of the one-node PP8 stage", flush=True)
        i = flags.index("--pp")
        flags[i + 1] = "13"
        for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
            j = flags.index(flag)
            del flags[j:j + 2]
        world = 13
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "emulation.json")
        rank_emulation.main(["--world-size", str(world), "--rank", "1", "--steps", str(opts.steps), "--warmup", "1",
                             "--json", out, "--", *flags])
        with open(out, encoding="utf-8") as f:
            emulated = json.load(f)
    m = emulated["measured"]
    tokens = emulated["seq_length"] * emulated["micro_batch_size"] * emulated["num_microbatches"]
    result = {
        "date": emulated["date"], "device": emulated["device"], "torch": emulated["torch"],
        "command": "python benchmarks/lora_stage.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "base": "fp8" if fp8 else ("bf16 (PP13 stage)" if not opts.tiny else "fp32 (tiny, CPU)"),
        "fp8_base_available": has_fp8_base_flag(),
        "stage_layers": emulated["stage_layers"], "moe_layers": emulated["moe_layers"],
        "local_experts": emulated["local_experts"], "seq_length": emulated["seq_length"], "steps": opts.steps,
        "peak_memory_gib": m["peak_bytes"] / 2 ** 30, "peak_fwd_bwd_gib": m["peak_fwd_bwd_bytes"] / 2 ** 30,
        "max_memory_reserved_gib": m["max_memory_reserved_bytes"] / 2 ** 30,
        "ms_per_step": m["step_s"] * 1e3, "tokens_per_s": tokens / m["step_s"],
        "forward_ms": m["forward_ms"], "backward_ms": m["backward_ms"], "optimizer_ms": m["optimizer_ms"],
        "planner": {k: emulated["predicted"][k] for k in ("static_bytes", "optimizer_step_peak_bytes",
                                                          "fwd_bwd_peak_without_dispatch_bytes")
                    if k in emulated["predicted"]},
        "flags": flags,
    }
    print(json.dumps(result, indent=1))
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
