"""``--attn tilelang``: our TileLang kernels -- sparse forward (``tilelang_sparse_mla``), sparse backward
(``tilelang_sparse_mla_bwd``), indexer scores (``tilelang_indexer``) and the KL target's head sums
(``tilelang_kl``) -- with the Triton backend as ``fallback``.

indexer_topk: our TileLang scores + the Triton backend's exact top-k.  sparse_mla: our forward and backward
through the backends' autograd Function (``base.SparseMLAFunction``); the deterministic backward is Triton's
(``tilelang_sparse_mla_bwd`` says so, once).  indexer_kl_loss: the fallback's routing and fused indexer side, with
our one-pass head sums for the target (handed to the fallback as its ``kl_head_probs``).  Every shape the kernels
do not take (non-bf16, d_v or d_rope not a power of two; for the KL target also a missing lse) is the fallback's,
with a warning logged once per reason.  Dense mode (indices None) is the torch reference, as for --attn triton.
"""

from __future__ import annotations

from typing import Optional

from . import tilelang_sparse_mla
from .base import LibraryBackend, sparse_mla_autograd, triton_backward_reason, warn_once
from .tilelang_sparse_mla import TILELANG_INSTALL
from .triton_backend import TritonBackend

__all__ = ["TilelangBackend"]


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

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        if indices is not None:
            why = tilelang_sparse_mla.tilelang_unsupported_reason(q, kv, d_v) or triton_backward_reason(q, d_v)
            if why is None:
                from .tilelang_sparse_mla_bwd import tilelang_sparse_bwd

                return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, self.deterministic,
                                           tilelang_sparse_mla.tilelang_sparse_fwd, tilelang_sparse_bwd)
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
