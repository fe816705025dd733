"""What megatron-core really allocated on each rank: the planner's ground truth.

Run under torchrun with one or more sets of the training scripts' flags (each after a ``--``); for each set every
rank builds its model chunks, wraps them in
DistributedDataParallel and builds the optimizer exactly as training does (``training/loop.py`` ``wrap_ddp``,
``training/optim.py`` ``build_optimizer``, with the Adam state created by ``ensure_optimizer_state``), then writes
``<out>/<set>.rank<R>.json`` (sets numbered from 0): its coordinates in the parallel groups, the bytes of its parameters, of its DDP gradient (and distributed-optimizer parameter)
buffers, of its optimizer's fp32 main copies and Adam moments, and the list of its parameters (name, numel, dtype,
expert-parallel or not), and with ``--time-optimizer-steps N`` the median time of megatron-core's optimizer step
(benchmarks/calibrate_layers.py's table carries it for the planner)::

    torchrun --nproc-per-node 4 -m megatron_glm5.planning.measure --out DIR -- --preset tiny --tp 2 ... -- --ep 2 ...

The model is built but never run: nothing here depends on data or tokenizer.  tests/test_planner.py compares
these figures with the planner's (megatron_glm5/planning/memory.py) exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List


def _storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def time_optimizer_step(model, optimizer, steps: int) -> float:
    """Median ms of ``optimizer.step()`` (megatron-core's: gradient norm, clipping, Adam, copy back to the bf16
    weights) over ``steps`` steps after one warm-up, on random gradients; CUDA events (host clock on CPU)."""
    import statistics
    import time

    import torch

    times = []
    for i in range(steps + 1):
        for d in model:
            for buf in list(d.buffers) + list(d.expert_parallel_buffers):
                buf.grad_data.normal_()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            optimizer.step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            optimizer.step()
            ms = (time.perf_counter() - t0) * 1e3
        if i:
            times.append(ms)
    return statistics.median(times)


def measure(args, time_steps: int = 0) -> Dict:
    """The allocation figures of this rank (model built, DDP-wrapped, optimizer with its state); with
    ``time_steps`` also the optimizer step's median time (``optimizer_step_ms``)."""
    import torch.distributed as dist

    from megatron_glm5 import platform
    from megatron_glm5.mcore_patches import registry as mcore_patches
    from megatron_glm5.mcore_patches.record import Phase
    from megatron_glm5.training.loop import build_model_chunks, wrap_ddp
    from megatron_glm5.training.optim import build_optimizer, ensure_optimizer_state

    mcore_patches.apply_phase(Phase.TRAINING)
    platform.initialize_model_parallel(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
        cp=args.context_parallel_size, vpp=args.virtual_pipeline_model_parallel_size, seed=args.seed)
    chunks = build_model_chunks(args)
    model = wrap_ddp(args, chunks)
    optimizer = build_optimizer(args, model)
    ensure_optimizer_state(optimizer)

    params: List[Dict] = []
    model_storages = set()
    param_bytes = 0
    for c, m in enumerate(chunks):
        for name, p in m.named_parameters():
            params.append(dict(chunk=c, name=name, numel=p.numel(), dtype=str(p.dtype).replace("torch.", ""),
                               expert=not getattr(p, "allreduce", True),
                               shared_embedding=bool(getattr(p, "shared_embedding", False))))
            param_bytes += p.numel() * p.element_size()
            model_storages.add(_storage_key(p))
    grad_bytes = buffer_param_bytes = 0
    for d in model:
        for buf in list(d.buffers) + list(d.expert_parallel_buffers):
            grad_bytes += buf.grad_data.numel() * buf.grad_data.element_size()
            if getattr(buf, "param_data", None) is not None:
                buffer_param_bytes += buf.param_data.numel() * buf.param_data.element_size()
                model_storages.add(_storage_key(buf.param_data))
    main_bytes = moment_bytes = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if _storage_key(p) not in model_storages:  # an fp32 main copy, not a view of the model's weights
                    main_bytes += p.numel() * p.element_size()
                for key in ("exp_avg", "exp_avg_sq"):
                    t = inner.state[p].get(key)
                    if t is not None:
                        moment_bytes += t.numel() * t.element_size()
    from megatron.core import parallel_state as ps

    coords = dict(pp_rank=ps.get_pipeline_model_parallel_rank(),
                  dense_shard=ps.get_data_parallel_rank(with_context_parallel=True),
                  expert_shard=ps.get_expert_data_parallel_rank())
    step_ms = time_optimizer_step(model, optimizer, time_steps) if time_steps else None
    del optimizer, model, chunks
    return dict(rank=dist.get_rank(), **coords, optimizer_step_ms=step_ms, param_bytes=param_bytes, grad_buffer_bytes=grad_bytes,
                param_buffer_bytes=buffer_param_bytes, optimizer_main_param_bytes=main_bytes,
                optimizer_moment_bytes=moment_bytes, params=params)


def main(argv=None) -> int:
    import torch.distributed as dist

    from megatron_glm5.arguments import parse_args, validate_args

    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m megatron_glm5.planning.measure")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    p.add_argument("--mode", choices=("finetune", "pretrain"), default="finetune")
    p.add_argument("--time-optimizer-steps", type=int, default=0, metavar="N",
                   help="also time N optimizer steps on random gradients (median ms in optimizer_step_ms)")
    opts = p.parse_args(argv[:split])
    sets, current = [], None
    for a in argv[split:]:
        if a == "--":
            current = []
            sets.append(current)
        else:
            current.append(a)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.makedirs(opts.out, exist_ok=True)
    for n, flags in enumerate(sets):
        args = validate_args(parse_args(flags, mode=opts.mode), world_size=world, check_device=False)
        result = measure(args, opts.time_optimizer_steps)
        with open(os.path.join(opts.out, f"{n}.rank{result['rank']}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
