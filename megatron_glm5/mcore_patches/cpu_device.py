"""CPU-only patches: ``torch.cuda.current_device`` and the CUDA stream/event API as CPU stand-ins, for
megatron-core code that calls them unconditionally."""
from __future__ import annotations

import contextlib

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cuda_current_device() -> bool:
    """Make ``torch.cuda.current_device()`` return ``torch.device('cpu')``.

    megatron-core uses it as the default device for tensors it creates, e.g.
    ``RotaryEmbedding``/``YarnRotaryEmbedding.__init__`` (inv_freq; megatron/core/models/common/
    embeddings/rotary_pos_embedding.py), ``TopKRouter`` buffers
    and ``gating``, ``_AllToAll.forward`` in tensor_parallel/mappings.py (EP > 1 output
    buffer), ``MultiTokenPredictionBlock``, DDP buffers, tensor_parallel.layers weight
    allocation (``use_cpu_initialization=False``), ``p2p_communication`` shape buffers.  On a
    CPU build every call raises "Torch not compiled with CUDA enabled" before any tensor
    exists, so a TorchFunctionMode cannot catch it.  Call sites that do
    ``torch.device("cuda", torch.cuda.current_device())`` (nccl_allocator, fault_injector)
    remain unsupported on CPU.
    """
    torch.cuda.current_device = _cpu_device
    return True


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so events are always done."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        return 0.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: one synchronous CPU queue, every wait is a no-op."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        pass


_CPU_DEFAULT_STREAM = _CpuStream()


def _cpu_current_stream(device=None) -> _CpuStream:
    return _CPU_DEFAULT_STREAM


def _cpu_stream_context(stream=None):
    return contextlib.nullcontext(stream)


def _cpu_synchronize(device=None) -> None:
    pass


def _cuda_streams() -> bool:
    """Replace ``torch.cuda.{Stream, Event, current_stream, default_stream, stream,
    synchronize}`` with synchronous CPU stand-ins.

    ``MoEAlltoAllTokenDispatcher.__init__`` (megatron/core/transformer/moe/token_dispatcher.py)
    creates ``torch.cuda.Stream()`` ("torch.cuda.Stream requires CUDA support" on CPU); its
    ``_maybe_dtoh_and_synchronize`` uses ``current_stream()``, ``wait_stream``,
    ``torch.cuda.stream(...)``, ``record_event()`` and ``event.synchronize()`` around the
    device-to-host copies of the split sizes (``torch.cpu.Stream.record_event`` returns None,
    so torch.cpu's classes cannot be used as is).  ``p2p_communication._communicate`` (PP > 1
    with batch_isend_irecv) calls ``torch.cuda.synchronize()``; MoE shared-expert overlap and
    delayed-wgrad use ``torch.cuda.Event``.
    """
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = _cpu_current_stream
    torch.cuda.default_stream = _cpu_current_stream
    torch.cuda.stream = _cpu_stream_context
    torch.cuda.synchronize = _cpu_synchronize
    return True


PATCHES = (
    Patch(
        name='cuda_current_device',
        site="torch.cuda.current_device (megatron-core's default device)",
        why="RotaryEmbedding, TopKRouter, DDP buffers ... raise 'Torch not compiled with CUDA enabled'",
        test='tests/test_platform.py::test_shim_is_needed[cuda_current_device]',
        phase=Phase.CPU, apply=_cuda_current_device),
    Patch(
        name='cuda_streams',
        site='torch.cuda.Stream/Event/stream/synchronize (token_dispatcher.py, p2p)',
        why="MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream: 'requires CUDA support'",
        test='tests/test_platform.py::test_shim_is_needed[cuda_streams]',
        phase=Phase.CPU, apply=_cuda_streams),
)
