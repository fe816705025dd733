"""The sparse-stage indexer KL over contiguous key tiles ("tiles" form of ``triton_kl``): where a query's selected
keys are a large part of the keys below it (S 4096 / 8192 with GLM-5's top-k 2048), multiplying every key tile
on the tensor cores is cheaper than gathering the selected index keys one query at a time.

Per chunk of query rows (keys below the chunk's end ``kc``, known on the host from the indexer's row bounds):

* ``PD`` [n, kc] fp32: the target's head sums moved from the top-k slots to their key columns, -1 on every key
  that is not selected (a scatter; no host synchronisation), and the target's normaliser, the sum of each row's
  head sums over all its slots (as the slot form and the reference sum them);
* ``_kl_tiles_kernel``, one program per BLOCK_T queries, their BLOCK_H index heads as the BLOCK_T x BLOCK_H rows
  of one tile (M = 128 for GLM-5's 32 heads):
  pass 1 over the key tiles: a = scale q_idx . k^T ([rows, BLOCK_N], fp32 accumulation), the logits
  z = sum_h w_h relu(a_h) (the rows of one query summed) and their online log-sum-exp over the selected keys;
  pass 2: a and z again, the token's KL(target || softmax(z)), g = softmax(z) - target on selected keys,
  dw = sum g relu(a), da = g w (a > 0) scale, dq_idx += da . k, and G[key, (row, head)] = da (input dtype) for
  every key of the chunk (zeros where nothing is selected, so G needs no zero fill);
  tiles in which no counted query selected a key skip the products;
* d_k_idx[:kc] += G . q_idx of the chunk: one cuBLAS GEMM with an fp32 result.
No atomics: deterministic in both modes.  Same contract as the slot form (``triton_kl._indexer_kl``), which its
tests compare against the fp64 reference.  The work is the causal area x 3 products instead of the selected
slots x (2 products + gathers).

Status (2026-12-07, session 12): opt-in (``KL_CONFIG["FORM"] = "tiles"``), not the default: on an H100 at GLM-5's
indexer shapes, S 4096, causal top-k 2048 from our indexer, it took 3.18-3.74 ms (BLOCK_T 4 / 2, BLOCK_N 64 / 32,
two or three stages, 1,024- or 2,048-row chunks) against the slot form's 2.59-2.65 ms atomic and 2.82 ms
deterministic (same call); d_q_idx / d_k_idx within 6e-5 / 4e-5 (rel. L2) of the slot form's; the GPU test
(NaN-poisoned G, both modes bitwise equal) passed.  ptxas (sm_90a, compiled on the CPU machine): 255 registers and
224 bytes of spills in the pass-2 loop at BLOCK_N 64, and every tile pays layout conversions for the per-query
reduction over 32 head rows and its broadcast back -- the likely reasons; not profiled on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_interpret_compat
from .triton_sparse_mla import _block_h, _mma, mm_fp32_add_

triton_interpret_compat.apply()

# BLOCK_T queries x BLOCK_H heads are the rows of a tile (BLOCK_T * BLOCK_H: 128 for GLM-5's 32 index heads);
# ROWS: query rows per chunk at most (the chunk's G is [kc, ROWS * heads] in the input dtype)
TILE_CONFIG = dict(BLOCK_T=4, BLOCK_N=64, ROWS=1024, num_warps=8, num_stages=2)


@triton.jit
def _tile_logits(qi, w, KI, stride_kit, s, n_keys, offs_d, scale,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Key rows s: k [BLOCK_N, DI], a = scale q_idx . k^T [BLOCK_T * BLOCK_H, BLOCK_N] and the logits
    z = sum_h w_h relu(a_h) [BLOCK_T, BLOCK_N]."""
    k = tl.load(KI + s[:, None] * stride_kit + offs_d[None, :], mask=(s < n_keys)[:, None], other=0.0)
    a = _mma(qi, tl.trans(k), tl.zeros([BLOCK_T * BLOCK_H, BLOCK_N], tl.float32), IEEE) * scale
    z = tl.sum(tl.reshape(tl.maximum(a, 0.0) * w[:, None], (BLOCK_T, BLOCK_H, BLOCK_N)), axis=1)
    return k, a, z


