"""Attention ops for GLM-5 DSA: lightning-indexer top-k, sparse MLA, indexer KL loss, and the backend registry.

Layers: ``base`` (interface, shared helpers, the autograd Function) <- kernel modules and one ``*_backend`` module per
backend <- ``registry`` (BACKENDS, get_backend); see docs/design.md, "Attention backends"."""

from .base import AttentionBackend, BackendUnavailable
from .pending_backend import PendingGPUBackend
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
from .registry import AUTO_PREFERENCE, BACKENDS, get_backend
from .torch_backend import TorchBackend

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
