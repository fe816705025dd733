"""``--attn tilelang``: our TileLang kernels -- sparse forward (``tilelang_sparse_mla_ws``), the backward's scores
kernel (``tilelang_sparse_mla_bwd_ws``, with cuBLAS for dq / dkv), indexer scores (``tilelang_indexer``) and the KL
target's head sums (``tilelang_kl``) -- with the Triton backend as ``fallback``.

indexer_topk: our TileLang scores + the Triton backend's exact top-k.  sparse_mla: our warp-specialised TileLang
forward and backward (``forward_kernel`` / ``backward_kernel``; GLM5_TILELANG_FWD=plain, GLM5_TILELANG_BWD=triton /
tilelang select the other kernels) through the backends' autograd Function (``base.SparseMLAFunction``); the
default backward is the Triton one where the dense formulation does not apply (long sequences in atomic mode, top-k
lists without the indexer's host row bounds), said once.  indexer_kl_loss: the fallback's routing and fused indexer
side, with our one-pass head sums for the target (handed to the fallback as its ``kl_head_probs``) when the KL is
computed in the forward; with a backward that writes the head sums (dense or triton) and GLM5_TRITON_DEFER_KL auto
(the default, one process) or 1, the fallback's deferred KL instead (``deferred_indexer_kl``).  Every shape the
kernels do not take (non-bf16, d_v or d_rope not a power of two; for the KL target also a missing lse) is the
fallback's, with a warning logged once per reason.  Dense mode (indices None) is the torch reference, as for
--attn triton.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from ..errors import UserError
from . import tilelang_sparse_mla
from .base import LibraryBackend, sparse_mla_autograd, triton_backward_reason, warn_once
from .tilelang_sparse_mla import TILELANG_INSTALL
from .triton_backend import TritonBackend

__all__ = ["TilelangBackend", "backward_kernel", "forward_kernel"]


class TilelangSettingError(UserError, ValueError):
    """A bad value of one of the TileLang backend's environment settings."""


def _setting(var: str, choices, what: str) -> str:
    """The value of environment setting ``var`` (read at each call; the first of ``choices`` when unset)."""
    raw = os.environ.get(var, choices[0])
    v = raw.strip().lower() or choices[0]
    if v not in choices:
        raise TilelangSettingError(f"{var}={raw!r}: must be one of {', '.join(choices)} ({what})")
    return v


def forward_kernel() -> Callable:
    """The sparse forward ``--attn tilelang`` runs, by GLM5_TILELANG_FWD: ``ws`` (default) our warp-specialised
    kernel (tilelang_sparse_mla_ws; the plain kernel for shapes it does not take), ``plain`` the plain loop
    (tilelang_sparse_mla.FWD_CONFIG).  On the H200 at S 4096: 2.16 vs 4.83 ms (docs/performance.md, session 9)."""
    if _setting("GLM5_TILELANG_FWD", ("ws", "plain"), "our TileLang sparse forward: the warp-specialised kernel or "
                "the plain loop") == "ws":
        from .tilelang_sparse_mla_ws import tilelang_sparse_fwd_ws

        return tilelang_sparse_fwd_ws
    return tilelang_sparse_mla.tilelang_sparse_fwd


def backward_kernel() -> Callable:
    """The sparse backward ``--attn tilelang`` runs, by GLM5_TILELANG_BWD: ``dense`` (default) our warp-specialised
    TileLang scores kernel with cuBLAS for dq and dkv where the dense formulation applies, the Triton backward
    elsewhere (tilelang_sparse_mla_bwd_ws); ``triton`` the Triton two-step backward; ``tilelang`` our one-kernel
    TileLang backward with fp32 atomics (tilelang_sparse_mla_bwd)."""
    choice = _setting("GLM5_TILELANG_BWD", ("dense", "triton", "tilelang"), "the sparse backward of --attn "
                      "tilelang: our TileLang scores kernel + cuBLAS, the Triton two-step kernels or our one-kernel "
                      "TileLang backward")
    if choice == "tilelang":
        from .tilelang_sparse_mla_bwd import tilelang_sparse_bwd

        return tilelang_sparse_bwd
    if choice == "dense":
        from .tilelang_sparse_mla_bwd_ws import tilelang_sparse_bwd_dense

        return tilelang_sparse_bwd_dense
    from .triton_sparse_mla import sparse_mla_bwd

    return sparse_mla_bwd


