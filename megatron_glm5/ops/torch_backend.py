"""``--attn torch``: the pure-torch reference (``reference.py``) -- any device, chunked and memory-lean, slow."""

from __future__ import annotations

from typing import Optional

from . import reference
from .base import AttentionBackend

__all__ = ["TorchBackend"]


class TorchBackend(AttentionBackend):
    """The pure-torch reference (any device, chunked and memory-lean, slow)."""

    name = "torch"
    implemented = True

    def unavailable_reason(self) -> Optional[str]:
        return None

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        return reference.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size)

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        return reference.sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)

    def indexer_kl_loss(
        self, q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
        indices=None, token_mask=None, head_sum_reduce=None, chunk_size=None, attn_lse=None,
    ):
        return reference.indexer_kl_loss(
            q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
            indices=indices, token_mask=token_mask, head_sum_reduce=head_sum_reduce, chunk_size=chunk_size,
        )