@triton.jit
def _kl_tiles_kernel(
    QI, KI, W, PD, TOT, CNT, KL, DQI, DW, G,
    stride_qit, stride_qih, stride_kit, stride_wt, stride_pd,
    t0, n_rows, n_heads, n_keys, key_end, scale,
    DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NEED_GRAD: tl.constexpr, IEEE: tl.constexpr,
):
    R: tl.constexpr = BLOCK_T * BLOCK_H
    pid = tl.program_id(0)
    i_loc = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # chunk rows of this program's queries
    t_ok = i_loc < n_rows
    r = tl.arange(0, R)  # tile row = query * BLOCK_H + head
    r_loc = pid * BLOCK_T + r // BLOCK_H
    r_h = r % BLOCK_H
    r_ok = (r_loc < n_rows) & (r_h < n_heads)
    r_t = (t0 + r_loc).to(tl.int64)
    offs_d = tl.arange(0, DI)
    offs_n = tl.arange(0, BLOCK_N)
    qi = tl.load(QI + r_t[:, None] * stride_qit + r_h[:, None] * stride_qih + offs_d[None, :], mask=r_ok[:, None],
                 other=0.0)
    w = tl.load(W + r_t * stride_wt + r_h, mask=r_ok, other=0.0).to(tl.float32)
    counted = tl.load(CNT + t0 + i_loc, mask=t_ok, other=0) != 0
    pd_rows = PD + i_loc.to(tl.int64)[:, None] * stride_pd
    g_cols = r_loc.to(tl.int64) * n_heads + r_h  # G's column of each tile row

    # pass 1: log-sum-exp of the logits over the selected keys
    m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, key_end, BLOCK_N):
        s = s0 + offs_n
        pd = tl.load(pd_rows + s[None, :], mask=t_ok[:, None] & (s < key_end)[None, :], other=-1.0)
        live = (pd >= 0.0) & counted[:, None]
        if tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0:
            k, a, z = _tile_logits(qi, w, KI, stride_kit, s, n_keys, offs_d, scale, BLOCK_T, BLOCK_H, BLOCK_N, IEEE)
            z = tl.where(live, z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.exp(z - m_use[:, None]), axis=1)
            m_i = m_new
    lse = m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))
    total = tl.load(TOT + i_loc, mask=t_ok, other=1.0)
    total = tl.where(total > 0, total, 1.0)

    # pass 2: the KL and the gradients
    kl = tl.zeros([BLOCK_T], tl.float32)
    dqi = tl.zeros([R, DI], tl.float32)
    dw = tl.zeros([R], tl.float32)
    for s0 in range(0, key_end, BLOCK_N):
        s = s0 + offs_n
        pd = tl.load(pd_rows + s[None, :], mask=t_ok[:, None] & (s < key_end)[None, :], other=-1.0)
        live = (pd >= 0.0) & counted[:, None]
        g_ptr = G + s[None, :].to(tl.int64) * (n_rows * n_heads) + g_cols[:, None]  # [R, BLOCK_N]: G^T's tile
        g_mask = r_ok[:, None] & (s < key_end)[None, :]
        if tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0:
            k, a, z = _tile_logits(qi, w, KI, stride_kit, s, n_keys, offs_d, scale, BLOCK_T, BLOCK_H, BLOCK_N, IEEE)
            tgt = tl.where(live, pd / total[:, None], 0.0)
            log_ind = tl.where(live, z - lse[:, None], 0.0)
            pos = tgt > 0
            kl += tl.sum(tl.where(pos, tgt * (tl.log(tl.where(pos, tgt, 1.0)) - log_ind), 0.0), axis=1)
            if NEED_GRAD:
                g = tl.where(live, tl.exp(log_ind) - tgt, 0.0)
                g_r = tl.reshape(tl.broadcast_to(g[:, None, :], (BLOCK_T, BLOCK_H, BLOCK_N)), (R, BLOCK_N))
                dw += tl.sum(g_r * tl.maximum(a, 0.0), axis=1)
                da = tl.where(a > 0, g_r * w[:, None] * scale, 0.0).to(k.dtype)
                dqi = _mma(da, k, dqi, IEEE)
                tl.store(g_ptr, da, mask=g_mask)
        elif NEED_GRAD:
            tl.store(g_ptr, tl.zeros([R, BLOCK_N], G.dtype.element_ty), mask=g_mask)
    tl.store(KL + t0 + i_loc, kl, mask=t_ok)
    if NEED_GRAD:
        tl.store(DQI + r_t[:, None] * (n_heads * DI) + r_h[:, None] * DI + offs_d[None, :], dqi, mask=r_ok[:, None])
        tl.store(DW + r_t * n_heads + r_h, dw, mask=r_ok)


