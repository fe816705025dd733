"""Attention-backend registry: where GPU kernels for the DSA ops plug in.

Every backend offers the three ops of ``megatron_glm5.ops.reference`` with the same signatures:
``indexer_topk``, ``sparse_mla`` and ``indexer_kl_loss``.  Implemented: "torch" (the pure-torch reference),
"triton" (our Triton kernels, TritonBackend), "flashmla" (FlashMLA's sparse forward + our Triton backward,
flashmla_backend), "cudnn" (cuDNN frontend's DSA indexer and sparse backward, cudnn_backend) and "tilelang" (our
TileLang sparse forward + the Triton backward, tilelang_sparse_mla).  PendingGPUBackend is the placeholder class for
a backend without kernels.  docs/design.md, "Attention backends", says what runs where.
"""

from __future__ import annotations

import importlib
import logging
from typing import Dict, Optional, Set

import torch

from . import reference

__all__ = [
    "AttentionBackend",
    "BackendUnavailable",
    "TorchBackend",
    "PendingGPUBackend",
    "TritonBackend",
    "BACKENDS",
    "AUTO_PREFERENCE",
    "get_backend",
]

logger = logging.getLogger("megatron_glm5.ops")


class BackendUnavailable(ImportError):
    """The requested attention backend cannot run here (missing package, no CUDA GPU, or kernels not shipped)."""


class AttentionBackend:
    """Interface of an attention backend.  Subclasses implement the three ops."""

    name: str = "base"
    #: whether this release ships kernels for the backend
    implemented: bool = False

    def available(self) -> bool:
        """True when the backend can run in this process."""
        raise NotImplementedError

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class TorchBackend(AttentionBackend):
    """The pure-torch reference (any device, chunked and memory-lean, slow)."""

    name = "torch"
    implemented = True

    def available(self) -> bool:
        return True

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


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _pow2_split(dim: int):
    """(d_hi, d_lo) with d_hi the largest power of two below dim and d_lo = dim - d_hi also a power of two, or None."""
    hi = 1 << (max(1, dim) - 1).bit_length() - 1
    lo = dim - hi
    return (hi, lo) if lo > 0 and lo & (lo - 1) == 0 else None


class TritonBackend(AttentionBackend):
    """Our Triton kernels (megatron_glm5/ops/triton_*.py).

    indexer_topk: fused scores + exact chunked top-k (triton_indexer).  sparse_mla with indices: Triton forward
    and backward (triton_sparse_mla; dkv summed with fp32 atomics, bitwise reproducible with
    GLM5_TRITON_DETERMINISTIC=1 or ``deterministic=True`` at 1.7x the backward time).  sparse_mla without indices (dense warm-up) and indexer_kl_loss without indices fall
    back to the torch reference; indexer_kl_loss with indices runs two Triton kernels
    (triton_kl: head-summed attention probabilities -- one pass when the forward's lse is passed as attn_lse -- and
    the fused indexer logits / KL / gradients).  Needs power-of-two d_v, d_qk - d_v and index head dim.
    """

    name = "triton"
    implemented = True

    def __init__(self, deterministic: Optional[bool] = None):
        self.deterministic = deterministic
        self._has_package: Optional[bool] = None

    def has_package(self) -> bool:
        if self._has_package is None:
            try:
                importlib.import_module("triton")
                self._has_package = True
            except Exception:
                self._has_package = False
        return self._has_package

    #: what the backends built on this one use triton for (their messages name it)
    triton_role = ""

    def library_missing(self) -> Optional[str]:
        """Why the library a backend built on this one wraps cannot be used (None: it can, or none is needed).
        Subclasses probe once and cache."""
        return None

    def available(self) -> bool:
        return self.library_missing() is None and self.has_package() and _cuda_available()

    def _fallback(self, why: str) -> None:
        if why not in _logged:
            _logged.add(why)
            logger.warning("--attn triton: %s; using the torch reference for this op", why)

    def check(self) -> None:
        why = self.library_missing()
        if why is not None:
            raise BackendUnavailable(why)
        if not self.has_package():
            role = f" {self.triton_role}" if self.triton_role else ""
            raise BackendUnavailable(f"--attn {self.name} needs the triton package{role}: "
                                     "pip install 'megatron-glm5[gpu]'")
        if not _cuda_available():
            raise BackendUnavailable(
                f"--attn {self.name} needs a CUDA GPU (torch.cuda.is_available() is False); use --attn torch")

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        d_i = q_idx.shape[-1]
        if d_i & (d_i - 1):
            self._fallback(f"index head dim {d_i} is not a power of two")
            return reference.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale,
                                          chunk_size)
        from . import triton_indexer

        return triton_indexer.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale)

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        d_rope = q.shape[-1] - d_v
        if indices is not None and (d_v & (d_v - 1) or d_rope <= 0 or d_rope & (d_rope - 1)):
            self._fallback(f"d_v={d_v} / d_rope={d_rope} are not both powers of two")
            indices_for_ref = indices
        elif indices is None:  # dense causal mode: no Triton kernel, the reference does it
            indices_for_ref = None
        else:
            indices_for_ref = False
        if indices_for_ref is not False:
            return reference.sparse_mla(q, kv, indices_for_ref, softmax_scale, d_v, key_start, query_end, chunk_size)
        from . import triton_sparse_mla

        return triton_sparse_mla.sparse_mla(q, kv, indices, softmax_scale, d_v, self.deterministic)

    def indexer_kl_loss(
        self, q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
        indices=None, token_mask=None, head_sum_reduce=None, chunk_size=None, attn_lse=None,
    ):
        split = _pow2_split(q.shape[-1])
        d_i = q_idx.shape[-1]
        if indices is None or split is None or d_i & (d_i - 1):
            return reference.indexer_kl_loss(
                q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
                indices=indices, token_mask=token_mask, head_sum_reduce=head_sum_reduce, chunk_size=chunk_size,
            )
        from . import triton_kl

        return triton_kl.indexer_kl_loss_sparse(
            q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, indices, split[0],
            token_mask=token_mask, head_sum_reduce=head_sum_reduce, attn_lse=attn_lse,
            deterministic=self.deterministic,
            head_probs=self.kl_head_probs(q, kv, indices, split[0], attn_lse) or triton_kl.head_summed_probs,
        )

    def kl_head_probs(self, q, kv, indices, d_v, attn_lse):
        """Another kernel for the KL target's head sums (``triton_kl.head_summed_probs``'s signature) for these
        inputs, or None: the Triton one. Backends built on this one override it."""
        return None


