"""``--attn triton``: our Triton kernels (``triton_indexer``, ``triton_sparse_mla``, ``triton_kl``).

The FlashMLA, cuDNN and TileLang backends hold one of these as their ``fallback`` (the ops and shapes their
libraries do not cover).  triton itself is imported only when a kernel runs.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Optional

from ..errors import UserError
from . import reference
from .base import AttentionBackend, no_cuda_reason, warn_once

__all__ = ["TritonBackend", "TritonSettingError", "TRITON_INSTALL", "defer_kl_default"]

TRITON_INSTALL = "pip install 'megatron-glm5[gpu]'"
#: tl.dot on a GPU needs every operand dimension >= 16 (the interpreter does not check it)
MIN_DOT_DIM = 16


def _kernel_dims_reason(**dims: int) -> Optional[str]:
    """Why these head dims cannot go through the kernels (not powers of two, or below tl.dot's minimum), or None."""
    for name, d in dims.items():
        if d <= 0 or d & (d - 1):
            return f"{name}={d} is not a power of two"
    if _on_gpu():
        for name, d in dims.items():
            if d < MIN_DOT_DIM:
                return f"{name}={d} is below Triton's matrix-multiply minimum of {MIN_DOT_DIM}"
    return None


def _on_gpu() -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1"


def _pow2_split(dim: int):
    """(d_hi, d_lo) with d_hi the largest power of two below dim and d_lo = dim - d_hi also a power of two, or None."""
    hi = 1 << (max(1, dim) - 1).bit_length() - 1
    lo = dim - hi
    return (hi, lo) if lo > 0 and lo & (lo - 1) == 0 else None


class TritonSettingError(UserError, ValueError):
    """A bad value of one of the Triton backend's environment settings."""


def _one_process() -> bool:
    """No torch.distributed group, or one of a single rank."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def defer_kl_setting() -> str:
    """GLM5_TRITON_DEFER_KL as "auto" (default), "1" or "0" (``defer_kl_default`` says what each means)."""
    raw = os.environ.get("GLM5_TRITON_DEFER_KL", "auto")
    v = raw.strip().lower() or "auto"
    if v not in ("auto", "0", "1", "true", "false", "yes", "no"):
        raise TritonSettingError(f"GLM5_TRITON_DEFER_KL={raw!r}: must be auto, 0 or 1 (1: the indexer KL loss "
                                 "computed in the backward from the sparse-attention backward's head sums; 0: in the "
                                 "forward; auto: 1 in a one-process run, else 0)")
    return v if v in ("auto", "0", "1") else ("1" if v in ("true", "yes") else "0")


def defer_kl_default() -> bool:
    """GLM5_TRITON_DEFER_KL: ``auto`` (default) the deferred indexer KL in a one-process run and the forward-time
    one otherwise; 1 always deferred; 0 never.  On the H200 the deferred KL made the 4-layer proxy step 13.1 ms
    faster (211.8 vs 224.9 ms, docs/performance.md, session 9); it has not been run under TP / PP / CP with several
    processes, so those keep the forward-time KL unless set to 1."""
    v = defer_kl_setting()
    return _one_process() if v == "auto" else v == "1"


class TritonBackend(AttentionBackend):
    """Our Triton kernels (megatron_glm5/ops/triton_*.py).

    indexer_topk: fused scores + exact chunked top-k (triton_indexer).  sparse_mla with indices: Triton forward
    and backward (triton_sparse_mla; dkv summed with fp32 atomics, bitwise reproducible with
    GLM5_TRITON_DETERMINISTIC=1 or ``deterministic=True`` at 1.7x the backward time).  sparse_mla without indices
    (dense warm-up) and indexer_kl_loss without indices fall back to the torch reference; indexer_kl_loss with
    indices runs two Triton kernels (triton_kl: head-summed attention probabilities -- one pass when the forward's
    lse is passed as attn_lse -- and the fused indexer logits / KL / gradients).  Needs power-of-two d_v,
    d_qk - d_v and index head dim.

    kl_head_probs: for a backend holding this one as its fallback, ``(q, kv, indices, d_v, attn_lse) -> kernel or
    None``: another kernel for the KL target's head sums (``triton_kl.head_summed_probs``'s signature) for these
    inputs, or None for the Triton one.

    defer_kl (default: env GLM5_TRITON_DEFER_KL, 1): the sparse-stage indexer KL is computed in the backward
    (``deferred_indexer_kl``, ``deferred_kl.py``) from the head sums the sparse-MLA backward's kernel 1 writes from
    the p it recomputes anyway -- no head-sum kernel, no KL work in the forward.  0: in the forward, as
    ``indexer_kl_loss`` (the two kernels above).
    """

    name = "triton"
    implemented = True

    def __init__(self, deterministic: Optional[bool] = None, kl_head_probs: Optional[Callable] = None,
                 defer_kl: Optional[bool] = None):
        self.deterministic = deterministic
        self.kl_head_probs = kl_head_probs
        self._defer_kl = None if defer_kl is None else bool(defer_kl)
        self._has_package: Optional[bool] = None

    @property
    def defer_kl(self) -> bool:
        """Whether the sparse-stage indexer KL is deferred to the backward (the constructor's value, else the
        environment's GLM5_TRITON_DEFER_KL, read when asked)."""
        return defer_kl_default() if self._defer_kl is None else self._defer_kl

    @defer_kl.setter
    def defer_kl(self, value: Optional[bool]) -> None:
        self._defer_kl = None if value is None else bool(value)

    def has_package(self) -> bool:
        if self._has_package is None:
            try:
                importlib.import_module("triton")
                self._has_package = True
            except Exception:
                self._has_package = False
        return self._has_package

    def triton_missing(self, name: str, role: str = "") -> Optional[str]:
        """Why ``--attn name``, which runs these kernels (``role``: for what), cannot run: no triton package or no
        CUDA GPU (None when it can)."""
        if not self.has_package():
            role = f" {role}" if role else ""
            return f"--attn {name} needs the triton package{role}: {TRITON_INSTALL}"
        return no_cuda_reason(name)

    def unavailable_reason(self) -> Optional[str]:
        return self.triton_missing(self.name)

    def _fallback(self, why: str) -> None:
        warn_once(self.name, why, using="the torch reference")

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        why = _kernel_dims_reason(index_head_dim=q_idx.shape[-1])
        if why:
            self._fallback(why)
            return reference.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale,
                                          chunk_size)
        from . import triton_indexer

        return triton_indexer.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale)

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None,
                   kl_job=None):
        """kl_job: this backend's ``deferred_indexer_kl`` for the same q, d_v and indices (its head sums come
        from this backward)."""
        if kl_job is not None:
            from . import triton_sparse_mla

            return triton_sparse_mla.sparse_mla(kl_job.order(q), kv, indices, softmax_scale, d_v, self.deterministic,
                                                on_head_sums=kl_job.receive)
        why = _kernel_dims_reason(d_v=d_v, d_rope=q.shape[-1] - d_v) if indices is not None else None
        if why:
            self._fallback(why)
            indices_for_ref = indices
        elif indices is None:  # dense causal mode: no Triton kernel, the reference does it
            indices_for_ref = None
        else:
            indices_for_ref = False
        if indices_for_ref is not False:
            return reference.sparse_mla(q, kv, indices_for_ref, softmax_scale, d_v, key_start, query_end, chunk_size)
        from . import triton_sparse_mla

        return triton_sparse_mla.sparse_mla(q, kv, indices, softmax_scale, d_v, self.deterministic)

    def deferred_indexer_kl(self, q_idx, k_idx, weights, idx_softmax_scale, q, d_v, indices, head_sum_reduce=None,
                            per_token=False, on_value=None):
        if not self.defer_kl or indices is None or _kernel_dims_reason(
                d_v=d_v, d_rope=q.shape[-1] - d_v, index_head_dim=q_idx.shape[-1]):
            return None  # the forward-time KL (indexer_kl_loss): dense warm-up, reference fallbacks, defer_kl off
        from . import triton_kl
        from .deferred_kl import DeferredIndexerKL

        kl_grads = functools.partial(triton_kl.indexer_kl_grads, idx_softmax_scale=idx_softmax_scale,
                                     head_sum_reduce=head_sum_reduce, deterministic=self.deterministic)
        return DeferredIndexerKL(q_idx, k_idx, weights, indices, kl_grads, per_token, on_value)

    def indexer_kl_loss(
        self, q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
        indices=None, token_mask=None, head_sum_reduce=None, chunk_size=None, attn_lse=None,
    ):
        split = _pow2_split(q.shape[-1])
        why = None if indices is None or split is None else _kernel_dims_reason(
            d_v=split[0], d_rope=split[1], index_head_dim=q_idx.shape[-1])
        if why and indices is not None:
            self._fallback(why)
        if indices is None or split is None or why:
            return reference.indexer_kl_loss(
                q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
                indices=indices, token_mask=token_mask, head_sum_reduce=head_sum_reduce, chunk_size=chunk_size,
            )
        from . import triton_kl

        head_probs = self.kl_head_probs(q, kv, indices, split[0], attn_lse) if self.kl_head_probs else None
        return triton_kl.indexer_kl_loss_sparse(
            q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, indices, split[0],
            token_mask=token_mask, head_sum_reduce=head_sum_reduce, attn_lse=attn_lse,
            deterministic=self.deterministic, head_probs=head_probs or triton_kl.head_summed_probs,
        )
