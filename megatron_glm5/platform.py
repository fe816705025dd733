"""Platform layer: CUDA detection, megatron-core's CPU shims applied, one-call parallel init.

megatron-core 0.19.2 assumes a CUDA build of torch (and Python >= 3.12).  This project also
runs on CPU-only torch (gloo, unit tests, notebooks, conversion tools); the workarounds are
patches of megatron-core like any other and live in ``megatron_glm5/mcore_patches/`` (one
record each in its registry).  This module applies two of their phases:

* :func:`apply_pre_import_shims` must run before anything imports ``megatron.core``
  (``megatron_glm5/__init__.py`` calls it).  These are needed whenever their condition holds
  (no triton, Python < 3.12), with or without CUDA.
* :func:`apply_cpu_shims` runs after ``megatron.core`` can be imported and only when CUDA is
  absent; with CUDA it does nothing.  :func:`initialize_model_parallel` calls it.

Both are idempotent and return the registry's ``APPLIED``.

This module must not import ``megatron.core`` at module level.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import math
import os
import sys
from typing import List, Optional

import torch

from megatron_glm5.mcore_patches import registry
from megatron_glm5.mcore_patches.record import Phase

__all__ = [
    "HAS_CUDA",
    "apply_pre_import_shims",
    "apply_cpu_shims",
    "ParallelSizes",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "end_of_job",
]

HAS_CUDA: bool = torch.cuda.is_available()


def apply_pre_import_shims() -> List[str]:
    """Apply the patches that must precede ``import megatron.core``.  Idempotent.

    Returns the registry's ``APPLIED``.
    """
    return registry.apply_phase(Phase.PRE_IMPORT)


def apply_cpu_shims() -> List[str]:
    """Apply the patches megatron-core needs on a CPU-only torch.  Idempotent.

    No-op when CUDA is available.  Applies the pre-import patches first (harmless if they
    already ran), so it may be called before or after ``import megatron.core``.
    Returns the registry's ``APPLIED``.
    """
    apply_pre_import_shims()
    if not HAS_CUDA:
        registry.apply_phase(Phase.CPU)
    return registry.APPLIED


# ---------------------------------------------------------------------------------------
# Process group + megatron parallel state
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel layout set up by :func:`initialize_model_parallel`."""

    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    vpp: Optional[int]
    dp: int
    world_size: int


_OWNS_PROCESS_GROUP = False
_STORE = None  # keeps the single-process TCPStore alive
_ENDED_WELL = False  # end_of_job() since the last initialize_model_parallel()


def _check_positive(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag} must be a positive integer, got {value!r}")