class PendingGPUBackend(AttentionBackend):
    """A GPU backend whose kernels are not part of this release."""

    implemented = False

    def __init__(self, name: str, module: str, install_hint: str):
        self.name = name
        self.module = module
        self.install_hint = install_hint
        self._has_package: Optional[bool] = None

    def has_package(self) -> bool:
        if self._has_package is None:
            try:
                importlib.import_module(self.module)
                self._has_package = True
            except Exception:  # ImportError, or a broken install failing at import time
                self._has_package = False
        return self._has_package

    def available(self) -> bool:
        return self.has_package() and _cuda_available()

    def missing_package_message(self) -> str:
        return f"--attn {self.name} needs the {self.module} package: {self.install_hint}"

    def no_cuda_message(self) -> str:
        return f"--attn {self.name} needs a CUDA GPU (torch.cuda.is_available() is False); use --attn torch"

    def not_shipped_message(self) -> str:
        return f"--attn {self.name}: kernels arrive in a later release; use --attn torch"

    def check(self) -> None:
        """Raise BackendUnavailable saying why this backend cannot be used."""
        if not self.has_package():
            raise BackendUnavailable(self.missing_package_message())
        if not _cuda_available():
            raise BackendUnavailable(self.no_cuda_message())
        raise BackendUnavailable(self.not_shipped_message())

    def _refuse(self, *args, **kwargs):
        raise BackendUnavailable(self.not_shipped_message())

    indexer_topk = _refuse
    sparse_mla = _refuse
    indexer_kl_loss = _refuse


# after the classes above: these modules subclass TritonBackend (indexer / KL ops) and use the helpers above
from .cudnn_backend import CudnnBackend  # noqa: E402
from .flashmla_backend import FlashMLABackend  # noqa: E402
from .tilelang_sparse_mla import TilelangBackend  # noqa: E402

BACKENDS: Dict[str, AttentionBackend] = {
    "torch": TorchBackend(),
    "triton": TritonBackend(),
    "tilelang": TilelangBackend(),
    "cudnn": CudnnBackend(),
    "flashmla": FlashMLABackend(),
}

#: order in which "auto" tries backends (fastest first); only implemented, available ones are chosen
# fastest first, by the 4-layer GLM-5 proxy's training step on the H200 at seq 4096 (docs/performance.md): cudnn
# (cuDNN backward, FlashMLA forward when installed) 228 ms, tilelang (all TileLang but the fused KL kernel) 279,
# flashmla (FlashMLA forward, Triton backward) 336, triton 346
AUTO_PREFERENCE = ("cudnn", "tilelang", "flashmla", "triton", "torch")

_ALIASES = {"flash_mla": "flashmla", "flash-mla": "flashmla", "reference": "torch"}
_logged: Set[str] = set()


def _log_once(requested: str, backend: AttentionBackend) -> None:
    if backend.name not in _logged:
        _logged.add(backend.name)
        logger.info("attention backend: %s (requested --attn %s)", backend.name, requested)


def get_backend(name: str = "auto") -> AttentionBackend:
    """The attention backend for ``--attn name``.

    "auto": the best implemented and available backend ("torch" when no GPU kernel can run).  Unknown name:
    ValueError listing the choices.  A known backend that cannot run: BackendUnavailable (an ImportError) with a
    one-line reason -- missing package (with the install step), no CUDA GPU, or kernels not shipped yet.
    """
    requested = str(name).strip().lower()
    key = _ALIASES.get(requested, requested)
    if key == "auto":
        for candidate in AUTO_PREFERENCE:
            backend = BACKENDS[candidate]
            if backend.implemented and backend.available():
                _log_once(requested, backend)
                return backend
        raise BackendUnavailable("--attn auto: no attention backend is available")  # unreachable: torch always is
    if key not in BACKENDS:
        choices = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}")
    backend = BACKENDS[key]
    if isinstance(backend, (PendingGPUBackend, TritonBackend)):
        backend.check()  # pending backends always raise (no kernels in this release); triton raises if it can't run
    if not backend.available():
        raise BackendUnavailable(f"--attn {key} is not available in this process")
    _log_once(requested, backend)
    return backend
