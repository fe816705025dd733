"""``--attn flashmla``: FlashMLA's sparse prefill forward with our Triton backward.

Contract read from deepseek-ai/FlashMLA at commit 9241ae3ef9bac614dd25e45e507e089f888280e0 (2026-04-29,
package version 1.0.0): ``flash_mla/flash_mla_interface.py`` (``flash_mla_sparse_fwd``), ``csrc/api/sparse_fwd.h``
(argument checks), ``csrc/sm90/prefill/sparse/phase1.cuh`` (launch asserts, how lse is written) and
``tests/ref.py`` / ``tests/test_flash_mla_sparse_prefill.py`` (the reference the kernel is tested against):

    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512,
                                                          attn_sink=None, topk_length=None)
    q [s_q, h_q, d_qk] bf16, kv [s_kv, h_kv, d_qk] bf16, indices [s_q, h_kv, topk] int32 (-1 or >= s_kv: unused)
    out [s_q, h_q, d_v] bf16; max_logits, lse [s_q, h_q] fp32
    lse = logsumexp over the selected keys of sm_scale * q.k -- natural log of the *scaled* scores (the kernel
          computes in base 2 and writes log(l) + m * ln 2); a query with no valid key gets lse = +inf, out = 0.
    limits: SM90a / SM100f; d_qk in {512, 576}; d_v == 512; h_kv == 1; h_q in {64, 128}; topk a multiple of
            128 on SM90 (B_TOPK = 64, two blocks per step) and of 64 on SM100; bf16 only.

Our layout (``reference.sparse_mla`` with indices): q [T, h, D], kv [Tk, D], indices [T, K] (-1 unused); lse is
the natural log of the scaled scores with -inf for a row without keys -- the convention
``triton_sparse_mla.sparse_mla_bwd`` expects (it multiplies lse by log2(e) and treats -inf as "no keys").  So the
conversion is: kv -> kv[:, None, :], indices -> int32 [T, 1, K'] padded with -1 to K' = a multiple of 128, and
lse +inf -> -inf.  The backward is ``triton_sparse_mla.sparse_mla_bwd`` (unchanged, called as is) on the saved
q, kv, the unpadded indices, out and lse.

Shapes FlashMLA cannot run (other head counts, d_qk / d_v, non-bf16 inputs, or d_qk - d_v not a power of two for
our backward) fall back to the Triton backend for that call, with a warning logged once per reason.
indexer_topk and indexer_kl_loss are the Triton backend's.  Dense mode (indices None) is the torch reference, as
for --attn triton.

Verified: on CPU against a fake ``flash_mla`` module implementing the contract above in plain torch
(tests/test_ops_external_backends.py); on an H200 against the real library built from that commit (the GPU tests
there: 2 passed on 2026-11-30).
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional, Set, Tuple

import torch

from .backends import TritonBackend

logger = logging.getLogger("megatron_glm5.ops")
_warned: Set[str] = set()

__all__ = ["FlashMLABackend", "flash_mla_sparse_forward", "flashmla_unsupported_reason", "FLASHMLA_INSTALL"]

FLASHMLA_INSTALL = ("build FlashMLA from source: https://github.com/deepseek-ai/FlashMLA (git clone --recursive, then "
                    "pip install --no-build-isolation . -- needs nvcc and the CUTLASS submodule; SM90/SM100 GPUs)")
TOPK_ALIGN = 128  # SM90 asserts topk % 128 == 0 (SM100: % 64); -1 padding is free for the kernel
FLASHMLA_HEADS = (64, 128)
FLASHMLA_DQK = (512, 576)
FLASHMLA_DV = 512


def warn_once(backend: str, why: str) -> None:
    key = f"{backend}: {why}"
    if key not in _warned:
        _warned.add(key)
        logger.warning("--attn %s: %s; using the Triton backend for this op", backend, why)


def import_flash_mla():
    """The flash_mla module, or ImportError."""
    return importlib.import_module("flash_mla")


def probe_flash_mla() -> bool:
    """True when flash_mla imports and offers flash_mla_sparse_fwd."""
    try:
        return hasattr(import_flash_mla(), "flash_mla_sparse_fwd")
    except Exception:  # ImportError, or a broken build failing at import time
        return False


def flashmla_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> Optional[str]:
    """Why FlashMLA's sparse forward cannot take these inputs (None when it can)."""
    if q.dim() != 3 or kv.dim() != 2:
        return f"FlashMLA needs q [T, h, D] and kv [Tk, D], got {tuple(q.shape)} and {tuple(kv.shape)}"
    h, d = q.shape[1], q.shape[2]
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"FlashMLA's sparse forward is bf16 only (got {q.dtype} / {kv.dtype})"
    if h not in FLASHMLA_HEADS:
        return f"FlashMLA's sparse forward needs {FLASHMLA_HEADS} heads per rank, got {h}"
    if d not in FLASHMLA_DQK or d_v != FLASHMLA_DV:
        return f"FlashMLA's sparse forward needs d_qk in {FLASHMLA_DQK} and d_v = {FLASHMLA_DV}, got {d} / {d_v}"
    return None


