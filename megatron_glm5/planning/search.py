"""The smallest world size at which some layout fits: the run's other flags kept, TP / PP / EP varied.

For each world size (ascending) every TP in {1, 2, 4, 8}, PP from 1 to 16 (an uneven first = last split with equal
middle stages where PP does not divide the layers) and EP dividing the experts (ETP 1, no virtual stages) that
the training scripts' validation accepts is planned; the first world size where at least one fits ends the
search.  The global batch is kept, so layouts whose data-parallel size does not divide it are skipped.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_glm5.arguments import ArgumentError, parse_args, validate_args
from megatron_glm5.config import ConfigError

TPS = (1, 2, 4, 8)
MAX_PP = 16


def uneven_split(num_layers: int, pp: int) -> Optional[Tuple[int, int]]:
    """(first, last) stage layers when PP does not divide the layers (middle stages equal, first = last as close to
    layers / PP as possible, the lighter side preferred); None when it divides; ValueError when no split exists."""
    if num_layers % pp == 0:
        return None
    options = [f for f in range(1, num_layers // 2 + 1)
               if pp >= 3 and num_layers - 2 * f > 0 and (num_layers - 2 * f) % (pp - 2) == 0]
    if not options:
        raise ValueError(f"no even split of {num_layers} layers over {pp} stages")
    target = num_layers / pp
    f = min(options, key=lambda f: (f > target, abs(f - target)))
    return f, f


def _with_layout(base: List[str], mode: str, tp: int, pp: int, ep: int, split):
    args = parse_args(base, mode=mode)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, 1
    args.virtual_pipeline_model_parallel_size = None
    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = split or (None, None)
    if args.bf16 is None:
        args.bf16 = True
    return args


def layout_flags(args) -> str:
    flags = [f"--tp {args.tensor_model_parallel_size}", f"--pp {args.pipeline_model_parallel_size}",
             f"--ep {args.expert_model_parallel_size}", "--etp 1"]
    if args.decoder_first_pipeline_num_layers:
        flags += [f"--decoder-first-pipeline-num-layers {args.decoder_first_pipeline_num_layers}",
                  f"--decoder-last-pipeline-num-layers {args.decoder_last_pipeline_num_layers}"]
    return " ".join(flags)


def candidates(base: List[str], mode: str, world: int):
    """Validated args of every layout the training scripts accept at ``world`` ranks."""
    cfg = validate_args(_with_layout(base, mode, 1, 1, 1, None), world_size=1, check_device=False).model_config
    experts = [e for e in range(1, cfg.n_routed_experts + 1) if cfg.n_routed_experts % e == 0]
    for tp in TPS:
        for pp in range(1, MAX_PP + 1):
            try:
                split = uneven_split(cfg.num_hidden_layers, pp)
            except ValueError:
                continue
            for ep in experts:
                try:
                    yield validate_args(_with_layout(base, mode, tp, pp, ep, split), world_size=world,
                                        check_device=False)
                except (ArgumentError, ConfigError):
                    continue


def smallest_fitting(base: List[str], mode: str, gpu, worlds) -> Tuple[int, list]:
    """(world size, [plan] of the layouts that fit there, fastest first); (0, []) when none fits."""
    from megatron_glm5.planning.plan import make_plan, plan_rank

    limit = gpu.memory_mib * 2 ** 20
    for world in worlds:
        fits = []
        for args in candidates(base, mode, world):
            per_stage = world // args.pipeline_model_parallel_size
            # a quick screen: the first rank of each stage (its padding aside, any rank of the stage)
            if any(plan_rank(args, p * per_stage).memory.total_bytes > limit
                   for p in range(args.pipeline_model_parallel_size)):
                continue
            plan = make_plan(args, gpu)
            if plan.fits:
                fits.append(plan)
        if fits:
            fits.sort(key=lambda p: -p.time.tokens_per_s_per_gpu)
            return world, fits
    return 0, []
