"""Attention ops for GLM-5 DSA: lightning-indexer top-k, sparse MLA, indexer KL loss, and the backend registry."""

from .backends import (
    AUTO_PREFERENCE,
    BACKENDS,
    AttentionBackend,
    BackendUnavailable,
    PendingGPUBackend,
    TorchBackend,
    get_backend,
)
from .reference import (
    indexer_kl_loss,
    indexer_kl_loss_naive,
    indexer_scores_naive,
    indexer_topk,
    indexer_topk_naive,
    indices_mask_naive,
    sparse_mla,
    sparse_mla_naive,
    window_mask_naive,
)

__all__ = [
    "AUTO_PREFERENCE",
    "BACKENDS",
    "AttentionBackend",
    "BackendUnavailable",
    "PendingGPUBackend",
    "TorchBackend",
    "get_backend",
    "indexer_kl_loss",
    "indexer_kl_loss_naive",
    "indexer_scores_naive",
    "indexer_topk",
    "indexer_topk_naive",
    "indices_mask_naive",
    "sparse_mla",
    "sparse_mla_naive",
    "window_mask_naive",
]
