"""What every attention backend shares: the interface, the CUDA check, the once-per-reason fallback warning, top-k
padding and the one sparse-MLA autograd Function the GPU backends plug their kernels into.

Every backend offers the three ops of ``megatron_glm5.ops.reference`` with the same signatures: ``indexer_topk``,
``sparse_mla`` and ``indexer_kl_loss``.  This module imports torch and the reference ops only (no triton, tilelang or GPU library), so the
registry (``registry.py``) stays importable anywhere.  docs/design.md, "Attention backends", says what runs where.
"""

from __future__ import annotations

import logging
from typing import Optional, Set, Tuple

import torch

from .reference import TOPK_DTYPE

__all__ = [
    "AttentionBackend",
    "BackendUnavailable",
    "LibraryBackend",
    "SparseMLAFunction",
    "TOPK_ALIGN",
    "cuda_available",
    "no_cuda_reason",
    "pad_topk",
    "sparse_mla_autograd",
    "triton_backward_reason",
    "warn_once",
]

logger = logging.getLogger("megatron_glm5.ops")

#: FlashMLA's SM90 forward asserts topk % 128 == 0 and the cuDNN backward is launched with the same envelope
TOPK_ALIGN = 128


class BackendUnavailable(ImportError):
    """The requested attention backend cannot run here (missing package, no CUDA GPU, or kernels not shipped)."""


class AttentionBackend:
    """Interface of an attention backend.  Subclasses implement ``unavailable_reason`` and the three ops."""

    name: str = "base"
    #: whether this release ships kernels for the backend
    implemented: bool = False

    def unavailable_reason(self) -> Optional[str]:
        """Why the backend cannot run in this process (one line naming the fix), or None when it can."""
        raise NotImplementedError

    def available(self) -> bool:
        """True when the backend can run in this process."""
        return self.unavailable_reason() is None

    def check(self) -> None:
        """Raise BackendUnavailable saying why this backend cannot be used (nothing when it can)."""
        why = self.unavailable_reason()
        if why is not None:
            raise BackendUnavailable(why)

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        raise NotImplementedError

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        raise NotImplementedError

    def indexer_kl_loss(
        self, q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
        indices=None, token_mask=None, head_sum_reduce=None, chunk_size=None, attn_lse=None,
    ):
        """(kl_sum, n_tokens) as ``reference.indexer_kl_loss``; n_tokens is an int or a 0-dim device tensor.
        attn_lse: optionally, sparse_mla's lse for the same q, kv, indices, scale (a backend may reuse it)."""
        raise NotImplementedError

    def deferred_indexer_kl(self, q_idx, k_idx, weights, idx_softmax_scale, q, d_v, indices, head_sum_reduce=None,
                            per_token=False, on_value=None):
        """The sparse-stage indexer KL deferred to the backward (``deferred_kl.DeferredIndexerKL``: pass it to
        ``sparse_mla(..., kl_job=)`` and attach its ``token`` like the KL), where this backend's sparse-MLA backward
        computes the KL target's head sums; None (the default): call ``indexer_kl_loss`` after ``sparse_mla``."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class LibraryBackend(AttentionBackend):
    """A backend built on a library that covers some of the ops: each op it does not override goes, visibly, to
    ``self.fallback`` (the backend holding our kernels for the rest, set in the subclass's ``__init__``)."""

    fallback: AttentionBackend

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        return self.fallback.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale,
                                          chunk_size)

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        return self.fallback.sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)

    def indexer_kl_loss(
        self, q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
        indices=None, token_mask=None, head_sum_reduce=None, chunk_size=None, attn_lse=None,
    ):
        return self.fallback.indexer_kl_loss(
            q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
            indices=indices, token_mask=token_mask, head_sum_reduce=head_sum_reduce, chunk_size=chunk_size,
            attn_lse=attn_lse,
        )


def cuda_available() -> bool:
    return torch.cuda.is_available()


def no_cuda_reason(name: str) -> Optional[str]:
    """The one message of a GPU backend on a machine without CUDA (None when there is a GPU)."""
    if cuda_available():
        return None
    return f"--attn {name} needs a CUDA GPU (torch.cuda.is_available() is False); use --attn torch"


_warned: Set[str] = set()


def warn_once(backend: str, why: str, using: str = "the Triton backend") -> None:
    """Log, once per (backend, reason), that an op of ``--attn backend`` runs on its fallback ``using``."""
    key = f"{backend}: {why}"
    if key not in _warned:
        _warned.add(key)
        logger.warning("--attn %s: %s; using %s for this op", backend, why, using)


def pad_topk(indices: torch.Tensor, align: int = TOPK_ALIGN) -> torch.Tensor:
    """TOPK_DTYPE (int32) [T, K'] with K' the next multiple of align, new slots -1 (unused)."""
    indices = indices.to(TOPK_DTYPE)
    k = indices.shape[1]
    k_pad = max(align, -(-k // align) * align)
    if k_pad != k:
        indices = torch.nn.functional.pad(indices, (0, k_pad - k), value=-1)
    return indices.contiguous()


def triton_backward_reason(q: torch.Tensor, d_v: int) -> Optional[str]:
    """Why our Triton sparse backward (the backward or fallback of every GPU backend) cannot take q (None: it can)."""
    d_rope = q.shape[-1] - d_v
    if d_v & (d_v - 1) or d_rope <= 0 or d_rope & (d_rope - 1):
        return f"our Triton backward needs power-of-two d_v and d_rope, got {d_v} / {d_rope}"
    return None


class SparseMLAFunction(torch.autograd.Function):
    """autograd of sparse MLA for every backend: ``forward_fn(q, kv, indices, scale, d_v) -> (out, lse)`` and
    ``backward_fn(q, kv, indices, out, lse, d_out, d_lse, scale, d_v, deterministic) -> (dq, dkv)`` (the Triton
    kernels of ``triton_sparse_mla``, FlashMLA / TileLang forwards and the cuDNN / TileLang backwards plug in here).
    Saves q, kv, indices, out, lse.  Gradients are not materialised: a None d_lse (lse unused) reaches backward_fn
    as None."""

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, deterministic, forward_fn, backward_fn):
        out, lse = forward_fn(q, kv, indices, softmax_scale, d_v)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.d_v, ctx.det, ctx.backward_fn = softmax_scale, d_v, deterministic, backward_fn
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        if d_out is None and d_lse is None:
            return (None,) * 8
        q, kv, indices, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dkv = ctx.backward_fn(q, kv, indices, out, lse, d_out, d_lse, ctx.scale, ctx.d_v, ctx.det)
        return dq, dkv, None, None, None, None, None, None


def sparse_mla_autograd(q, kv, indices, softmax_scale: float, d_v: int, deterministic: Optional[bool], forward_fn,
                        backward_fn) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of sparse MLA with autograd (dq, dkv) through ``forward_fn`` / ``backward_fn`` (see
    ``SparseMLAFunction``)."""
    return SparseMLAFunction.apply(q, kv, indices, float(softmax_scale), int(d_v), deterministic, forward_fn,
                                   backward_fn)
