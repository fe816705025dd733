"""The training scripts' start-up check: refuse in one line, before the model is built, when this rank cannot
hold its share of the model.

    from megatron_glm5.planning.check import check_fits
    check_fits(args)   # validated args (world size = the real one); raises MemoryCheckError, or returns

The estimate is the planner's (plan.plan_rank: weights, fp32 gradients, this rank's optimizer shard, activations,
working set, context and margin); the memory available is the GPU's total memory (CUDA) or the machine's
available memory (CPU, /proc/meminfo).  ``args.skip_memory_check`` (the --skip-memory-check flag) skips it.
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Tuple

from megatron_glm5.errors import UserError
from megatron_glm5.planning.memory import GIB


class MemoryCheckError(UserError, MemoryError):
    """This rank's estimated peak memory exceeds what its device has."""


def available_memory() -> Tuple[int, str]:
    """(bytes, what) of the device this process trains on."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"this {props.name}"
    try:
        with open("/proc/meminfo", "r", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine's available memory (CPU training)"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory (CPU training)"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def plan_command(args, argv: Optional[list] = None) -> str:
    """The plan_layout command for the same flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = ["--mode", "pretrain"] if getattr(args, "mode", "finetune") == "pretrain" else []
    flags = [a for a in argv if a != "--skip-memory-check"]
    return " ".join(["python tools/plan_layout.py", *map(shlex.quote, flags), *mode,
                     "--world-size", str(args.world_size), "--gpu", "<h100-80gb|h200-141gb|b200-180gb>"])


def check_fits(args, argv: Optional[list] = None) -> None:
    """Raise MemoryCheckError (one line: the estimate, the memory available, the plan_layout command) when this
    rank's estimated peak exceeds its device's memory."""
    if getattr(args, "skip_memory_check", False):
        return
    from megatron_glm5.planning.plan import plan_rank

    rank = _rank()
    r = plan_rank(args, rank)
    need = r.memory.total_bytes
    have, what = available_memory()
    if need <= have:
        return
    b = r.memory.breakdown()
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in b.items() if v)
    raise MemoryCheckError(
        f"rank {rank} (pipeline stage {r.pp_rank}) needs about {need / GIB:.1f} GiB ({parts} GiB; an estimate) but "
        f"{what} has {have / GIB:.1f} GiB: plan a layout that fits with `{plan_command(args, argv)}` "
        "(docs/scaling.md), or pass --skip-memory-check to start anyway")
