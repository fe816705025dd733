"""``--attn flashmla``: FlashMLA's sparse prefill forward (``flashmla_sparse_mla``) with our Triton backward.

The backward is ``triton_sparse_mla.sparse_mla_bwd`` (unchanged, called as is) on the saved q, kv, the unpadded
indices, out and lse, through the backends' autograd Function (``base.SparseMLAFunction``).  Shapes FlashMLA cannot
run (other head counts, d_qk / d_v, non-bf16 inputs, or d_qk - d_v not a power of two for our backward) go to the
``fallback`` Triton backend for that call, with a warning logged once per reason.  indexer_topk and
indexer_kl_loss are the fallback's.  Dense mode (indices None) is the torch reference, as for --attn triton.
"""

from __future__ import annotations

from typing import Optional

from . import flashmla_sparse_mla
from .base import LibraryBackend, sparse_mla_autograd, triton_backward_reason, warn_once
from .flashmla_sparse_mla import FLASHMLA_INSTALL
from .triton_backend import TritonBackend

__all__ = ["FlashMLABackend"]


class FlashMLABackend(LibraryBackend):
    """FlashMLA sparse forward + our Triton backward; everything else is ``self.fallback``'s, the Triton backend
    (see the module doc)."""

    name = "flashmla"
    implemented = True

    def __init__(self, deterministic: Optional[bool] = None):
        self.deterministic = deterministic
        self.fallback = TritonBackend(deterministic)
        self._has_flash_mla: Optional[bool] = None

    def has_flash_mla(self) -> bool:
        if self._has_flash_mla is None:
            self._has_flash_mla = flashmla_sparse_mla.probe_flash_mla()
        return self._has_flash_mla

    def unavailable_reason(self) -> Optional[str]:
        if not self.has_flash_mla():
            return f"--attn flashmla needs the flash_mla package (with flash_mla_sparse_fwd): {FLASHMLA_INSTALL}"
        return self.fallback.triton_missing(self.name, "for the backward")

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        if indices is not None:
            why = flashmla_sparse_mla.flashmla_unsupported_reason(q, kv, d_v) or triton_backward_reason(q, d_v)
            if why is None:
                from . import triton_sparse_mla

                return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, self.deterministic,
                                           flashmla_sparse_mla.flash_mla_sparse_forward,
                                           triton_sparse_mla.sparse_mla_bwd)
            warn_once(self.name, why)
        return self.fallback.sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)