def _writes_head_sums(bwd: Callable) -> bool:
    """Whether this backward fills the indexer KL target's head sums (``head_sums=``) for the deferred KL."""
    from .tilelang_sparse_mla_bwd_ws import tilelang_sparse_bwd_dense
    from .triton_sparse_mla import sparse_mla_bwd

    return bwd is sparse_mla_bwd or bwd is tilelang_sparse_bwd_dense


class TilelangBackend(LibraryBackend):
    """Our TileLang sparse forward and backward (``tilelang_sparse_mla_bwd``) and KL target (``tilelang_kl``); the
    KL loss's indexer side, the deterministic backward and the shapes the kernels do not take are
    ``self.fallback``'s, the Triton backend."""

    name = "tilelang"
    implemented = True

    def __init__(self, deterministic: Optional[bool] = None):
        self.deterministic = deterministic
        self.fallback = TritonBackend(deterministic, kl_head_probs=self.kl_head_probs)
        self._has_tilelang: Optional[bool] = None

    def has_tilelang(self) -> bool:
        if self._has_tilelang is None:
            self._has_tilelang = tilelang_sparse_mla.probe_tilelang()
        return self._has_tilelang

    def unavailable_reason(self) -> Optional[str]:
        if not self.has_tilelang():
            return f"--attn tilelang needs the tilelang package: {TILELANG_INSTALL}"
        return self.fallback.triton_missing(self.name, "(KL loss's indexer side, deterministic backward, fallbacks)")

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        from . import tilelang_indexer  # our TileLang scores + the shared exact top-k (tilelang_indexer.py)

        why = tilelang_indexer.indexer_unsupported_reason(q_idx, k_idx)
        if why is None:
            return tilelang_indexer.tilelang_indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end,
                                                          softmax_scale)
        warn_once(self.name, why)
        return self.fallback.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale,
                                          chunk_size)

    def deferred_indexer_kl(self, q_idx, k_idx, weights, idx_softmax_scale, q, d_v, indices, head_sum_reduce=None,
                            per_token=False, on_value=None):
        """The Triton backend's deferred KL job (the backward writes the head sums) with a backward that writes them
        (GLM5_TILELANG_BWD dense, the default, or triton), as GLM5_TRITON_DEFER_KL says (auto: in a one-process run;
        ``triton_backend.defer_kl_default``).  On the H200 it took 15.0 ms off the 4-layer proxy step (198.8 vs
        213.8 ms with the Triton backward, docs/performance.md, session 10)."""
        if not _writes_head_sums(backward_kernel()):
            return None
        return self.fallback.deferred_indexer_kl(q_idx, k_idx, weights, idx_softmax_scale, q, d_v, indices,
                                                 head_sum_reduce, per_token, on_value)

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None,
                   kl_job=None):
        """kl_job: ``deferred_indexer_kl``'s job for the same q, d_v and indices: our forward (the Triton one for
        shapes it does not take) and the Triton backward handing it the head sums."""
        if kl_job is not None:
            from . import triton_sparse_mla

            fwd = (forward_kernel() if tilelang_sparse_mla.tilelang_unsupported_reason(q, kv, d_v) is None
                   else triton_sparse_mla.sparse_mla_fwd)
            return triton_sparse_mla.sparse_mla(kl_job.order(q), kv, indices, softmax_scale, d_v, self.deterministic,
                                                on_head_sums=kl_job.receive, forward=fwd, backward=backward_kernel())
        if indices is not None:
            why = tilelang_sparse_mla.tilelang_unsupported_reason(q, kv, d_v) or triton_backward_reason(q, d_v)
            if why is None:
                return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, self.deterministic, forward_kernel(),
                                           backward_kernel())
            warn_once(self.name, why)
        return self.fallback.sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)

    def kl_head_probs(self, q, kv, indices, d_v, attn_lse):
        """The KL target's head sums: our one-pass TileLang kernel (the indexer side of the loss stays Triton's), or
        None (the fallback's own) for inputs it does not take."""
        from . import tilelang_kl

        why = tilelang_kl.head_probs_unsupported_reason(q, kv, indices, d_v, attn_lse)
        if why is not None:
            warn_once(self.name, why)
            return None
        return tilelang_kl.tilelang_head_summed_probs
