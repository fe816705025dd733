#!/usr/bin/env python
"""Will a GLM-5 layout fit, and how fast will it go?  Launches nothing.

    python tools/plan_layout.py --config examples/recipes/glm5.3_sft_32x8.yaml --gpu h100-80gb
    python tools/plan_layout.py --preset glm5.3 --pp 4 --ep 64 ... --world-size 256 --gpu h200-141gb --json plan.json

Every flag of finetune_glm5.py (or, with --mode pretrain, of pretrain_glm5.py) is accepted and checked exactly as
training checks it; the planner's own flags are --world-size (default: the smallest the layout allows),
--gpu (megatron_glm5/planning/gpus.py), --json FILE, --mode, --efficiency and --smallest (planning/search.py).
See docs/scaling.md.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.arguments import ArgumentError, main_guard, parse_args, validate_args  # noqa: E402


def _own_flags(argv):
    from megatron_glm5.planning.gpus import GPUS
    from megatron_glm5.planning.step_time import DEFAULT_EFFICIENCY

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--gpu", default="h200-141gb")
    p.add_argument("--json", default=None)
    p.add_argument("--mode", default="finetune", choices=("finetune", "pretrain"))
    p.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY)
    p.add_argument("--smallest", action="store_true")
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        print(f"\nplanner flags: --world-size N, --gpu {{{', '.join(GPUS)}}}, --json FILE, --mode "
              f"{{finetune,pretrain}}, --efficiency X (default {DEFAULT_EFFICIENCY:g}), --smallest (search the "
              "smallest world size where some TP/PP/EP layout fits, the other flags kept); training flags: "
              "python finetune_glm5.py --help")
        sys.exit(0)
    try:
        own, rest = p.parse_known_args(argv)
    except SystemExit:
        raise ArgumentError("bad planner flag (--world-size N, --gpu NAME, --json FILE, --mode, --efficiency X)",
                            flag="--world-size") from None
    if own.world_size is not None and own.world_size < 1:
        raise ArgumentError(f"--world-size must be a positive integer, got {own.world_size}", flag="--world-size")
    if not 0 < own.efficiency <= 1:
        raise ArgumentError(f"--efficiency must be in (0, 1], got {own.efficiency:g}", flag="--efficiency")
    return own, rest


def smallest_world(args) -> int:
    """The smallest world size the layout allows: lcm(TP x PP x CP, ETP x EP x PP)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or 1
    return math.lcm(tp * pp * cp, etp * ep * pp)


@main_guard
def main(argv=None):
    from megatron_glm5.planning.gpus import get_gpu
    from megatron_glm5.planning.plan import make_plan
    from megatron_glm5.planning.report import render

    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = _own_flags(argv)
    gpu = get_gpu(own.gpu)
    if own.smallest:
        return _smallest(rest, own, gpu)
    args = parse_args(rest, mode=own.mode)
    if args.bf16 is None:
        args.bf16 = True  # a GPU run is planned: bf16 unless --no-bf16 (training defaults to the local device's)
    world = own.world_size or smallest_world(args)
    args = validate_args(args, world_size=world, check_device=False)
    plan = make_plan(args, gpu, efficiency=own.efficiency)
    print(render(plan))
    if own.json:
        with open(own.json, "w", encoding="utf-8") as f:
            json.dump(plan.to_json(), f, indent=1)
        print(f"wrote {own.json}")
    return 0


def _smallest(rest, own, gpu) -> int:
    from megatron_glm5.planning.search import layout_flags, smallest_fitting

    worlds = range(gpu.gpus_per_node, 2049, gpu.gpus_per_node)
    world, plans = smallest_fitting(rest, own.mode, gpu, worlds)
    if not plans:
        print(f"no TP/PP/EP layout of these flags fits {gpu.name} up to {worlds[-1]} GPUs")
        return 1
    print(f"smallest world size where a layout fits {gpu.name}: {world} ({len(plans)} layouts; fastest first, "
          f"time an ESTIMATE unless calibrated)")
    for p in plans[:8]:
        print(f"  {layout_flags(p.args):<90} peak {p.peak_memory_gib:6.1f} GiB  "
              f"{p.time.tokens_per_s_per_gpu:5.0f} tokens/s/GPU")
    return 0


if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    sys.exit(main())
