"""Triton sparse MLA in the absorbed latent space: forward (out, lse) and backward (dq, dkv).

Layout and semantics are those of ``reference.sparse_mla`` with ``indices`` given: q [T, h, D], kv [Tk, D] with
D = d_v + d_rope (GLM-5: 512 latent + 64 rope; the latent part is also V), indices [T, K] int (-1 = unused).

Forward: one program per (query token, slice of V).  The h heads of the token are the M dimension of the matrix
products (padded to >= 16); the selected kv rows are gathered BLOCK_N at a time; online softmax in fp32 (exp2);
p is rounded to the value dtype for the PV product, accumulation in fp32.  With V_SPLIT = 2 two programs share a
token, each owning half of the 512 value columns (they both compute the scores) -- fewer registers per program.

Backward, per query chunk: kernel 1 (``_bwd_kernel``), one program per (query token, group of h / H_SPLIT heads;
H_SPLIT 1 by default: all heads, M = 64 products) recomputes p from the saved lse and ds = p (dp - Delta) scale,
accumulates dq in registers and stops after the query's last used top-k slot (SKIP_PAD).  The dkv contributions
dK = dS^T Q (+ P^T dO on the latent part) are then formed one of three ways (BWD_CONFIG["DK"]):
  * "slots": kernel 1 writes p and ds (input dtype) to a [chunk, K, 2, heads] buffer; ``_dkv_kernel``, one program
    per (query, DK_BLOCK_S slots), contracts all heads in one product (M = slots, K = heads, N = 576 in DK_BLOCK_C
    columns) -- one dkv row per (query, slot) instead of one per (query, head group, slot);
  * "dense": kernel 1 scatters p and ds into zeroed [key, query x head] matrices (a query's keys are distinct: each
    entry is written once), multiplied with Q and dO with fp32 accumulation -- no atomics, but every key below the
    chunk's key end is multiplied, selected or not.  When the indexer that made ``indices`` left their per-row key
    bounds on the host (``host_windows.row_ends``: the windows it planned with), each chunk's key end is known on
    the host and the products are two cuBLAS GEMMs over exactly those keys (``_dense_piece_products``; with
    DENSE_PIECE_ROWS per piece of the chunk's rows, over each piece's keys), and dq a third (``dense_dq_mm``: dS^T
    kv on the same matrix; kernel 1 then only forms p and ds).  Otherwise (top-k
    lists from elsewhere, or BWD_CONFIG DENSE_DKV "triton") ``_dense_dkv_kernel`` does them: launched over all
    n_keys, it reads the chunk's largest index on the device (key blocks past it exit) and zeroes the tiles it
    read, so the buffer is zeroed once per call;
  * "in_kernel": the earlier one-kernel backward (ONE_KERNEL_BWD_CONFIG), the products per head group inside
    kernel 1.
"auto" (the default) takes "dense" where n_keys / topk is small enough (DENSE_KEY_RATIO: S 4096-16384 causal), else
"slots".  The planning uses host-known values only (n_q, n_keys, topk, the indexer's row bounds): no host
synchronisation in the backward.  Summing the contributions of different queries ("slots", "in_kernel"):
  * "atomic": fp32 atomic adds straight into dkv -- fast, summation order (and so the last bits) not reproducible;
  * "deterministic": contributions of a query chunk are written to a [chunk * rows, D] fp32 buffer, the chunk's
    rows are stably sorted by key, and a segmented-sum kernel (one program per key, its rows found by a binary
    search in the sorted keys) adds each key's rows in that fixed order; chunks are added in order.  Bitwise
    reproducible.  "dense" is reproducible in both modes (GEMMs, chunks in order).
Choose with ``deterministic=`` or the env var GLM5_TRITON_DETERMINISTIC (1 / 0).  Default: atomic.  H200
(docs/design.md, "The Triton sparse-MLA backward"): S 4096 8.6-9.1 ms either mode with dq as a GEMM (10.0 with
dq in kernel 1; the one-kernel backward 29.3 / 50.5), S 32768 146 atomic / 254 deterministic (session 11).

A transposed formulation (scores as [keys, heads], Q and dO only ever B operands) was tried and measured slower on
the H200 (69-70 vs 98 TFLOP/s at S 8192, and its 32-key tiles did not fit in shared memory): removed.

With ``head_probs`` the forward kernel also writes the sparse-stage indexer KL target, the head sums
P[t, j] = sum_h softmax_j (``triton_kl``'s ``head_summed_probs``): after the main loop each head's log-sum-exp is
known, and a second pass over the selected keys (scores only, no PV, the query still in registers) sums the
normalised probabilities over heads -- the KL then skips its own kernel (``indexer_kl_loss_sparse``'s
``attn_head_probs``).  Measured on the H200 (docs/performance.md, issue 16) the second pass costs more than the
separate kernel it replaces (S 4096: forward 4.62 -> 8.60 ms against 3.64 ms for the separate head sums; S 32768:
35.4 -> 67.9 against 26.8): it saves only a query load and a launch, the keys are gathered and multiplied again
either way.  The option stays for the benchmark; training takes the head sums from the backward instead.

With ``head_sums`` the backward's kernel 1 writes the same head sums from the p it recomputes for dq anyway (one
sum over heads per block of keys; per head group and then summed in order with H_SPLIT > 1): the KL target of the
deferred indexer KL (``deferred_kl``), H200 S 4096 10.7 vs 9.95 ms for the backward against 3.58 ms for the
separate kernel.  Delta = rowsum(dO * O) - d_lse is a small kernel (``_delta_bwd_kernel``: fp32 products of the
16-bit inputs, no fp32 copies; 0.15 vs 1.30 ms for the torch expression at S 4096).

Dense mode (indices None) is not a Triton kernel: the backend falls back to the reference for it.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import host_windows, triton_interpret_compat
from .base import sparse_mla_autograd, warn_once
from .sparse_bwd_budget import (DENSE_KEY_RATIO, DENSE_PREFIX_DEFAULT,  # noqa: F401 (re-exported)
                                DET_BUFFER_BYTES, MIN_PREFIX_ROWS, PDS_BUFFER_BYTES, ZEROS_RESTORE_RATIO,
                                auto_dk_mode, auto_restores, chunk_rows,
                                dense_prefix_rows, dense_rows, deterministic_default, prefix_applies)

triton_interpret_compat.apply()

LOG2E = 1.4426950408889634

# tuned on the H200 (see docs/performance.md, "Kernels"); overridable per call for the benchmark sweep
FWD_CONFIG = dict(BLOCK_N=64, V_SPLIT=1, num_warps=8, num_stages=2)
# DK, how dkv is formed.  "in_kernel": _bwd_kernel also forms the dk products per (query, head group) and adds them
# (the earlier backward, ONE_KERNEL_BWD_CONFIG, kept for the benchmark).  Otherwise _bwd_kernel recomputes p and ds
# per (query, head group), accumulates dq and writes p and ds in the input dtype, and then per query chunk:
# "slots": _dkv_kernel contracts all heads per (query, DK_BLOCK_S slots) and adds the rows into dkv -- half the fp32
# atomics, M = DK_BLOCK_S (wgmma) products; "dense": p and ds are scattered into zeroed [key, query x head]
# matrices and two GEMMs give dkv -- no atomics, but every key of the chunk's range is multiplied, selected or not;
# "auto": dense where it is cheaper (_dk_mode).  SKIP_PAD: stop each query's loop after its last used slot.
# H_SPLIT 1: all 64 heads in one program, M = 64 (wgmma) products; it fits in shared memory now that the dk
# products left the kernel (213 KB at BLOCK_N 64, one stage)
BWD_CONFIG = dict(BLOCK_N=64, H_SPLIT=1, num_warps=8, num_stages=1, DK="auto", SKIP_PAD=True,
                  DK_BLOCK_S=128, DK_BLOCK_C=64, DK_num_warps=8, DK_num_stages=2,
                  DENSE_DKV="auto", DENSE_DQ=True, DENSE_ROWS=None, DENSE_BLOCK_K=128, DENSE_BLOCK_C=128,
                  DENSE_BLOCK_J=64, DENSE_SPLIT=2, DENSE_num_warps=8, DENSE_num_stages=3, ZERO_AHEAD=True,
                  ZEROS="auto", DENSE_PREFIX=DENSE_PREFIX_DEFAULT, DENSE_PIECE_ROWS=None)
# DENSE_DKV: "auto" -- cuBLAS over the host-known key ends when the indexer left its row bounds, else the Triton
# _dense_dkv_kernel; "triton" -- always the kernel.  DENSE_DQ: with cuBLAS's dkv, dq too is one cuBLAS GEMM per
# chunk on the dense ds (dense_dq_mm; kernel 1 then has no dq products), False: dq in kernel 1.  DENSE_ROWS: at
# most this many query rows per chunk (None: as many as PDS_BUFFER_BYTES holds).  DENSE_*: the kernel's block shape.
# ZERO_AHEAD (cuBLAS products on a GPU, two chunks or more): two chunk buffers, the next chunk's zeroed on a side
# stream while this one's kernel and GEMMs run (DensePlan), instead of a memset between them.  ZEROS (the same
# plans): "memset" -- each chunk's matrices zeroed before its kernel (ZERO_AHEAD's way); "restore" -- one buffer per
# (device, dtype, stream) kept zero between backwards: after a chunk's GEMMs, _restore_zeros_kernel zeroes only the
# entries its kernel wrote (the selected keys' rows), so nothing is zeroed that was not written (DensePlan);
# "complement" (opt-in) -- each chunk's matrices zeroed only where the kernel will not write (_zero_unselected_kernel,
# from a byte map of the selected keys), so no entry is written twice; "auto" -- "restore" where n_keys / topk
# exceeds ZEROS_RESTORE_RATIO (the selected entries a small part of the matrices), else "memset".  The budgets (DET_BUFFER_BYTES, PDS_BUFFER_BYTES), DENSE_KEY_RATIO and
# ZEROS_RESTORE_RATIO live in ops/sparse_bwd_budget.py, which the memory planner reads too.  DENSE_PREFIX (read by
# our TileLang backward, dense_prefix_split): with the indexer's host row bounds and DK "auto", the dense formulation
# for the leading rows whose last key is below PREFIX_KEY_RATIO x topk and "slots" for the rest (dense_prefix_rows);
# "atomic": in atomic mode past DENSE_KEY_RATIO, True: both modes, any length, False: never (prefix_applies).
# DENSE_PIECE_ROWS (cuBLAS products, DensePlan): each chunk's products and memsets cut in pieces of this many query
# rows, each over the keys its rows may select (the host row bounds), so the causal triangle of a chunk's diagonal
# block is neither zeroed nor multiplied; None: one piece per chunk
# the earlier one-kernel backward with the block shape tuned for it
ONE_KERNEL_BWD_CONFIG = dict(BWD_CONFIG, BLOCK_N=32, H_SPLIT=2, num_warps=8, num_stages=2, DK="in_kernel",
                             SKIP_PAD=False)
# tried in order when a configuration needs more shared memory than the GPU has -- unless the caller's config set
# one of their keys (a block shape asked for is the one run)
BWD_FALLBACKS = (dict(BLOCK_N=32, H_SPLIT=4, num_warps=4, num_stages=1),
                 dict(BLOCK_N=16, H_SPLIT=4, num_warps=4, num_stages=1))
_FALLBACK_KEYS = frozenset(k for c in BWD_FALLBACKS for k in c)


def _block_h(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> int:
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"expected q [T, H, D] and kv [Tk, D], got {tuple(q.shape)} and {tuple(kv.shape)}")
    d_rope = q.shape[-1] - d_v
    for name, n in (("d_v", d_v), ("d_rope", d_rope)):
        if n <= 0 or n & (n - 1):
            raise ValueError(f"triton sparse_mla needs power-of-two {name} (got {n}); use --attn torch")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be [T={q.shape[0]}, topk], got {tuple(indices.shape)}")
    return d_rope


# ----------------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_selected(IDX_ROW, KV, stride_kvt, slot, topk, n_keys, offs_v, offs_r, DV: tl.constexpr):
    """The selected keys in top-k slots ``slot`` of one query (its index row IDX_ROW, -1 = unused): their
    positions, which are valid, and the latent [BLOCK_N, DV] and rope [BLOCK_N, DR] parts of their KV rows."""
    idx = tl.load(IDX_ROW + slot, mask=slot < topk, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < n_keys)
    rows = KV + tl.where(ok, idx, 0) * stride_kvt
    k_lat = tl.load(rows[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0)
    k_rope = tl.load(rows[:, None] + DV + offs_r[None, :], mask=ok[:, None], other=0.0)
    return idx, ok, k_lat, k_rope


@triton.jit
def _load_query(Q_ROW, stride_qh, offs_h, h_ok, offs_v, offs_r, DV: tl.constexpr):
    """One query token's heads ``offs_h`` (rows of invalid heads 0): latent [BLOCK_H, DV] and rope [BLOCK_H, DR]."""
    q_base = Q_ROW + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_v[None, :], mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_base + DV + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    return q_lat, q_rope


