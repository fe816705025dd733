"""Host copies of the attention windows, so that planning query chunks needs no device -> host copy.

The per-query key windows (key_start / query_end, model/attention_inputs.py) follow from host-known values: the
batch, the sequence length and, for packed documents, cu_seqlens. ``to_device`` moves a window tensor built on
the host to the GPU through pinned memory without blocking the host and remembers the host tensor under the device
tensor; ``host_copy`` gives that host tensor back (``reference.windows`` plans every kernel's chunks from it), or
the tensor it was given when none is known (a device tensor then costs the one copy it always cost).
``remember_row_ends`` / ``row_ends`` do the same for the per-row largest key of a top-k list that the indexer
built from those windows, and ``remember_selected_lse`` / ``selected_lse`` for a device fact the indexer has at
hand: the log-sum-exp of each row's selected scores (the indexer KL then needs no pass of its own to find it).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

_KEEP = 16  # remembered tensors per kind (a forward uses two windows; micro-batches and recomputation a few more)


class _HostFacts:
    """Host values remembered under GPU tensors: valid while that very tensor is alive and unmodified (a weak
    reference and its ``_version``), at most _KEEP of them, the oldest dropped first."""

    def __init__(self):
        self._known: dict = {}  # id(tensor) -> (weakref to it, its _version when stored, host value)

    def put(self, t: torch.Tensor, value) -> None:
        for key in [k for k, (ref, _, _) in self._known.items() if ref() is None]:
            del self._known[key]
        while len(self._known) >= _KEEP:
            del self._known[next(iter(self._known))]
        self._known[id(t)] = (weakref.ref(t), t._version, value)

    def get(self, t: torch.Tensor):
        entry = self._known.get(id(t))
        if entry is None:
            return None
        ref, version, value = entry
        return value if ref() is t and t._version == version else None


_copies = _HostFacts()  # a device tensor -> the host tensor holding its values
_row_ends = _HostFacts()  # a top-k list -> each row's largest possible key (host int64 [T], -1: no keys)
_selected_lse = _HostFacts()  # a top-k list -> (the LSE of each row's selected scores, what they were scored from)


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
    _copies.put(device_tensor, host)


def host_copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The remembered host tensor of ``t``, else ``t`` itself (also for CPU tensors and None)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    host = _copies.get(t)
    return t if host is None else host


def remember_row_ends(indices: torch.Tensor, row_hi: torch.Tensor) -> None:
    """Record that row t of ``indices`` (a top-k list) holds no key above ``row_hi[t]`` (a host int64 [T]; -1 for
    a row without keys) -- the indexer knows this from the windows it planned with, so that the sparse backward
    can size its dense products without reading the indices back (ops/triton_sparse_mla.py)."""
    _row_ends.put(indices, row_hi)


def row_ends(indices: torch.Tensor) -> Optional[torch.Tensor]:
    """The host row bounds remembered for ``indices`` (alive and unmodified since), else None."""
    return _row_ends.get(indices)


def _scored_from(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> tuple:
    """What identifies the inputs a top-k list was scored from: each tensor's storage, shape and version, and the
    scale."""
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype, t._version) for t in (q_idx, k_idx, weights)) + (
        float(softmax_scale),)


def remember_selected_lse(indices: torch.Tensor, lse: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                          weights: torch.Tensor, softmax_scale: float) -> None:
    """Record that ``lse`` (fp32 [T], on the device; -inf for a row without keys) is the log-sum-exp over each row's
    selected keys of the index scores sum_h w[t, h] relu(softmax_scale q_idx[t, h] . k_idx[j]) from which the
    indexer built ``indices`` -- the normaliser of the indexer KL's softmax (ops/triton_kl.py)."""
    _selected_lse.put(indices, (lse, _scored_from(q_idx, k_idx, weights, softmax_scale)))


def selected_lse(indices: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
                 softmax_scale: float) -> Optional[torch.Tensor]:
    """The remembered LSE of ``indices``' selected scores when the list is alive and unmodified and was scored from
    these very q_idx, k_idx, weights (same storage, shape, dtype, version) and scale; else None."""
    fact = _selected_lse.get(indices)
    if fact is None or fact[1] != _scored_from(q_idx, k_idx, weights, softmax_scale):
        return None
    return fact[0]