def pad_topk(indices: torch.Tensor, align: int = TOPK_ALIGN) -> torch.Tensor:
    """int32 [T, K'] with K' the next multiple of align, new slots -1 (unused)."""
    indices = indices.to(torch.int32)
    k = indices.shape[1]
    k_pad = max(align, -(-k // align) * align)
    if k_pad != k:
        indices = torch.nn.functional.pad(indices, (0, k_pad - k), value=-1)
    return indices.contiguous()


def flash_mla_sparse_forward(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                             d_v: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [T, h, d_v] bf16, lse [T, h] fp32, natural log of the scaled scores, -inf for rows without keys) from
    flash_mla.flash_mla_sparse_fwd, in our layout (q [T, h, D], kv [Tk, D], indices [T, K], -1 unused)."""
    flash_mla = import_flash_mla()
    q_f = q.contiguous()
    kv_f = kv.contiguous().unsqueeze(1)  # [s_kv, h_kv = 1, d_qk]
    idx_f = pad_topk(indices).unsqueeze(1)  # [s_q, h_kv = 1, topk]
    out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(q_f, kv_f, idx_f, float(softmax_scale), int(d_v))
    lse = lse.float()
    lse = torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)  # FlashMLA: +inf = no keys
    return out, lse


def _triton_backward_reason(q: torch.Tensor, d_v: int) -> Optional[str]:
    d_rope = q.shape[-1] - d_v
    if d_v & (d_v - 1) or d_rope <= 0 or d_rope & (d_rope - 1):
        return f"our Triton backward needs power-of-two d_v and d_rope, got {d_v} / {d_rope}"
    return None


class FlashMLABackend(TritonBackend):
    """FlashMLA sparse forward + our Triton backward; the indexer ops are the Triton backend's (see module doc)."""

    name = "flashmla"
    implemented = True
    triton_role = "for the backward"

    def __init__(self, deterministic: Optional[bool] = None):
        super().__init__(deterministic)
        self._has_flash_mla: Optional[bool] = None

    def has_flash_mla(self) -> bool:
        if self._has_flash_mla is None:
            self._has_flash_mla = probe_flash_mla()
        return self._has_flash_mla

    def library_missing(self) -> Optional[str]:
        if self.has_flash_mla():
            return None
        return f"--attn flashmla needs the flash_mla package (with flash_mla_sparse_fwd): {FLASHMLA_INSTALL}"

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        if indices is not None:
            why = flashmla_unsupported_reason(q, kv, d_v) or _triton_backward_reason(q, d_v)
            if why is None:
                from . import triton_sparse_mla

                return triton_sparse_mla.sparse_mla(q, kv, indices, softmax_scale, d_v, self.deterministic,
                                                    forward_fn=flash_mla_sparse_forward)
            warn_once(self.name, why)
        return super().sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)
