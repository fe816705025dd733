"""Host copies of the attention windows, so that planning query chunks needs no device -> host copy.

The per-query key windows (key_start / query_end, model/attention_inputs.py) follow from host-known values: the
batch, the sequence length and, for packed documents, cu_seqlens. ``to_device`` moves a window tensor built on
the host to the GPU through pinned memory without blocking the host and remembers the host tensor under the device
tensor; ``host_copy`` gives that host tensor back (``reference.windows`` plans every kernel's chunks from it), or
the tensor it was given when none is known (a device tensor then costs the one copy it always cost).
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