def _new_g(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """G's buffer, uninitialised: the kernel writes every element of it (a GPU test fills it with NaN instead)."""
    return torch.empty(numel, dtype=dtype, device=device)


def target_columns(indices: torch.Tensor, head_sums: torch.Tensor, key_end: int) -> torch.Tensor:
    """PD [n, key_end] fp32 (a view with row stride key_end + 1): head_sums moved from the top-k slots to their key
    columns, -1 on keys not selected.  Slots that are unused or at / past key_end go to a spare last column."""
    n = indices.shape[0]
    pd = torch.full((n, key_end + 1), -1.0, dtype=torch.float32, device=indices.device)
    idx = indices.long()
    col = torch.where((idx >= 0) & (idx < key_end), idx, key_end)
    pd.scatter_(1, col, head_sums)
    return pd[:, :key_end]


def kl_tiles(q_idx, k_idx, weights, idx_scale, indices, head_sums, counted, need_grad: bool, key_ends: list,
             rows: int, kl, d_qi, d_ki, d_w, config=None):
    """Fill kl [T] (and, with need_grad, d_qi, d_ki, d_w: fp32, zeroed) for chunks of ``rows`` query rows whose
    keys all lie below key_ends[i] (host ints).  Inputs contiguous; head_sums [T, topk] fp32 (0 on unused slots);
    counted [T] int8."""
    cfg = dict(TILE_CONFIG, **(config or {}))
    n_q, n_heads, d_i = q_idx.shape
    n_keys = k_idx.shape[0]
    block_t, block_h = int(cfg["BLOCK_T"]), _block_h(n_heads)
    for i, t0 in enumerate(range(0, n_q, rows)):
        n, kc = min(rows, n_q - t0), int(key_ends[i])
        if kc <= 0:
            continue  # no query of the chunk has a key: KL 0, no gradient
        pd = target_columns(indices[t0:t0 + n], head_sums[t0:t0 + n], kc)
        total = head_sums[t0:t0 + n].sum(-1)
        g = _new_g(kc * n * n_heads if need_grad else 1, k_idx.dtype, q_idx.device)
        _kl_tiles_kernel[(triton.cdiv(n, block_t),)](
            q_idx, k_idx, weights, pd, total, counted, kl, d_qi if need_grad else kl, d_w if need_grad else kl, g,
            q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), weights.stride(0), pd.stride(0),
            t0, n, n_heads, n_keys, kc, float(idx_scale),
            DI=d_i, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=int(cfg["BLOCK_N"]), NEED_GRAD=need_grad,
            IEEE=q_idx.dtype == torch.float32, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
        )
        if need_grad:
            mm_fp32_add_(d_ki[:kc], g.view(kc, n * n_heads), q_idx[t0:t0 + n].reshape(n * n_heads, d_i))
