"""FlashMLA's sparse prefill forward in our layout (used by ``--attn flashmla`` and ``--attn cudnn``).

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
lse +inf -> -inf.

Verified: on CPU against a fake ``flash_mla`` module implementing the contract above in plain torch
(tests/test_ops_external_backends.py); on an H200 against the real library built from that commit (the GPU tests
there: 2 passed on 2026-11-30).
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch

from .base import pad_topk

__all__ = ["flash_mla_sparse_forward", "flashmla_unsupported_reason", "import_flash_mla", "probe_flash_mla",
           "FLASHMLA_INSTALL"]

FLASHMLA_INSTALL = ("build FlashMLA from source: https://github.com/deepseek-ai/FlashMLA (git clone --recursive, then "
                    "pip install --no-build-isolation . -- needs nvcc and the CUTLASS submodule; SM90/SM100 GPUs)")
FLASHMLA_HEADS = (64, 128)
FLASHMLA_DQK = (512, 576)
FLASHMLA_DV = 512


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
