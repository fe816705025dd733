"""Memory options for layouts that do not fit: bf16 gradient reduction and the optimizer's CPU offload.

Both are megatron-core's own mechanisms; this module holds their flags, the combinations it refuses, and the
megatron-core config values they set (one place: training/loop.py ``wrap_ddp``, training/optim.py
``build_optimizer`` and the planner, planning/buffers.py and planning/memory.py, read them from here).

``--grad-reduce-dtype {fp32,bf16}`` (default fp32): the dtype of DistributedDataParallel's gradient buffers, in
which micro-batch gradients accumulate and the data-parallel reduce-scatter / all-reduce runs
(``DistributedDataParallelConfig.grad_reduce_in_fp32``).  Megatron-LM spells the fp32 choice
``--accumulate-allreduce-grads-in-fp32`` (off by default there); this project's default is fp32, so the flag names
the dtype and both values.  bf16 halves the gradient buffers and the reduce-scatter bytes; megatron-core's
optimizer then takes an fp32 copy of the rank's gradient shard at each step (``.float()`` of a bf16 buffer, a view
of an fp32 one), which the planner counts.

``--optimizer-cpu-offload`` [``--optimizer-offload-fraction F``, ``--overlap-cpu-optimizer-d2h-h2d``]: megatron-core's
HybridDeviceOptimizer (``OptimizerConfig.optimizer_cpu_offload``) keeps the fp32 master weights and Adam moments of
the first fraction F (default 1.0) of each optimizer's parameter shards in pinned host memory and steps them with
torch's CPU AdamW; the gradients go to the host and the updated weights come back over PCIe every step.  It goes
through megatron-core's precision-aware code path (``use_precision_aware_optimizer``: Megatron-LM refuses the
offload without that flag), which needs the distributed optimizer; the offloaded parameters then have no fp32 main
copy on the GPU.  It needs bf16 parameters, hence a GPU (on CPU the project's CUDA shims let it run, which the
tests use: every parameter is then a host parameter).

Not built (docs/scaling.md says why): activation offloading (megatron-core's fine-grained offloading enters
Transformer Engine's CPU-offload context, its layer-level ``cpu_offloading`` refuses pipeline parallelism and
recompute) and Megatron-FSDP (CUDA-only at construction).
"""
from __future__ import annotations

import argparse
from typing import Dict

from megatron_glm5.errors import FlagError

GRAD_REDUCE_DTYPES = ("fp32", "bf16")
DEFAULT_OFFLOAD_FRACTION = 1.0


class MemoryOptionError(FlagError):
    """A memory option that megatron-core cannot run in this combination; ``flag`` names the option."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory options (docs/scaling.md: what each one buys)")
    g.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default="fp32",
                   help="dtype of the gradient buffers and the data-parallel gradient reduction (bf16 halves the "
                        "gradient memory; needs bf16 parameters)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep the optimizer's fp32 master weights and Adam moments in host memory and step them on "
                        "the CPU (megatron-core HybridDeviceOptimizer; needs a GPU and --use-distributed-optimizer)")
    g.add_argument("--optimizer-offload-fraction", type=_fraction, default=None, metavar="F",
                   help=f"with --optimizer-cpu-offload: the fraction of the optimizer state moved to the host "
                        f"(default {DEFAULT_OFFLOAD_FRACTION:g})")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="with --optimizer-cpu-offload: one CPU optimizer per parameter so that its transfers "
                        "overlap the other parameters' CPU steps")


def check(args: argparse.Namespace, bf16: bool) -> Dict:
    """Refuse, in one line naming the flag, what megatron-core cannot run (``args`` is not changed; nothing is
    derived).  ``bf16``: the resolved parameter dtype (arguments' precision section)."""
    if args.grad_reduce_dtype == "bf16" and not bf16:
        raise MemoryOptionError("--grad-reduce-dtype bf16 needs bf16 parameters (--bf16); fp32 parameters keep fp32 "
                                "gradients whatever this flag says", flag="--grad-reduce-dtype")
    offload = args.optimizer_cpu_offload
    if not offload:
        for flag, given in (("--optimizer-offload-fraction", args.optimizer_offload_fraction is not None),
                            ("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d)):
            if given:
                raise MemoryOptionError(f"{flag} needs --optimizer-cpu-offload", flag=flag)
        return {}
    if getattr(args, "optimizer", "adam") != "adam":
        raise MemoryOptionError(f"--optimizer-cpu-offload supports --optimizer adam only, not {args.optimizer}",
                                flag="--optimizer-cpu-offload")
    if not args.use_distributed_optimizer:
        raise MemoryOptionError("--optimizer-cpu-offload needs --use-distributed-optimizer (megatron-core offloads "
                                "through its precision-aware distributed optimizer)", flag="--optimizer-cpu-offload")
    if not bf16:  # on CPU the flags refuse --bf16 already: CPU training has its optimizer in host memory anyway
        raise MemoryOptionError("--optimizer-cpu-offload needs bf16 parameters (--bf16, on a GPU)",
                                flag="--optimizer-cpu-offload")
    return {}


def offload_fraction(args) -> float:
    """The fraction of each optimizer's state held on the host (0 without --optimizer-cpu-offload)."""
    if not getattr(args, "optimizer_cpu_offload", False):
        return 0.0
    f = getattr(args, "optimizer_offload_fraction", None)
    return DEFAULT_OFFLOAD_FRACTION if f is None else float(f)


def grad_reduce_in_fp32(args) -> bool:
    return getattr(args, "grad_reduce_dtype", "fp32") == "fp32"


def grad_bytes(args) -> int:
    """Bytes per element of the DDP gradient buffers: fp32, unless bf16 parameters reduce in bf16."""
    return 4 if grad_reduce_in_fp32(args) or not args.bf16 else 2


def ddp_config_values(args) -> Dict:
    """DistributedDataParallelConfig fields these options set."""
    return {"grad_reduce_in_fp32": grad_reduce_in_fp32(args)}


def optimizer_config_values(args) -> Dict:
    """OptimizerConfig fields these options set (none without --optimizer-cpu-offload)."""
    if not getattr(args, "optimizer_cpu_offload", False):
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": offload_fraction(args),
            "overlap_cpu_optimizer_d2h_h2d": bool(args.overlap_cpu_optimizer_d2h_h2d),
            "use_precision_aware_optimizer": True}
