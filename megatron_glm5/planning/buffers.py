"""Weights, gradients and optimizer state of one rank, as megatron-core 0.19.2 lays them out.

The rules (read from megatron-core, checked against real allocations by tests/test_planner.py):

* DistributedDataParallel (configured in ``training/loop.py`` ``wrap_ddp``) keeps one contiguous gradient buffer per
  (parameter dtype, expert-parallel or not) and model chunk, fp32 whatever the parameter dtype unless
  ``--grad-reduce-dtype bf16`` (``grad_reduce_in_fp32=False``: the parameters' dtype; training/memory_options.py).  Parameters are laid out in reverse registration order, split into buckets of
  ``max(40M, 1M x DP)`` elements when --overlap-grad-reduce is on (only on pipeline rank 0's first chunk: megatron
  turns bucketing off elsewhere), one bucket otherwise; a shared embedding gets a bucket of its own.
* With --use-distributed-optimizer (``DistributedOptimizer._compute_per_buffer_param_layout``) each parameter starts
  at a multiple of 64 elements and each bucket ends at a multiple of lcm(DP, 128); the parameters move into a
  parameter buffer of the same layout (in their own dtype), and each of the DP ranks owns the 1/DP slice of every
  bucket: its optimizer state covers the parameter elements inside that slice.  Dense buffers shard over the
  data-parallel x context-parallel group, expert buffers over the expert data-parallel group.
* Optimizer state per owned element: Adam's two fp32 moments (8 bytes), plus an fp32 main copy (4 bytes) when the
  parameters are bf16 (megatron-core's mixed-precision optimizers; with fp32 parameters the optimizer steps them
  in place).  Without the distributed optimizer every rank owns all its elements.
* ``--optimizer-cpu-offload`` (megatron-core's HybridDeviceOptimizer, one per chained optimizer): the first fraction
  F of each optimizer's owned elements keep their fp32 master copy and moments in host memory (with a pinned fp32
  copy of their gradient: 16 bytes per element); the rest keep them
  on the GPU (12 bytes, the master copy then HybridDeviceOptimizer's).  megatron-core offloads whole parameter
  shards until F is reached, so the split here (F x the elements) is exact at F = 0 or 1 and within one
  parameter shard otherwise.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_glm5.planning.inventory import KINDS, Tensor
from megatron_glm5.training import muon_flags

GRAD_BYTES = 4  # the default, grad_reduce_in_fp32=True (training/memory_options.py grad_bytes: 2 with bf16 reduction)
MOMENT_BYTES = 8  # Adam exp_avg + exp_avg_sq, fp32
MAIN_PARAM_BYTES = 4  # fp32 main copy of a bf16 parameter
HOST_GRAD_BYTES = 4  # --optimizer-cpu-offload: the pinned fp32 host copy of each offloaded element's gradient


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class BufferLayout:
    """One DDP buffer: per parameter its (start, end), per bucket its (start, padded end)."""
    params: Tuple[Tuple[Tensor, int, int], ...]
    buckets: Tuple[Tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0


def buffer_layout(tensors: Sequence[Tensor], bucket_size: Optional[int], shards: int,
                  distributed_optimizer: bool) -> BufferLayout:
    """megatron-core's layout of one buffer's parameters (``tensors`` in registration order)."""
    params, buckets = [], []
    start = bucket_start = 0
    in_bucket = 0
    divisor = math.lcm(shards, 128)

    def close(end: int) -> int:
        padded = _ceil(end, divisor) if distributed_optimizer else end
        buckets.append((bucket_start, padded))
        return padded

    for t in reversed(list(tensors)):
        if distributed_optimizer:
            start = _ceil(start, 64)
            if t.shared_embedding and in_bucket:
                bucket_start = start = close(start)
                in_bucket = 0
        end = start + t.numel
        params.append((t, start, end))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (
                distributed_optimizer and t.shared_embedding):
            bucket_start = start = close(end)
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        close(start)
    return BufferLayout(tuple(params), tuple(buckets))


def owned_elements(layout: BufferLayout, shards: int, index: int) -> Dict[str, int]:
    """Parameter elements of each kind inside shard ``index`` of every bucket (the distributed optimizer's)."""
    out = {k: 0 for k in KINDS}
    starts = [s for _, s, _ in layout.params]
    for b_start, b_end in layout.buckets:
        size = (b_end - b_start) // shards
        lo, hi = b_start + index * size, b_start + (index + 1) * size
        j = max(0, bisect.bisect_right(starts, lo) - 1)
        while j < len(layout.params) and layout.params[j][1] < hi:
            t, s, e = layout.params[j]
            n = min(e, hi) - max(s, lo)
            if n > 0:
                out[t.kind] += n
            j += 1
    return out


@dataclass(frozen=True)
class Buffer:
    """One DDP buffer of a rank: which chunk, dense or expert, its layout and the group its state shards over."""
    chunk: int
    expert: bool
    layout: BufferLayout
    shards: int


def rank_buffers(chunks, *, pp_rank: int, dense_shards: int, expert_shards: int, distributed_optimizer: bool,
                 overlap_grad_reduce: bool) -> List[Buffer]:
    """The DDP buffers of a rank at pipeline rank ``pp_rank`` holding ``chunks`` (its model chunks)."""
    out = []
    for c, chunk in enumerate(chunks):
        for expert in (False, True):
            tensors = [t for t in chunk.tensors if t.expert == expert]
            if not tensors:
                continue
            shards = expert_shards if expert else dense_shards
            bucket_size = None
            if overlap_grad_reduce and c == 0 and pp_rank == 0:
                bucket_size = max(40_000_000, 1_000_000 * shards)
            out.append(Buffer(c, expert, buffer_layout(tensors, bucket_size, shards, distributed_optimizer), shards))
    return out


@dataclass
class StaticMemory:
    """Bytes of one rank that do not depend on the batch: weights, gradient buffers, optimizer state."""
    params: Dict[str, int]  # parameter elements by kind on this rank
    weight_bytes: int  # the parameters (under the distributed optimizer: its padded parameter buffers)
    param_bytes: int  # sum of numel x dtype size (no padding)
    grad_bytes: int
    optimizer_main_bytes: int
    optimizer_moment_bytes: int
    optimizer_elements: Dict[str, int]  # elements this rank's optimizer steps, by kind
    optimizer_expert_elements: int  # of which in expert-parallel buffers (megatron-core's second, chained optimizer)
    buckets: List[Tuple[str, int]]  # (buffer, bucket elements) for the data-parallel collectives
    grad_dtype_bytes: int = GRAD_BYTES
    offload_fraction: float = 0.0  # --optimizer-cpu-offload: the share of each optimizer's elements on the host
    host_optimizer_bytes: int = 0  # their fp32 master copies, moments and gradient copies, in pinned host memory

    def gpu_optimizer_elements(self) -> Tuple[int, int]:
        """(dense, expert) elements whose optimizer state and step stay on the GPU."""
        expert = self.optimizer_expert_elements
        dense = sum(self.optimizer_elements.values()) - expert
        keep = 1.0 - self.offload_fraction
        return int(round(dense * keep)), int(round(expert * keep))

    @property
    def offloaded_elements(self) -> int:
        return sum(self.optimizer_elements.values()) - sum(self.gpu_optimizer_elements())

    @property
    def optimizer_bytes(self) -> int:
        return self.optimizer_main_bytes + self.optimizer_moment_bytes


def static_memory(buffers: Sequence[Buffer], *, dense_index: int, expert_index: int, bf16: bool,
                  distributed_optimizer: bool, grad_bytes: int = GRAD_BYTES,
                  offload_fraction: float = 0.0, optimizer: str = "adam") -> StaticMemory:
    """Weights, gradients and optimizer state of the rank holding ``buffers`` (rank_buffers) that is shard
    ``dense_index`` of its dense data-parallel group and ``expert_index`` of its expert data-parallel group.
    ``grad_bytes``: per element of the gradient buffers; ``offload_fraction``: of the optimizer state on the host
    (training/memory_options.py reads both from the flags); ``optimizer`` "muon": its matrices keep one fp32
    momentum buffer instead of Adam's two moments (training/muon_flags.py takes_muon; under the distributed form the
    layer-wise optimizer owns whole parameters: each buffer's owned elements are taken at its Muon share)."""
    dtype_bytes = 2 if bf16 else 4
    params = {k: 0 for k in KINDS}
    owned_total = {k: 0 for k in KINDS}
    owned_expert = 0
    owned_muon = 0.0  # --optimizer muon: owned elements whose state is one momentum buffer
    weight = param = grad = 0
    buckets: List[Tuple[str, int]] = []
    for b in buffers:
        n = 0
        for t, _, _ in b.layout.params:
            params[t.kind] += t.numel
            n += t.numel
        param += n * dtype_bytes
        weight += (b.layout.numel if distributed_optimizer else n) * dtype_bytes
        grad += b.layout.numel * grad_bytes
        if distributed_optimizer:
            owned = owned_elements(b.layout, b.shards, expert_index if b.expert else dense_index)
        else:
            owned = {k: 0 for k in KINDS}
            for t, _, _ in b.layout.params:
                owned[t.kind] += t.numel
        for k, v in owned.items():
            owned_total[k] += v
        if b.expert:
            owned_expert += sum(owned.values())
        if optimizer == "muon" and n:
            owned_muon += sum(owned.values()) * sum(t.numel for t, _, _ in b.layout.params
                                                    if muon_flags.takes_muon(t.name, t.kind)) / n
        buckets += [("experts" if b.expert else "dense", e - s) for s, e in b.layout.buckets]
    st = StaticMemory(params=params, weight_bytes=weight, param_bytes=param, grad_bytes=grad,
                      optimizer_main_bytes=0, optimizer_moment_bytes=0, optimizer_elements=owned_total,
                      optimizer_expert_elements=owned_expert, buckets=buckets, grad_dtype_bytes=grad_bytes,
                      offload_fraction=offload_fraction)
    main = MAIN_PARAM_BYTES if bf16 else 0
    on_gpu = sum(st.gpu_optimizer_elements())
    st.optimizer_main_bytes = on_gpu * main
    st.optimizer_moment_bytes = (on_gpu * MOMENT_BYTES
                                 - int(round(owned_muon)) * (MOMENT_BYTES - muon_flags.MUON_STATE_BYTES))
    st.host_optimizer_bytes = st.offloaded_elements * (main + MOMENT_BYTES + HOST_GRAD_BYTES)
    return st