@triton.jit
def _scores(q_lat, q_rope, k_lat, k_rope, IEEE: tl.constexpr):
    """Absorbed MLA scores [BLOCK_H, BLOCK_N]: q . k over the latent and the rope columns, fp32 accumulation."""
    if IEEE:
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
    return s


@triton.jit
def _fwd_kernel(
    Q, KV, IDX, OUT, LSE, P,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_lt, stride_pt,
    n_heads, n_keys, topk, scale_log2,
    DV: tl.constexpr, DR: tl.constexpr, DVS: tl.constexpr, V_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HEAD_PROBS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    vs = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    offs_vs = vs * DVS + tl.arange(0, DVS)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < n_heads
    q_lat, q_rope = _load_query(Q + t * stride_qt, stride_qh, offs_h, h_ok, offs_v, offs_r, DV)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DVS], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        slot = n0 + offs_n
        idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys, offs_v, offs_r,
                                                DV)
        s = _scores(q_lat, q_rope, k_lat, k_rope, IEEE)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_SPLIT == 1:
            v = k_lat
        else:
            v = tl.load((KV + tl.where(ok, idx, 0) * stride_kvt)[:, None] + offs_vs[None, :], mask=ok[:, None],
                        other=0.0)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_vs[None, :], out.to(OUT.dtype.element_ty),
             mask=h_ok[:, None])
    if vs == 0:
        lse2 = m_i + tl.log2(tl.where(has, l_i, 1.0))
        lse = tl.where(has, lse2 / 1.4426950408889634, float("-inf"))
        tl.store(LSE + t * stride_lt + offs_h, lse, mask=h_ok)
        if HEAD_PROBS:
            # the indexer KL target: P[t, j] = sum_h softmax_j, now that each head's lse is known (a second pass
            # over the keys for the scores only; heads without keys and padded heads add 0)
            lse2 = tl.where(has & h_ok, lse2, float("inf"))
            for n0 in range(0, topk, BLOCK_N):
                slot = n0 + offs_n
                idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys,
                                                        offs_v, offs_r, DV)
                s = _scores(q_lat, q_rope, k_lat, k_rope, IEEE)
                p = tl.where(ok[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
                tl.store(P + t * stride_pt + slot, tl.sum(p, axis=0), mask=slot < topk)


def sparse_mla_fwd(q, kv, indices, softmax_scale: float, d_v: int, config: Optional[dict] = None,
                   out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                   head_probs: Optional[torch.Tensor] = None):
    """(out [T, h, d_v] in q's dtype, lse [T, h] fp32); out / lse may be given (contiguous, written in full).
    head_probs: a contiguous fp32 [T, topk] tensor the kernel fills with the indexer KL target's head sums
    (``triton_kl.head_summed_probs``'s result, computed here from the forward's own lse)."""
    d_rope = _check(q, kv, indices, d_v)
    cfg = dict(FWD_CONFIG, **(config or {}))
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    n_q, h, _ = q.shape
    out = torch.empty(n_q, h, d_v, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(n_q, h, dtype=torch.float32, device=q.device) if lse is None else lse
    if n_q == 0:
        return out, lse
    if head_probs is not None and (head_probs.shape != indices.shape or head_probs.dtype != torch.float32
                                   or not head_probs.is_contiguous()):
        raise ValueError(f"head_probs must be a contiguous fp32 [T, topk] = {tuple(indices.shape)} tensor")
    p_arg = lse if head_probs is None else head_probs  # an unused pointer without HEAD_PROBS
    v_split = cfg["V_SPLIT"] if d_v % cfg["V_SPLIT"] == 0 else 1
    _fwd_kernel[(n_q, v_split)](
        q, kv, indices, out, lse, p_arg,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        p_arg.stride(0), h, kv.shape[0], indices.shape[1], float(softmax_scale) * LOG2E,
        DV=d_v, DR=d_rope, DVS=d_v // v_split, V_SPLIT=v_split,
        BLOCK_H=_block_h(h), BLOCK_N=cfg["BLOCK_N"], IEEE=q.dtype == torch.float32, HEAD_PROBS=head_probs is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


# ----------------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ_PTR, DKV, BUF, PDS, ENDS, HS,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dot, stride_doh, stride_lt,
    t0, n_heads, n_keys, topk, scale, dense_cols, p_off, hs_group_stride,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, H_SPLIT: tl.constexpr,
    ATOMIC: tl.constexpr, IEEE: tl.constexpr, DK_MODE: tl.constexpr, HP: tl.constexpr, SKIP_PAD: tl.constexpr,
    HEAD_SUMS: tl.constexpr, DQ: tl.constexpr,
):
    """DK_MODE 0: the dk products per head group here, into dkv (ATOMIC) or BUF rows; 1 ("slots"): p and ds to the
    [query, slot, (ds | p), HP] buffer PDS for _dkv_kernel; 2 ("dense"): p and ds scattered into the zeroed
    [key, query, head] matrices PDS and PDS + p_off (row length dense_cols = queries x heads) for two GEMMs.
    HEAD_SUMS: also the indexer KL target, sum over this program's heads of the normalised p per (query, slot),
    fp32, to HS[head group, query, slot] (group stride hs_group_stride); every slot is written (0: unused).
    DQ: accumulate dq = ds k here and write it (False: only with DK_MODE 2, dq is a GEMM on the dense ds)."""
    tl_ = tl.program_id(0).to(tl.int64)  # row inside this launch's query range
    hg = tl.program_id(1)  # head group: heads are independent, each group adds its own dkv partial sum
    t = t0 + tl_
    D: tl.constexpr = DV + DR
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < n_heads
    q_lat, q_rope = _load_query(Q + t * stride_qt, stride_qh, offs_h, h_ok, offs_v, offs_r, DV)
    do = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_v[None, :], mask=h_ok[:, None], other=0.0)
    lse = tl.load(LSE + t * stride_lt + offs_h, mask=h_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # no keys: p = 0
    delta = tl.load(DELTA + t * stride_lt + offs_h, mask=h_ok, other=0.0)

    dq_lat = tl.zeros([BLOCK_H, DV], tl.float32)
    dq_rope = tl.zeros([BLOCK_H, DR], tl.float32)
    # SKIP_PAD: stop after the query's last used slot (ENDS; the -1 padding of early tokens is at the end)
    n_end = tl.load(ENDS + t) if SKIP_PAD else topk
    for n0 in range(0, n_end, BLOCK_N):
        slot = n0 + offs_n
        idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys, offs_v, offs_r,
                                                DV)
        s = _scores(q_lat, q_rope, k_lat, k_rope, IEEE)
        dp = _mma(do, tl.trans(k_lat), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE)
        p = tl.exp2(s * (scale * 1.4426950408889634) - lse[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        if HEAD_SUMS:
            tl.store(HS + hg * hs_group_stride + t * topk + slot, tl.sum(p, axis=0), mask=slot < topk)
        ds = p * (dp - delta[:, None]) * scale
        ds_c = ds.to(k_lat.dtype)
        p_c = p.to(k_lat.dtype)
        if DQ:
            dq_lat = _mma(ds_c, k_lat, dq_lat, IEEE)
            dq_rope = _mma(ds_c, k_rope, dq_rope, IEEE)
        if DK_MODE == 1:
            # p and ds go to the chunk's [query, slot, (ds | p), HP heads] buffer; _dkv_kernel contracts the heads
            pds = PDS + (tl_ * topk + slot)[None, :] * (2 * HP) + offs_h[:, None]
            s_ok = slot < topk
            tl.store(pds, ds_c, mask=s_ok[None, :])
            tl.store(pds + HP, p_c, mask=s_ok[None, :])
        elif DK_MODE == 2:
            # a query's keys are distinct: each (key, query, head) entry is written once, the rest stays 0
            pds = PDS + tl.where(ok, idx, 0)[None, :] * dense_cols + tl_ * n_heads + offs_h[:, None]
            m = ok[None, :] & h_ok[:, None]
            tl.store(pds, ds_c, mask=m)
            tl.store(pds + p_off, p_c, mask=m)
        else:
            dk_lat = _mma(tl.trans(ds_c), q_lat, tl.zeros([BLOCK_N, DV], tl.float32), IEEE)
            dk_lat = _mma(tl.trans(p_c), do, dk_lat, IEEE)
            dk_rope = _mma(tl.trans(ds_c), q_rope, tl.zeros([BLOCK_N, DR], tl.float32), IEEE)
            if ATOMIC:
                drow = DKV + tl.where(ok, idx, 0) * D
                tl.atomic_add(drow[:, None] + offs_v[None, :], dk_lat, mask=ok[:, None], sem="relaxed")
                tl.atomic_add(drow[:, None] + DV + offs_r[None, :], dk_rope, mask=ok[:, None], sem="relaxed")
            else:
                brow = BUF + ((tl_ * H_SPLIT + hg) * topk + slot) * D
                s_ok = slot < topk
                tl.store(brow[:, None] + offs_v[None, :], dk_lat, mask=s_ok[:, None])
                tl.store(brow[:, None] + DV + offs_r[None, :], dk_rope, mask=s_ok[:, None])

    if HEAD_SUMS:
        # the slots after the last used block (SKIP_PAD) were not visited: their head sums are 0
        for n0 in range(tl.cdiv(n_end, BLOCK_N) * BLOCK_N, topk, BLOCK_N):
            slot = n0 + offs_n
            tl.store(HS + hg * hs_group_stride + t * topk + slot, tl.zeros([BLOCK_N], tl.float32), mask=slot < topk)
    if DQ:
        dq_base = DQ_PTR + t * stride_qt + offs_h[:, None] * stride_qh
        tl.store(dq_base + offs_v[None, :], dq_lat.to(DQ_PTR.dtype.element_ty), mask=h_ok[:, None])
        tl.store(dq_base + DV + offs_r[None, :], dq_rope.to(DQ_PTR.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dkv_kernel(
    Q, DO, IDX, PDS, DKV, BUF,
    stride_qt, stride_qh, stride_it, stride_dot, stride_doh,
    t0, n_heads, n_keys, topk,
    DV: tl.constexpr, DR: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ATOMIC: tl.constexpr, IEEE: tl.constexpr,
):
    """The dkv contributions of one query and BLOCK_S of its top-k slots, all heads contracted in one product:
    dK[slot] = dS^T Q (+ P^T dO on the latent part), M = BLOCK_S slots, K = HP heads, N = D in BLOCK_C columns at
    a time.  Added into dkv (ATOMIC) or stored as the chunk's (query, slot) rows for the segmented reduction."""
    tl_ = tl.program_id(0).to(tl.int64)
    t = t0 + tl_
    D: tl.constexpr = DV + DR
    slot = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = slot < topk
    idx = tl.load(IDX + t * stride_it + slot, mask=s_ok, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < n_keys)
    if tl.max(ok.to(tl.int32), axis=0) == 0:  # only unused slots (early tokens' -1 padding): nothing to add
        return
    offs_hh = tl.arange(0, HP)
    h_ok = offs_hh < n_heads
    pds = PDS + (tl_ * topk + slot)[:, None] * (2 * HP) + offs_hh[None, :]
    ds_t = tl.load(pds, mask=s_ok[:, None], other=0.0)  # [BLOCK_S, HP]
    p_t = tl.load(pds + HP, mask=s_ok[:, None], other=0.0)
    q_row = Q + t * stride_qt + offs_hh[:, None] * stride_qh
    do_row = DO + t * stride_dot + offs_hh[:, None] * stride_doh
    if ATOMIC:
        out_row = DKV + tl.where(ok, idx, 0) * D
        o_ok = ok
    else:
        out_row = BUF + (tl_ * topk + slot) * D
        o_ok = s_ok
    offs_c = tl.arange(0, BLOCK_C)
    for c0 in range(0, DV, BLOCK_C):
        qc = tl.load(q_row + c0 + offs_c[None, :], mask=h_ok[:, None], other=0.0)
        doc = tl.load(do_row + c0 + offs_c[None, :], mask=h_ok[:, None], other=0.0)
        acc = _mma(ds_t, qc, tl.zeros([BLOCK_S, BLOCK_C], tl.float32), IEEE)
        acc = _mma(p_t, doc, acc, IEEE)
        ptr = out_row[:, None] + c0 + offs_c[None, :]
        if ATOMIC:
            tl.atomic_add(ptr, acc, mask=o_ok[:, None], sem="relaxed")
        else:
            tl.store(ptr, acc, mask=o_ok[:, None])
    offs_r = tl.arange(0, DR)
    qr = tl.load(q_row + DV + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    acc = _mma(ds_t, qr, tl.zeros([BLOCK_S, DR], tl.float32), IEEE)
    ptr = out_row[:, None] + DV + offs_r[None, :]
    if ATOMIC:
        tl.atomic_add(ptr, acc, mask=o_ok[:, None], sem="relaxed")
    else:
        tl.store(ptr, acc, mask=o_ok[:, None])


@triton.jit
def _segment_sum_kernel(BUF, PERM, BOUNDS, DKV, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dkv[key] += sum of the key's buffer rows PERM[BOUNDS[key]:BOUNDS[key + 1]], in sorted order (deterministic)."""
    key = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    start = tl.load(BOUNDS + key)
    length = tl.load(BOUNDS + key + 1) - start
    if length > 0:
        acc = tl.zeros([BLOCK_D], tl.float32)
        offs_r = tl.arange(0, BLOCK_R)
        for r0 in range(0, length, BLOCK_R):
            r_ok = r0 + offs_r < length
            src = tl.load(PERM + start + r0 + offs_r, mask=r_ok, other=0)
            vals = tl.load(BUF + src[:, None] * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(vals, axis=0)
        ptr = DKV + key * D + offs_d
        tl.store(ptr, tl.load(ptr, mask=d_ok, other=0.0) + acc, mask=d_ok)


@triton.jit
def _dense_dkv_kernel(
    PDS, Q, DO, DKV, PART, KEY_END, chunk, n_cols, p_off, row0, n_keys,
    D: tl.constexpr, DV: tl.constexpr, C0: tl.constexpr, WIDTH: tl.constexpr, TWO: tl.constexpr,
    CLEAN: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One query chunk's dense dkv product for keys [k0, k0 + BLOCK_K) and dkv columns C0 + [c0, c0 + BLOCK_C)
    (this launch covers WIDTH columns from C0): dS^T Q (+ P^T dO with TWO: the latent columns) over the chunk's
    n_cols (query, head) pairs, from the zero-filled [key, n_cols] matrices PDS (dS) and PDS + p_off (P) that
    _bwd_kernel scattered; Q and dO rows row0 + j.  The chunk's key end KEY_END[chunk] is read on the device: key
    blocks at or past it do no products (the grid is the host-known key count, so no host synchronisation).
    SPLIT 1: added into DKV.  SPLIT > 1: the (query, head) range is cut in SPLIT parts, part sp's sum stored to
    PART[sp] ([SPLIT, n_keys, WIDTH], zeros past the key end) and the parts summed in order afterwards.
    CLEAN: zero the dS and P tiles once read (each tile is read by exactly one program of such a launch), so the
    buffer is all zeros again for the next chunk without a memset of the whole of it."""
    kb = tl.program_id(0)
    cb = tl.program_id(1)
    sp = tl.program_id(2)
    key_end = tl.load(KEY_END + chunk)
    k0 = kb * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_K, BLOCK_C], tl.float32)
    if k0 < key_end:
        k_ok = offs_k < key_end
        per = tl.cdiv(tl.cdiv(n_cols, SPLIT), BLOCK_J) * BLOCK_J
        j_lo = sp * per
        j_hi = tl.minimum(j_lo + per, n_cols)
        offs_j = tl.arange(0, BLOCK_J)
        rows = offs_k.to(tl.int64)[:, None] * n_cols
        for j0 in range(j_lo, j_hi, BLOCK_J):
            j = j0 + offs_j
            j_ok = j < j_hi
            m = k_ok[:, None] & j_ok[None, :]
            src = (row0 + j.to(tl.int64))[:, None]
            a = tl.load(PDS + rows + j[None, :], mask=m, other=0.0)
            b = tl.load(Q + src * D + C0 + offs_c[None, :], mask=j_ok[:, None], other=0.0)
            acc = _mma(a, b, acc, IEEE)
            if TWO:
                a2 = tl.load(PDS + p_off + rows + j[None, :], mask=m, other=0.0)
                b2 = tl.load(DO + src * DV + C0 + offs_c[None, :], mask=j_ok[:, None], other=0.0)
                acc = _mma(a2, b2, acc, IEEE)
            if CLEAN:
                tl.store(PDS + rows + j[None, :], tl.zeros_like(a), mask=m)
                tl.store(PDS + p_off + rows + j[None, :], tl.zeros_like(a), mask=m)
    k_in = offs_k < n_keys
    if SPLIT == 1:
        if k0 < key_end:
            ptr = DKV + offs_k.to(tl.int64)[:, None] * D + C0 + offs_c[None, :]
            tl.store(ptr, tl.load(ptr, mask=k_in[:, None], other=0.0) + acc, mask=k_in[:, None])
    else:
        ptr = PART + (sp * n_keys + offs_k.to(tl.int64))[:, None] * WIDTH + offs_c[None, :]
        tl.store(ptr, acc, mask=k_in[:, None])


@triton.jit
def _delta_bwd_kernel(O, DO, DLSE, DELTA, n_rows, DV: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Delta[r] = sum_c O[r, c] dO[r, c] (- d_lse[r]) for BLOCK_R rows r = (query, head) of contiguous [rows, DV]
    O / dO in their own dtype, fp32 products and sum (no fp32 copies of O and dO)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    offs = r[:, None] * DV + tl.arange(0, DV)[None, :]
    o = tl.load(O + offs, mask=r_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=r_ok[:, None], other=0.0).to(tl.float32)
    d = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        d -= tl.load(DLSE + r, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + r, d, mask=r_ok)


def bwd_delta(out: torch.Tensor, d_out: torch.Tensor, d_lse: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 [T, h]: rowsum(dO * O) - d_lse, the softmax backward's per-row term (one small kernel)."""
    n_q, h, d_v = out.shape
    out = out.contiguous()
    delta = torch.empty(n_q, h, dtype=torch.float32, device=out.device)
    if n_q * h == 0:
        return delta
    dl = d_lse.contiguous() if d_lse is not None else delta  # an unused pointer without d_lse
    block_r = max(1, min(16, 4096 // d_v))  # 8 rows of 512: 64 fp32 registers per thread and operand
    _delta_bwd_kernel[(triton.cdiv(n_q * h, block_r),)](out, d_out, dl, delta, n_q * h, DV=d_v, BLOCK_R=block_r,
                                                     HAS_DLSE=d_lse is not None, num_warps=4)
    return delta


def _segment_reduce_into(dkv: torch.Tensor, buf: torch.Tensor, idx_chunk: torch.Tensor, h_split: int) -> None:
    """buf rows are ordered (query, head group, slot); idx_chunk [n, K] gives each row's key.  The rows are stably
    sorted by key and each key's run is found by a binary search over all n_keys keys (no host synchronisation:
    the grid is the host-known key count, keys without rows exit at once)."""
    n_keys, d = dkv.shape
    flat = idx_chunk.unsqueeze(1).expand(-1, h_split, -1).reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < n_keys), flat, torch.full_like(flat, n_keys))
    keys_sorted, perm = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(keys_sorted, torch.arange(n_keys + 1, device=flat.device))
    block_d = 128 if d >= 128 else triton.next_power_of_2(d)
    _segment_sum_kernel[(n_keys, triton.cdiv(d, block_d))](
        buf, perm, bounds, dkv, d, BLOCK_R=16, BLOCK_D=block_d, num_warps=4,
    )


@triton.jit
def _slot_ends_kernel(IDX, OUT, n_rows, topk, stride, n_keys, step, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[t] = ceil(e / step), e one past row t's last used slot (0 without one): one read of the list."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < n_rows
    last = tl.zeros([BLOCK_T], dtype=tl.int32)
    for k0 in range(0, topk, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = live[:, None] & (cols < topk)[None, :]
        idx = tl.load(IDX + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=m, other=-1)
        used = (idx >= 0) & (idx < n_keys)
        last = tl.maximum(last, tl.max(tl.where(used, cols[None, :] + 1, 0), axis=1))
    tl.store(OUT + rows, (last + step - 1) // step, mask=live)


def used_slot_ends(indices: torch.Tensor, n_keys: int, step: int = 1) -> torch.Tensor:
    """int32 [T]: one past each query's last used top-k slot (0 for a query without keys), in units of ``step``
    slots rounded up (step 1: slots).  On a GPU (or under Triton's interpreter) one kernel that reads the list once
    (_slot_ends_kernel: 4 bytes per slot), where the torch form below moves about 19 bytes per slot in eight kernels
    (counted, not timed) -- at S 32768 and top-k 2048 about 1.3 GB per call, and the TileLang backward, the bounded
    forward and the indexer KL's padding skip each call it per layer."""
    if indices.dim() != 2 or step < 1:
        raise ValueError(f"used_slot_ends: indices [T, topk] and step >= 1, got {tuple(indices.shape)} / {step}")
    n_q, k = indices.shape
    if triton_interpret_compat.runs_kernels(indices):
        out = torch.empty(n_q, dtype=torch.int32, device=indices.device)
        if n_q:
            idx = indices if indices.stride(1) == 1 else indices.contiguous()
            block_t = 8
            _slot_ends_kernel[(triton.cdiv(n_q, block_t),)](
                idx, out, n_q, k, idx.stride(0), n_keys, step, BLOCK_T=block_t,
                BLOCK_K=min(512, max(16, triton.next_power_of_2(max(k, 1)))), num_warps=4)
        return out
    return slot_ends_torch(indices, n_keys, step)


def slot_ends_torch(indices: torch.Tensor, n_keys: int, step: int = 1) -> torch.Tensor:
    """used_slot_ends in torch ops (the CPU's form; the GPU's before session 21, which benchmarks/dsa_kernels.py
    times against the kernel)."""
    used = (indices >= 0) & (indices < n_keys)
    last = indices.shape[1] - used.flip(-1).to(torch.int8).argmax(-1)
    ends = torch.where(used.any(-1), last, 0)
    return ((ends + (step - 1)) // step).to(torch.int32).contiguous()


def _dense_rows(n_q: int, n_keys: int, h: int, elt: int, cfg: dict) -> int:
    """Query rows per chunk of the "dense" formulation (sparse_bwd_budget.dense_rows with this module's
    PDS_BUFFER_BYTES and the config's DENSE_ROWS)."""
    return dense_rows(n_q, n_keys, h, elt, PDS_BUFFER_BYTES, cfg.get("DENSE_ROWS"))


_chunk_rows = chunk_rows


def _dense_piece_products(dkv, dq, ds, p, pieces, qc, doc, kv, d_v, h, with_dq: bool) -> None:
    """One query chunk's cuBLAS products from the [kc, n * h] dS and P matrices that kernel 1 scattered, cut in
    ``pieces`` (row r0..r1 of the chunk, e: one past the largest key a row of it or of an earlier piece may select;
    non-decreasing): dkv[lo:e] += dS^T Q + (P^T dO on the latent part) over the columns of the rows that may select
    keys in [lo, e) -- this piece's and the later ones' (the earlier pieces' keys all lie below lo) -- and, with_dq,
    dq of the piece's rows = dS^T kv over its keys [0, e).  fp32 results; one piece is the whole chunk."""
    lo = 0
    for r0, r1, e in pieces:
        c0, c1 = r0 * h, r1 * h
        if e > lo:
            mm_fp32_add_(dkv[lo:e], ds[lo:e, c0:], qc[c0:])
            mm_fp32_add_(dkv[lo:e, :d_v], p[lo:e, c0:], doc[c0:])
            lo = e
        if with_dq:
            dense_dq_mm(dq[r0:r1].view((r1 - r0) * h, -1), ds[:e, c0:c1], kv)


@triton.jit
def _restore_zeros_kernel(IDX, PDS, stride_it, t0, kc, topk, dense_cols, p_off, n_heads,
                          BLOCK_S: tl.constexpr, HP: tl.constexpr):
    """Zero chunk row r's entries of the [kc, rows x heads] dS and P matrices (P at p_off) at its selected keys:
    exactly where the backward's kernel scattered them (the keys are distinct per row; -1 and keys >= kc skipped)."""
    r = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    idx = tl.load(IDX + (t0 + r) * stride_it + slot, mask=slot < topk, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < kc)
    offs_h = tl.arange(0, HP)
    ptr = PDS + tl.where(ok, idx, 0)[:, None] * dense_cols + r * n_heads + offs_h[None, :]
    m = ok[:, None] & (offs_h < n_heads)[None, :]
    zero = tl.zeros([BLOCK_S, HP], PDS.dtype.element_ty)
    tl.store(ptr, zero, mask=m)
    tl.store(ptr + p_off, zero, mask=m)


@triton.jit
def _zero_unselected_kernel(SEL, PDS, stride_sel, k_lo, k_hi, r_lo, n_rows, dense_cols, p_off, n_heads,
                            BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, HP: tl.constexpr):
    """Zero the dS and P entries (P at p_off) of keys [k_lo, k_hi) x chunk rows [r_lo, n_rows) that the row did not
    select (SEL[row, key] == 0): of the entries the products read, those the backward's kernel does not write."""
    keys = k_lo + tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = r_lo + tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = (keys < k_hi)[:, None] & (rows < n_rows)[None, :]
    sel = tl.load(SEL + rows[None, :].to(tl.int64) * stride_sel + keys[:, None], mask=inside, other=1)
    heads = tl.arange(0, HP)
    m = (inside & (sel == 0))[:, :, None] & (heads < n_heads)[None, None, :]
    ptr = PDS + keys[:, None, None].to(tl.int64) * dense_cols + (rows * n_heads)[None, :, None] + heads[None, None, :]
    zero = tl.zeros([BLOCK_K, BLOCK_R, HP], PDS.dtype.element_ty)
    tl.store(ptr, zero, mask=m)
    tl.store(ptr + p_off, zero, mask=m)


class _KeptZero:
    """The buffers that ZEROS "restore" keeps all-zero between backwards: one per (device, dtype, stream), grown
    (a fresh torch.zeros) when a plan needs more, never shrunk; ``dirty`` while a plan's kernel may have written
    entries that its restore has not zeroed yet -- a plan that failed in between (an exception on the host) leaves it
    set, and the next plan zeroes the whole buffer first."""

    def __init__(self):
        self.buffers: dict = {}  # (device, dtype, stream) -> [tensor, dirty]

    def take(self, size: int, dtype: torch.dtype, device) -> list:
        device = torch.device(device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), dtype, stream)
        entry = self.buffers.get(key)
        if entry is None or entry[0].numel() < size:
            self.buffers.pop(key, None)  # the old one freed before the larger one is allocated
            entry = self.buffers[key] = [torch.zeros(size, dtype=dtype, device=device), False]
        elif entry[1]:
            entry[0].zero_()
            entry[1] = False
        return entry

    def release(self) -> None:
        self.buffers.clear()


_kept_zero = _KeptZero()


def release_kept_zero_buffers() -> None:
    """Free the buffers that BWD_CONFIG ZEROS "restore" keeps between backwards (the next backward allocates
    again)."""
    _kept_zero.release()


class DensePlan:
    """The "dense" formulation with host-known key ends: query chunks of ``rows`` (chunk i starts at starts[i],
    its keys all below key_ends[i]) and the buffers for the [key, query x head] dS and P matrices of a chunk (P at
    p_off of a buffer).  ``views(i)``, called for i = 0, 1, ... in order: chunk i's (t0, n, kc, ds, p), ds / p
    [kc, n * h] zero at every entry a product reads that the kernel will not write (and, but with "complement", at
    those it will); ``products(...)``: its cuBLAS GEMMs.
    The Triton backward's kernel 1 and the tilelang backend's scores kernel both fill it.

    ``pieces`` (per chunk, from _host_pieces; BWD_CONFIG DENSE_PIECE_ROWS): the chunk's rows cut in pieces, each
    with its own key end.  Rows of an early piece select no key past its end, so the products skip the
    [key, column] blocks above them (the causal triangle of the chunk's diagonal block, which one product over
    every key below the chunk's key end multiplies as zeros) and the memsets zero only what is read: for each piece
    the keys from the previous piece's end to its own, in the columns of its rows and the later ones'.  One piece
    per chunk (the default) is the whole [kc, n * h] matrix, as before.

    ``zero_ahead`` (CUDA, two chunks or more): two buffers; chunk i + 1's is zeroed on a side stream once the
    work issued before views(i) (chunk i - 1's GEMMs, its last reader) is done, so the memset overlaps chunk i's
    kernel and GEMMs; views(i) makes the current stream wait for chunk i's zeroing.  Every side-stream memset is
    waited for by the current stream before the buffers' next use and before the plan's end, so the caching
    allocator may hand the buffers on as usual.  Without it: one buffer, zeroed in stream order.

    ``zeros`` (BWD_CONFIG ZEROS, "auto" resolved; ``indices``: the top-k list, for "restore" and "complement"):
    "memset" zeroes as above. "complement": where the memsets would zero a block, only its entries at keys the row
    did not select are zeroed (``_zero_unselected_kernel``, from a [rows, key end + 1] byte map of the selected keys
    built per chunk on the device; one map per chunk buffer, so the side stream's map of chunk i + 1 never
    overwrites chunk i's) -- the kernel writes the rest, so no entry is written twice.

    "restore": one buffer kept zero between backwards (``_KeptZero``, per device, dtype and stream); views(i) zeroes
    nothing, and products(...) ends chunk i by zeroing the entries at its rows' selected keys again
    (``_restore_zeros_kernel``, in stream order after the GEMMs that read them) -- the written entries only, not the
    whole matrices."""

    def __init__(self, n_q: int, h: int, rows: int, pieces: list, dtype: torch.dtype, device,
                 zero_ahead: bool = False, zeros: str = "memset", indices: Optional[torch.Tensor] = None):
        if zeros not in ("memset", "restore", "complement") or (zeros != "memset" and indices is None):
            raise ValueError(f"DensePlan: zeros {zeros!r} (memset; restore / complement with the top-k list)")
        self.n_q, self.h, self.rows, self.pieces = n_q, h, rows, pieces
        self.key_ends = [p[-1][2] for p in pieces]
        self.starts = list(range(0, n_q, rows))
        self.p_off = max(self.key_ends, default=0) * rows * h
        self.zeros, self.indices = zeros, indices
        self.ahead = (zeros != "restore" and bool(zero_ahead) and torch.device(device).type == "cuda"
                      and len(self.starts) > 1)
        size = max(1, 2 * self.p_off)
        if zeros == "restore":
            self._kept = _kept_zero.take(size, dtype, device)
            self.buffers = [self._kept[0]]
        else:
            self.buffers = [_chunk_buffer(size, dtype, device) for _ in range(2 if self.ahead else 1)]
        self._side = torch.cuda.Stream(device) if self.ahead else None
        self._zeroed = {}  # chunk -> the side stream's event after zeroing it
        # ZEROS "complement": per chunk buffer, the [rows, key end + 1] byte map of the selected keys
        self._maps = ([torch.empty(rows * (max(self.key_ends, default=0) + 1), dtype=torch.uint8, device=device)
                       for _ in self.buffers] if zeros == "complement" else None)

    def buffer(self, i: int) -> torch.Tensor:
        """Chunk i's buffer (dS at 0, P at p_off)."""
        return self.buffers[i % len(self.buffers)]

    def _region(self, i: int):
        """(ds, p) of chunk i: its [kc, n * h] matrices."""
        t0, kc = self.starts[i], self.key_ends[i]
        cols = min(self.rows, self.n_q - t0) * self.h
        buf = self.buffer(i)
        return buf[:kc * cols].view(kc, cols), buf[self.p_off:self.p_off + kc * cols].view(kc, cols)

    def _zero(self, i: int) -> None:
        """Zero what chunk i's products read and its kernel does not write: per piece, the keys from the previous
        piece's end to its own in the columns of its rows and the later ones' (one piece: both whole matrices) --
        all of it, or (ZEROS "complement") the entries of keys the row did not select."""
        sel = self._selected_map(i) if self._maps is not None else None
        mats = self._region(i)
        lo = 0
        for r0, _, e in self.pieces[i]:
            if e > lo:
                if sel is None:
                    for m in mats:
                        _zero_block_(m[lo:e, r0 * self.h:])
                else:
                    self._zero_unselected(i, sel, lo, e, r0)
                lo = e

    def _selected_map(self, i: int) -> torch.Tensor:
        """Chunk i's [n, kc + 1] uint8 map: 1 where row r selected key k (unused slots and keys past kc land in
        the last column); built on the device, no host synchronisation."""
        t0, kc = self.starts[i], self.key_ends[i]
        n = min(self.rows, self.n_q - t0)
        sel = self._maps[i % len(self._maps)][:n * (kc + 1)].view(n, kc + 1)
        sel.zero_()
        idx = self.indices[t0:t0 + n].long()
        sel.scatter_(1, torch.where((idx >= 0) & (idx < kc), idx, kc), 1)
        return sel

    def _zero_unselected(self, i: int, sel: torch.Tensor, lo: int, e: int, r0: int) -> None:
        """Zero keys [lo, e) x chunk rows [r0, n) of chunk i's matrices where the row did not select the key."""
        n = sel.shape[0]
        block_k, block_r = 16, 8
        _zero_unselected_kernel[(triton.cdiv(e - lo, block_k), triton.cdiv(n - r0, block_r))](
            sel, self.buffer(i), sel.stride(0), lo, e, r0, n, n * self.h, self.p_off, self.h,
            BLOCK_K=block_k, BLOCK_R=block_r, HP=max(16, triton.next_power_of_2(self.h)), num_warps=4)

    def views(self, i: int):
        t0, kc = self.starts[i], self.key_ends[i]
        n = min(self.rows, self.n_q - t0)
        if self.zeros == "restore":  # kept zero: the kernel may now write entries not yet restored
            self._kept[1] = True
        elif self.ahead:
            main = torch.cuda.current_stream(self.buffer(i).device)
            if i + 1 < len(self.starts):  # the next chunk's buffer: chunk i - 1's, whose GEMMs are issued
                done = main.record_event()
                with torch.cuda.stream(self._side):
                    self._side.wait_event(done)
                    self._zero(i + 1)
                    self._zeroed[i + 1] = self._side.record_event()
            zeroed = self._zeroed.pop(i, None)
            if zeroed is None:  # chunk 0 (or a restarted pass): in stream order
                self._zero(i)
            else:
                main.wait_event(zeroed)
        else:
            self._zero(i)
        ds, p = self._region(i)
        return t0, n, kc, ds, p

    def chunks(self):
        return (self.views(i) for i in range(len(self.starts)))

    def products(self, dkv, dq, kc, n, t0, q, d_out, kv, d_v, with_dq: bool = True):
        """dkv[:kc] += dS^T Q + P^T dO (latent part) and, with_dq, dq of the chunk's rows = dS kv, piece by piece
        (_dense_piece_products)."""
        i = t0 // self.rows
        ds, p = self._region(i)
        h = self.h
        _dense_piece_products(dkv, dq[t0:t0 + n] if with_dq else None, ds, p, self.pieces[i],
                              q[t0:t0 + n].reshape(n * h, -1), d_out[t0:t0 + n].reshape(n * h, -1), kv, d_v, h,
                              with_dq)
        if self.zeros == "restore":
            self._restore(self.buffer(i), kc, n, t0)

    def _restore(self, buf, kc: int, n: int, t0: int) -> None:
        """Zero again the entries chunk (t0, n)'s kernel wrote: at each row's selected keys below kc."""
        topk = self.indices.shape[1]
        if kc > 0 and topk > 0:
            block_s = min(64, max(16, triton.next_power_of_2(topk)))
            _restore_zeros_kernel[(n, triton.cdiv(topk, block_s))](
                self.indices, buf, self.indices.stride(0), t0, kc, topk, n * self.h, self.p_off, self.h,
                BLOCK_S=block_s, HP=max(16, triton.next_power_of_2(self.h)), num_warps=4)
        if t0 + n >= self.n_q:  # the plan's last chunk: the buffer is all zero again
            self._kept[1] = False


def _zero_block_(m: torch.Tensor) -> None:
    """Zero a 2-D block of a row-major matrix.  A block narrower than its rows (a piece's columns) is no contiguous
    tensor, so torch's fill would store it element by element (2 bytes each); viewed as 16-byte elements where its
    width, start and row stride are multiples of 16 bytes (64 heads: always) it is stored 16 bytes at a time.  A
    contiguous block is zeroed as is."""
    b = m.element_size()
    if (not m.is_contiguous() and m.dim() == 2 and m.stride(1) == 1 and (m.shape[1] * b) % 16 == 0
            and (m.stride(0) * b) % 16 == 0 and (m.storage_offset() * b) % 16 == 0):
        m = m.view(torch.complex128)
    m.zero_()


def _chunk_buffer(size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A dense plan's chunk buffer, uninitialised (each chunk zeroes what it uses; the tests fill it with NaN)."""
    return torch.empty(size, dtype=dtype, device=device)


def dense_plan(q, kv, indices, deterministic: Optional[bool] = None, config: Optional[dict] = None,
               row_hi: Optional[torch.Tensor] = None) -> Optional[DensePlan]:
    """The DensePlan of this backward when it takes the dense formulation with cuBLAS products (BWD_CONFIG's DK
    "auto" rule or "dense", DENSE_DKV "auto", and the indexer's host row bounds of ``indices`` known: row_hi, or
    looked up), else None."""
    cfg = dict(BWD_CONFIG, **(config or {}))
    row_hi = host_windows.row_ends(indices) if row_hi is None else row_hi
    det = deterministic_default() if deterministic is None else bool(deterministic)
    n_q, h = q.shape[0], q.shape[1]
    n_keys, topk = kv.shape[0], indices.shape[1]
    if (row_hi is None or n_q == 0 or topk == 0 or cfg.get("DENSE_DKV", "auto") != "auto"
            or _dk_mode(cfg, n_keys, topk, det) != "dense"):
        return None
    rows = _dense_rows(n_q, n_keys, h, q.element_size(), cfg)
    piece_rows = cfg.get("DENSE_PIECE_ROWS")
    if piece_rows is not None and (isinstance(piece_rows, bool) or not isinstance(piece_rows, int)
                                   or piece_rows < 1):
        raise ValueError(f"triton sparse_mla_bwd: BWD_CONFIG DENSE_PIECE_ROWS must be a positive int or None, got "
                         f"{piece_rows!r}")
    pieces = _host_pieces(row_hi, rows, n_keys, min(piece_rows or rows, rows))
    zeros = cfg.get("ZEROS", "memset")
    if zeros not in ("memset", "restore", "complement", "auto"):
        raise ValueError(f"triton sparse_mla_bwd: unknown ZEROS {zeros!r} (memset, restore, complement, auto)")
    runs_kernels = triton_interpret_compat.runs_kernels(q)  # restore / complement: Triton kernels
    if zeros == "auto":
        zeros = "restore" if runs_kernels and auto_restores(n_keys, topk) else "memset"
    elif zeros in ("restore", "complement") and not runs_kernels:
        raise ValueError(f"triton sparse_mla_bwd: ZEROS {zeros!r} runs a Triton kernel: it needs a CUDA GPU (or "
                         f"Triton's interpreter, TRITON_INTERPRET=1)")
    return DensePlan(n_q, h, rows, pieces, q.dtype, q.device, zero_ahead=bool(cfg.get("ZERO_AHEAD", False)),
                     zeros=zeros, indices=indices.contiguous() if zeros != "memset" else None)


def dense_dq_mm(rows: torch.Tensor, ds: torch.Tensor, kv: torch.Tensor) -> None:
    """rows = ds^T kv: dq of a piece of query rows ([n * h, D], contiguous, written in full) from its columns of
    the [key, query x head] dS matrix that kernel 1 scattered (``ds`` [e, n * h], a view; the rows' keys all below
    e): one cuBLAS GEMM contracting the keys (fp32 accumulation, one rounding to dq's dtype), instead of the
    per-block ds k products inside kernel 1."""
    e = ds.shape[0]
    if e == 0:
        rows.zero_()
        return
    torch.mm(ds.t(), kv[:e], out=rows)


@functools.lru_cache(maxsize=None)
def _mm_has_out_dtype(dtype: torch.dtype) -> bool:
    """Whether this torch's torch.mm takes out_dtype=float32 for 16-bit CUDA operands (probed once per dtype on a
    16 x 16 product; a torch without it is said once in the log, and the slower fp32 copies are used)."""
    x = torch.ones(16, 16, dtype=dtype, device="cuda")
    try:
        torch.mm(x, x, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError) as e:
        warn_once("triton", f"torch.mm has no out_dtype=float32 for {dtype} here ({type(e).__name__}); the dense "
                  f"dkv products run on fp32 copies of their operands", "fp32 matmuls")
        return False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: bf16 / fp16 operands on a GPU through torch.mm's out_dtype (fp32 accumulation,
    no rounding of the product to 16 bits); fp32 copies otherwise."""
    if a.dtype != torch.float32 and a.is_cuda and _mm_has_out_dtype(a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.lru_cache(maxsize=None)
def _addmm_into_fp32(dtype: torch.dtype) -> bool:
    """Whether this torch's torch.addmm adds a 16-bit CUDA product into an fp32 matrix in place (out_dtype=float32,
    the fp32 matrix as input and out: cuBLAS's epilogue does the sum).  Probed once per dtype on a 16 x 16 product
    (no host synchronisation: an unsupported combination raises); torch builds whose addmm.dtype wants the input
    in the operands' dtype refuse it, and the sum then goes through an fp32 product (_mm_fp32), said once."""
    acc = torch.zeros(16, 16, dtype=torch.float32, device="cuda")
    x = torch.ones(16, 16, dtype=dtype, device="cuda")
    try:
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return True
    except (TypeError, RuntimeError) as e:
        warn_once("triton", f"torch.addmm does not add a {dtype} product into an fp32 matrix here "
                  f"({type(e).__name__}); the dense dkv sums write an fp32 product and add it", "fp32 addmm")
        return False


def mm_fp32_add_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 ``acc`` (a view of a larger matrix allowed) and 16-bit or fp32 operands: on a GPU
    one cuBLAS GEMM that adds into acc in its epilogue where torch allows it (no fp32 product in memory, no
    separate add kernel; the dense backward's dkv and the indexer KL's d_k_idx add one per query chunk), else
    acc += _mm_fp32(a, b).  An fp32 sum of an fp32-accumulated product either way; bitwise the same only where
    cuBLAS picks the same kernel for both (the GPU test allows fp32 rounding)."""
    if (a.is_cuda and a.dtype != torch.float32 and acc.dtype == torch.float32 and _mm_has_out_dtype(a.dtype)
            and _addmm_into_fp32(a.dtype)):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += _mm_fp32(a, b)


def _host_chunk_key_ends(row_hi: torch.Tensor, rows: int, n_keys: int) -> list:
    """Per query chunk of ``rows`` rows: one past the largest key its rows may select, from the indexer's host row
    bounds."""
    return [pieces[-1][2] for pieces in _host_pieces(row_hi, rows, n_keys, rows)]


def _host_pieces(row_hi: torch.Tensor, rows: int, n_keys: int, piece_rows: int) -> list:
    """Per query chunk (rows [t0, t0 + rows) for t0 in range(0, n_q, rows)): its rows cut in pieces of at most
    ``piece_rows``, [(r0, r1, e), ...] with r0, r1 relative to t0 and e one past the largest key that a row of the
    piece or of an earlier piece of the chunk may select (the indexer's host row bounds; a running maximum, so e never
    decreases and the last piece's e is the chunk's key end).  A fixed number of host tensor operations whatever
    the number of chunks (a backward at S 32768 plans up to hundreds)."""
    hi = row_hi.reshape(-1).to("cpu", torch.int64).clamp(-1, n_keys - 1)
    n_q = hi.numel()
    n_chunks, per_chunk = -(-n_q // rows), -(-rows // piece_rows)
    t = torch.arange(n_q)
    piece = (t // rows) * per_chunk + (t % rows) // piece_rows
    tops = torch.full((n_chunks * per_chunk,), -1, dtype=torch.int64).scatter_reduce_(0, piece, hi, "amax")
    tops = (torch.cummax(tops.view(n_chunks, per_chunk), 1).values + 1).tolist()
    out = []
    for c in range(n_chunks):
        n = min(rows, n_q - c * rows)
        out.append([(r0, min(n, r0 + piece_rows), tops[c][j]) for j, r0 in enumerate(range(0, n, piece_rows))])
    return out


def _dense_dkv(dkv, pds, p_off, key_ends, chunk, n, h, q, d_out, t0, d_v, cfg):
    """dkv[:key end] += dS^T Q + (P^T dO on the latent part) for one query chunk, from the [key, n * h] matrices
    that _bwd_kernel (DK_MODE 2) scattered into the zeroed buffer pds: _dense_dkv_kernel, launched over all n_keys
    (host-known) with the chunk's key end read on the device, once for the latent columns (both products) and once
    for the rope columns (dS^T Q alone; it also zeroes the tiles, leaving pds zero for the next chunk)."""
    n_keys, d = dkv.shape
    split, block_k = int(cfg["DENSE_SPLIT"]), int(cfg["DENSE_BLOCK_K"])
    for c0, width, two in ((0, d_v, True), (d_v, d - d_v, False)):
        block_c = min(int(cfg["DENSE_BLOCK_C"]), width) if two else width  # rope: one column block (CLEAN)
        part = torch.empty(split, n_keys, width, dtype=torch.float32, device=dkv.device) if split > 1 else dkv
        _dense_dkv_kernel[(triton.cdiv(n_keys, block_k), triton.cdiv(width, block_c), split)](
            pds, q, d_out, dkv, part, key_ends, chunk, n * h, p_off, t0 * h, n_keys,
            D=d, DV=d_v, C0=c0, WIDTH=width, TWO=two, CLEAN=not two, SPLIT=split, BLOCK_K=block_k, BLOCK_C=block_c,
            BLOCK_J=int(cfg["DENSE_BLOCK_J"]), IEEE=q.dtype == torch.float32, num_warps=cfg["DENSE_num_warps"],
            num_stages=cfg["DENSE_num_stages"],
        )
        if split > 1:
            dkv[:, c0:c0 + width] += part.sum(0)  # the parts in a fixed order


def _chunk_key_ends(indices: torch.Tensor, rows: int, n_keys: int) -> torch.Tensor:
    """Per chunk of ``rows`` queries: one past the largest key it selects (0: none), int64 on the device."""
    n_q = indices.shape[0]
    full = n_q // rows * rows
    m = [indices[:full].reshape(n_q // rows, -1).amax(1)] if full else []
    if full < n_q:
        m.append(indices[full:].amax().reshape(1))
    return torch.cat(m).clamp(-1, n_keys - 1).add(1).long()


def _dk_mode(cfg: dict, n_keys: int, topk: int, det: bool) -> str:
    """The dk formulation.  "auto": "dense" when the keys it may multiply per query (all n_keys: the causal
    structure is not known here, only on the device) are at most DENSE_KEY_RATIO x the top-k slots per query that
    "slots" adds into dkv -- decided from host-known sizes alone, no host synchronisation."""
    mode = cfg.get("DK", "in_kernel")
    return auto_dk_mode(n_keys, topk, det) if mode == "auto" else mode


def dense_prefix_split(q, kv, indices, deterministic: Optional[bool] = None, config: Optional[dict] = None) -> int:
    """The rows a backward with BWD_CONFIG's DENSE_PREFIX takes in the dense formulation before "slots" takes the
    rest (sparse_bwd_budget.dense_prefix_rows on the indexer's host row bounds), or 0: no split (DENSE_PREFIX off or
    not for this mode and length -- prefix_applies --, DK not "auto", no host bounds, fewer than MIN_PREFIX_ROWS such
    rows, or all rows)."""
    cfg = dict(BWD_CONFIG, **(config or {}))
    det = deterministic_default() if deterministic is None else bool(deterministic)
    applies = prefix_applies(cfg.get("DENSE_PREFIX"), kv.shape[0], indices.shape[1], det)  # checks the setting
    row_hi = host_windows.row_ends(indices)
    if not applies or cfg.get("DK", "auto") != "auto" or row_hi is None:
        return 0
    rows = dense_prefix_rows(row_hi, indices.shape[1], det)
    return rows if MIN_PREFIX_ROWS <= rows < q.shape[0] else 0


def sparse_mla_bwd(q, kv, indices, out, lse, d_out, d_lse, softmax_scale: float, d_v: int,
                   deterministic: Optional[bool] = None, config: Optional[dict] = None,
                   dq: Optional[torch.Tensor] = None, head_sums: Optional[torch.Tensor] = None,
                   dkv_dtype: Optional[torch.dtype] = None):
    """(dq like q, dkv like kv, or of dkv_dtype: torch.float32 gives the fp32 sums unrounded).  d_lse may be None; dq
    may be given (contiguous, written in full).
    config: BWD_CONFIG's keys (DK: "in_kernel", "slots", "dense" or "auto"; see there).
    head_sums: a contiguous fp32 [T, topk] tensor that kernel 1 fills, in full, with the indexer KL target's head
    sums (``triton_kl.head_summed_probs``'s result for the forward's lse), from the p it recomputes anyway."""
    d_rope = _check(q, kv, indices, d_v)
    row_hi = host_windows.row_ends(indices)  # the indexer's host bounds of these top-k lists, when it made them
    cfg = dict(BWD_CONFIG, **(config or {}))
    det = deterministic_default() if deterministic is None else bool(deterministic)
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    d_out = d_out.contiguous()
    n_q, h, d = q.shape
    n_keys, topk = kv.shape[0], indices.shape[1]
    if head_sums is not None and (head_sums.shape != indices.shape or head_sums.dtype != torch.float32
                                  or not head_sums.is_contiguous()):
        raise ValueError(f"head_sums must be a contiguous fp32 [T, topk] = {tuple(indices.shape)} tensor")
    delta = bwd_delta(out, d_out, d_lse)
    lse = lse.contiguous()
    dq = torch.empty_like(q) if dq is None else dq
    dkv = torch.zeros(n_keys, d, dtype=torch.float32, device=q.device)
    if n_q == 0 or topk == 0:
        if head_sums is not None:
            head_sums.zero_()
        return dq.zero_(), dkv.to(dkv_dtype or kv.dtype)
    hp = _block_h(h)
    elt = q.element_size()
    shape_given = bool(_FALLBACK_KEYS & set(config or {}))
    configs = [cfg] + [dict(cfg, **c) for c in BWD_FALLBACKS if not shape_given and dict(cfg, **c) != cfg]
    ends = None
    mode = _dk_mode(cfg, n_keys, topk, det)
    if mode not in _DK_MODES:
        raise ValueError(f"triton sparse_mla_bwd: unknown DK mode {mode!r} (in_kernel, slots, dense, auto)")
    # every size below is host-known (n_q, n_keys, topk): no host synchronisation in the planning
    dense_rows = _dense_rows(n_q, n_keys, h, elt, cfg)
    while True:
        cfg = configs.pop(0)
        skip = bool(cfg.get("SKIP_PAD", False))
        if skip and ends is None:
            ends = used_slot_ends(indices, n_keys)
        h_split = max(1, min(int(cfg["H_SPLIT"]), hp // 16))
        rows = n_q
        det_row = 0  # fp32 dkv rows per query (deterministic, "in_kernel" / "slots")
        if mode == "in_kernel":
            det_row = h_split * topk * d * 4
        elif mode == "slots":
            det_row = topk * d * 4
            rows = _chunk_rows(n_q, 2 * topk * hp * elt, PDS_BUFFER_BYTES)
        else:
            rows = dense_rows
        det_rows = det and det_row > 0
        if det_rows:
            rows = min(rows, _chunk_rows(n_q, det_row, DET_BUFFER_BYTES))
        starts = list(range(0, n_q, rows))
        buf = torch.empty(rows * det_row // 4, dtype=torch.float32, device=q.device) if det_rows else dkv
        p_off = 0
        key_ends = delta  # an unused pointer outside "dense"
        # "dense" with the indexer's host row bounds: the chunks' key ends known, cuBLAS products
        plan = dense_plan(q, kv, indices, det, cfg, row_hi) if mode == "dense" else None
        if mode == "slots":
            pds = torch.empty(rows * 2 * topk * hp, dtype=q.dtype, device=q.device)
        elif plan is not None:  # its chunks are the loop's (one place: _dense_rows)
            pds, p_off, rows, starts = plan.buffer(0), plan.p_off, plan.rows, plan.starts
        elif mode == "dense":
            # zeroed once: each chunk's dkv kernel zeroes the tiles it read (the scattered entries) again
            p_off = n_keys * rows * h
            pds = torch.zeros(2 * p_off, dtype=q.dtype, device=q.device)
            key_ends = _chunk_key_ends(indices, rows, n_keys)
        else:
            pds = dkv
        # dq as a GEMM on the dense ds (kernel 1 then skips its two dq products): with cuBLAS's dense dkv
        dq_gemm = plan is not None and bool(cfg.get("DENSE_DQ", True))
        ends_arg = ends if skip else delta  # an unused pointer without SKIP_PAD
        # head sums: written straight into head_sums with one head group, else per group (summed below)
        hs = delta if head_sums is None else head_sums if h_split == 1 else torch.empty(
            h_split, n_q, topk, dtype=torch.float32, device=q.device)
        try:
            for i, t0 in enumerate(starts):
                n = min(rows, n_q - t0)
                if plan is not None:  # kernel 1 scatters below the chunk's key end only
                    plan.views(i)
                    pds = plan.buffer(i)
                _bwd_kernel[(n, h_split)](
                    q, kv, indices, d_out, lse, delta, dq, dkv, buf, pds, ends_arg, hs,
                    q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), d_out.stride(0), d_out.stride(1),
                    lse.stride(0), t0, h, n_keys, topk, float(softmax_scale), n * h, p_off, n_q * topk,
                    DV=d_v, DR=d_rope, BLOCK_H=hp // h_split, BLOCK_N=cfg["BLOCK_N"], H_SPLIT=h_split,
                    ATOMIC=not det, IEEE=q.dtype == torch.float32, DK_MODE=_DK_MODES[mode], HP=hp, SKIP_PAD=skip,
                    HEAD_SUMS=head_sums is not None, DQ=not dq_gemm, num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"],
                )
                if mode == "slots":
                    block_s = min(int(cfg["DK_BLOCK_S"]), max(16, triton.next_power_of_2(topk)))
                    _dkv_kernel[(n, triton.cdiv(topk, block_s))](
                        q, d_out, indices, pds, dkv, buf,
                        q.stride(0), q.stride(1), indices.stride(0), d_out.stride(0), d_out.stride(1),
                        t0, h, n_keys, topk,
                        DV=d_v, DR=d_rope, HP=hp, BLOCK_S=block_s, BLOCK_C=min(int(cfg["DK_BLOCK_C"]), d_v),
                        ATOMIC=not det, IEEE=q.dtype == torch.float32,
                        num_warps=cfg["DK_num_warps"], num_stages=cfg["DK_num_stages"],
                    )
                elif plan is not None:
                    plan.products(dkv, dq, plan.key_ends[i], n, t0, q, d_out, kv, d_v, with_dq=dq_gemm)
                elif mode == "dense":
                    _dense_dkv(dkv, pds, p_off, key_ends, i, n, h, q, d_out, t0, d_v, cfg)
                if det_rows:
                    _segment_reduce_into(dkv, buf, indices[t0:t0 + n], 1 if mode == "slots" else h_split)
            if head_sums is not None and h_split > 1:
                torch.sum(hs, 0, out=head_sums)  # the groups in a fixed order
            return dq, dkv.to(dkv_dtype or kv.dtype)
        except OutOfResources:
            if not configs:
                raise
            # nothing has been written for this launch configuration's first launch: retry with the next one
            dkv.zero_()


_DK_MODES = {"in_kernel": 0, "slots": 1, "dense": 2}


def sparse_mla(q, kv, indices, softmax_scale: float, d_v: int,
               deterministic: Optional[bool] = None, head_probs: Optional[torch.Tensor] = None,
               on_head_sums: Optional[Callable[[torch.Tensor], None]] = None,
               forward: Optional[Callable] = None,
               backward: Optional[Callable] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with autograd (dq, dkv): the Triton forward and backward through the backends' one autograd
    Function (``base.SparseMLAFunction``); see the module docstring.  head_probs: as ``sparse_mla_fwd``'s (filled
    by the forward, outside autograd).  on_head_sums: called by the backward with the indexer KL target's head sums
    ([T, topk] fp32, ``sparse_mla_bwd``'s head_sums) once it has computed them (the deferred KL,
    ``deferred_kl``).  forward: another forward with ``sparse_mla_fwd``'s contract (the tilelang backend's), in
    place of the Triton one (not with head_probs); backward: another backward with ``sparse_mla_bwd``'s contract,
    head_sums included (the tilelang backend's)."""
    if forward is not None and head_probs is not None:
        raise ValueError("sparse_mla: head_probs is the Triton forward's; not with another forward")
    fwd = forward or (sparse_mla_fwd if head_probs is None else functools.partial(sparse_mla_fwd,
                                                                                 head_probs=head_probs))
    bwd = backward or sparse_mla_bwd
    if on_head_sums is not None:
        bwd = functools.partial(_bwd_with_head_sums, on_head_sums, bwd)
    return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, deterministic, fwd, bwd)


def _bwd_with_head_sums(on_head_sums, bwd, q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v,
                        deterministic):
    head_sums = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
    grads = bwd(q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v, deterministic, head_sums=head_sums)
    on_head_sums(head_sums)
    return grads
