"""Host copies of the attention windows, so that planning query chunks needs no device -> host copy.

The per-query key windows (key_start / query_end, model/attention_inputs.py) follow from host-known values: the
batch, the sequence length and, for packed documents, cu_seqlens. ``to_device`` moves a window tensor built on
the host to the GPU through pinned memory without blocking the host and remembers the host tensor under the device
tensor; ``host_copy`` gives that host tensor back (``reference.windows`` plans every kernel's chunks from it), or
the tensor it was given when none is known (a device tensor then costs the one copy it always cost).
``remember_row_ends`` / ``row_ends`` do the same for the per-row largest key of a top-k list that the indexer
built from those windows.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

_KEEP = 16  # remembered pairs (a forward uses two; pipeline micro-batches and recomputation a few more)
_known: dict = {}  # id(device tensor) -> (weakref to it, its _version when stored, host tensor)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; a CUDA copy is asynchronous (pinned) and remembered for host_copy."""
    device = torch.device(device) if device is not None else host.device
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        out = host.pin_memory().to(device, non_blocking=True)
    else:
        out = host.to(device)
    remember(out, host)
    return out


def remember(device_tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Record that ``host`` holds the values of ``device_tensor`` (as long as it is alive and unmodified)."""
    for key in [k for k, (ref, _, _) in _known.items() if ref() is None]:
        del _known[key]
    while len(_known) >= _KEEP:
        del _known[next(iter(_known))]
    _known[id(device_tensor)] = (weakref.ref(device_tensor), device_tensor._version, host)


def host_copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The remembered host tensor of ``t``, else ``t`` itself (also for CPU tensors and None)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    entry = _known.get(id(t))
    if entry is None:
        return t
    ref, version, host = entry
    if ref() is not t or t._version != version:
        return t
    return host


# per-row key bounds of top-k lists: id(indices) -> (weakref to it, its _version, host int64 [T] row_hi)
_row_ends: dict = {}


def remember_row_ends(indices: torch.Tensor, row_hi: torch.Tensor) -> None:
    """Record that row t of ``indices`` (a top-k list on the GPU) holds no key above ``row_hi[t]`` (a host int64
    [T]; -1 for a row without keys) -- the indexer knows this from the windows it planned with, so that the sparse
    backward can size its dense products without reading the indices back (ops/triton_sparse_mla.py)."""
    for key in [k for k, (ref, _, _) in _row_ends.items() if ref() is None]:
        del _row_ends[key]
    while len(_row_ends) >= _KEEP:
        del _row_ends[next(iter(_row_ends))]
    _row_ends[id(indices)] = (weakref.ref(indices), indices._version, row_hi)


def row_ends(indices: torch.Tensor) -> Optional[torch.Tensor]:
    """The host row bounds remembered for ``indices`` (alive and unmodified since), else None."""
    entry = _row_ends.get(id(indices))
    if entry is None:
        return None
    ref, version, row_hi = entry
    if ref() is not indices or indices._version != version:
        return None
    return row_hi