def _validate_sizes(world_size, tp, pp, ep, etp, cp, vpp) -> ParallelSizes:
    for flag, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        _check_positive(flag, value)
    if etp is not None:
        _check_positive("etp", etp)
    if vpp is not None:
        _check_positive("vpp", vpp)
    etp_eff = tp if etp is None else etp
    for flag, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp_eff)):
        if world_size % value:
            raise ValueError(f"--{flag} {value} does not divide world size {world_size}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} does not divide "
            f"world size {world_size}"
        )
    if world_size % (etp_eff * ep * pp):
        raise ValueError(
            f"--etp {etp_eff} x --ep {ep} x --pp {pp} = {etp_eff * ep * pp} does not divide "
            f"world size {world_size}"
        )
    if vpp is not None and pp == 1:
        raise ValueError(f"--vpp {vpp} needs --pp > 1 (interleaved pipeline schedule)")
    return ParallelSizes(tp, pp, ep, etp_eff, cp, vpp, world_size // (tp * pp * cp), world_size)


def _launcher_env() -> bool:
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR"))


def _expected_world_size() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    if _launcher_env():
        return int(os.environ["WORLD_SIZE"])
    return 1


def _init_process_group(backend: Optional[str], timeout_minutes: Optional[float] = None) -> None:
    global _OWNS_PROCESS_GROUP, _STORE
    dist = torch.distributed
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if HAS_CUDA else "gloo"
    if HAS_CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    if _launcher_env():
        dist.init_process_group(backend=backend, init_method="env://", **timeout)
    else:
        # Port 0: the store binds a free port itself (no find-then-bind race).
        _STORE = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        dist.init_process_group(backend=backend, store=_STORE, world_size=1, rank=0, **timeout)
    _OWNS_PROCESS_GROUP = True


def _current_sizes(ps) -> ParallelSizes:
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    world = torch.distributed.get_world_size()
    return ParallelSizes(
        tp=tp,
        pp=pp,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=cp,
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=world // (tp * pp * cp),
        world_size=world,
    )


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    cp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_minutes: Optional[float] = None,
) -> ParallelSizes:
    """Set up torch.distributed + megatron parallel state + RNG in one call.

    * Process group, if none exists: ``env://`` when WORLD_SIZE/RANK/MASTER_ADDR are set
      (torchrun), else a single process (world size 1, rank 0) on a free localhost TCP port.
      Backend: ``backend`` or gloo without CUDA / nccl with CUDA (the CUDA device is set from
      LOCAL_RANK).
    * :func:`apply_cpu_shims` (no-op with CUDA).
    * ``parallel_state.initialize_model_parallel`` with the sizes; skipped when already
      initialized with the same sizes, destroyed and re-initialized when they differ.
    * RNG: ``torch.manual_seed(seed)`` + ``model_parallel_cuda_manual_seed(seed)``, on every
      call.

    ``etp=None`` means etp = tp (megatron's default).  Raises ValueError naming the flag
    (e.g. "--tp 3 does not divide world size 4") before anything is initialized.
    """
    global _ENDED_WELL
    _ENDED_WELL = False  # a job starts (end_of_job)
    apply_pre_import_shims()
    sizes = _validate_sizes(_expected_world_size(), tp, pp, ep, etp, cp, vpp)
    _init_process_group(backend, timeout_minutes)
    if torch.distributed.get_world_size() != sizes.world_size:  # WORLD_SIZE env disagreed
        sizes = _validate_sizes(torch.distributed.get_world_size(), tp, pp, ep, etp, cp, vpp)
    apply_cpu_shims()

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        if _current_sizes(parallel_state) == sizes:
            torch.manual_seed(seed)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            return sizes
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=sizes.etp,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": int(math.ceil(timeout_minutes))}),
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return sizes


def destroy_model_parallel() -> None:
    """Tear down megatron parallel state, and the process group if this module created it."""
    _teardown(every_group=False)


def _teardown(every_group: bool) -> None:
    """megatron-core's parallel state, then torch's process groups: this module's (every_group False) or all of
    them, also one created elsewhere (a parallel conversion's) and those megatron-core left behind at a
    re-initialisation."""
    global _OWNS_PROCESS_GROUP, _STORE
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if (every_group or _OWNS_PROCESS_GROUP) and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
    _STORE = None


def end_of_job() -> None:
    """Say that this process's job (training, generation, a conversion) ended well on every rank: at the
    process's exit, while the interpreter is still fully alive, megatron's parallel state and torch's process
    groups are torn down. Left to the interpreter's finalization, gloo's worker threads can abort a rank that has
    finished ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489) -- more often
    after a re-initialisation left megatron-core's earlier groups behind -- and torchrun then reports the finished
    job as failed. Nothing is torn down after a job that did not end well (with a peer lost, destroying the group
    can wait on its pending work), nor before the exit (the group stays usable, e.g. for a second job in the same
    process: initialize_model_parallel starts one and clears this mark)."""
    global _ENDED_WELL
    _ENDED_WELL = True
    atexit.unregister(_teardown_at_exit)  # once, however often a process ends a job
    atexit.register(_teardown_at_exit)


def _teardown_at_exit() -> None:
    dist = torch.distributed
    if not (_ENDED_WELL and dist.is_available() and dist.is_initialized()):
        return
    try:
        _teardown(every_group=True)
    except Exception as e:  # the process is ending: say it, do not turn a finished job into a failed one
        print(f"warning: tearing down the process group at exit: {type(e).__name__}: {e}", file=sys.stderr)
