"""Indexer KL loss for the Triton backend (sparse stage: indices given; the dense warm-up uses the reference).

Two kernels, one program per query token each; nothing of size [T, h, K] or [T, K, d_index] is ever formed.

* ``_head_prob_kernel`` -- the target's unnormalised head sums P[t, j] = sum_h softmax_j(scale * q[t, h] . kv[j])
  over the selected keys j (h = 64 heads x 576 dims per key: the expensive part).  When the sparse forward's
  log-sum-exp is passed (``attn_lse``, natural log per head, as ``sparse_mla`` returns it) one pass over the keys
  suffices; without it a first pass computes each head's log-sum-exp.  P is fp32, 0 on unused slots.  An optional
  ``head_sum_reduce`` (the TP all-reduce over head shards) is applied to the whole [T, K] tensor, once.
* ``_indexer_kl_kernel`` -- the indexer side, fused: pass 1 gathers the selected index keys, forms the logits
  z_j = sum_h w_h relu(idx_scale * q_idx[t, h] . k_idx[j]) and their log-sum-exp (and sums P for the target's
  normalisation) -- or, when our indexer built the top-k list from these very inputs, takes that log-sum-exp from
  it (``KL_CONFIG["INDEXER_LSE"]``: ``triton_indexer`` decodes it from the sorted scores, ``host_windows`` keeps it
  under the list) and the normaliser from one sum, and skips pass 1; both passes stop after the query's last used
  slot (``KL_CONFIG["SKIP_PAD"]``: P is 0 on unused slots; not with the deterministic per-slot rows); pass 2
  recomputes z, adds the token's KL(target || softmax(z)) and, when gradients are needed, g = softmax(z) -
  target, dw = sum_j g_j relu(a_hj), da = g w (a > 0) idx_scale, dq_idx = da . K, and dk_idx rows += da^T q_idx, by
  ``KL_CONFIG["DK"]``: "dense" -- the kernel scatters da into a zeroed [keys, (query, head)] matrix per chunk of
  query rows (keys below the chunk's end, from the host row bounds the indexer left for the top-k tensor,
  ``host_windows.row_ends``) and one cuBLAS GEMM with an fp32 result contracts it with the chunk's q_idx:
  deterministic, no atomics; "atomic" -- fp32 atomics, or (deterministic mode) per-(token, slot) rows reduced by
  key in a fixed order with the sparse-MLA backward's segmented sum.  "auto" (default): "dense" in deterministic
  mode when the bounds are known and n_keys <= DENSE_KEY_RATIO["deterministic"] x top-k, else "atomic".  H200,
  causal, GLM-5's indexer (``benchmarks/fusions.py --parts indexer_kl``, docs/performance.md, session 10): S 4096
  atomic 3.31 / dense 3.35 ms in atomic mode, deterministic rows 5.83 / dense 3.30; S 32768 23.7 / 40.6 and
  46.3 / 41.2 -- so atomic mode keeps its atomics.
``KL_CONFIG["FORM"] = "tiles"`` takes the tile form instead (``triton_kl_tiles``: every key tile below a chunk's end
on the tensor cores, no gathers, no atomics; measured slower at S 4096, so opt-in).
Same contract and formulas as ``reference.indexer_kl_loss`` (its tests compare against it); the gradients are
computed in the forward and scaled in backward by ``reference._IndexerKLFunction``.  ``indexer_kl_grads`` is the
second kernel alone, given the head sums: the deferred KL (``deferred_kl``, the Triton backend's default) calls it
in the backward with the head sums of the sparse-MLA backward (``triton_sparse_mla.sparse_mla_bwd(head_sums=)``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import host_windows, reference, triton_interpret_compat, triton_kl_tiles
from .base import warn_once
from .triton_sparse_mla import (DENSE_KEY_RATIO, DET_BUFFER_BYTES, LOG2E, PDS_BUFFER_BYTES, _block_h, _check,
                                _chunk_rows, _host_chunk_key_ends, _load_query, _load_selected, _mma, _scores,
                                _segment_reduce_into, deterministic_default, mm_fp32_add_, used_slot_ends)

triton_interpret_compat.apply()

# tuned on the H200 (docs/performance.md, "Kernels")
PROB_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)  # 3.40 ms at S 4096 (64/8/2: 3.82; 128/8/2: no smem)
# DK: "auto", "dense" or "atomic" (the module docstring); DENSE_ROWS: query rows per dense chunk at most
# SKIP_PAD: stop each query's passes after its last used slot (the causal -1 padding of early tokens), except with
# the deterministic per-slot rows (they are all written)
# FORM: "slots" -- the kernel below (one query at a time over its gathered top-k slots); "tiles" -- the KL over
# contiguous key tiles (triton_kl_tiles: every key below a chunk's end on the tensor cores, no gathers, no atomics;
# needs the indexer's host row bounds) -- measured slower at S 4096 (H100, 2026-12-07: 3.18-3.74 vs 2.59-2.65 ms
# atomic / 2.82 deterministic), so not the default
# INDEXER_LSE: take the logits' log-sum-exp that the indexer remembered under the top-k list
# (host_windows.selected_lse: the same q_idx, k_idx, weights and scale) instead of the kernel's first pass
KL_CONFIG = dict(BLOCK_N=32, num_warps=2, num_stages=3, DK="auto", DENSE_ROWS=1024, SKIP_PAD=True, FORM="slots",
                 INDEXER_LSE=True)
KL_FALLBACK = dict(BLOCK_N=32, num_warps=4, num_stages=1)


@triton.jit
def _head_prob_kernel(
    Q, KV, IDX, LSE, P,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_lt, stride_pt,
    n_heads, n_keys, topk, scale_log2,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LSE_GIVEN: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < n_heads
    q_lat, q_rope = _load_query(Q + t * stride_qt, stride_qh, offs_h, h_ok, offs_v, offs_r, DV)
    if LSE_GIVEN:
        lse = tl.load(LSE + t * stride_lt + offs_h, mask=h_ok, other=float("inf"))
        # natural log -> log2 units of the scaled scores; heads without keys (-inf) give p = 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        for n0 in range(0, topk, BLOCK_N):
            slot = n0 + offs_n
            idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys, offs_v,
                                                    offs_r, DV)
            s = _scores(q_lat, q_rope, k_lat, k_rope, IEEE)
            s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
            m_i = m_new
        # padded heads and heads without keys contribute nothing
        lse = tl.where(h_ok & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    for n0 in range(0, topk, BLOCK_N):
        slot = n0 + offs_n
        idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys, offs_v, offs_r,
                                                DV)
        s = _scores(q_lat, q_rope, k_lat, k_rope, IEEE)
        p = tl.exp2(s * scale_log2 - lse[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        tl.store(P + t * stride_pt + slot, tl.sum(p, axis=0), mask=slot < topk)


def head_summed_probs(q, kv, indices, softmax_scale: float, d_v: int, attn_lse: Optional[torch.Tensor] = None,
                      config=None, out=None) -> torch.Tensor:
    """[T, K] fp32: sum over heads of softmax_j(scale * q[t, h] . kv[indices[t, j]]) (0 on unused slots).
    attn_lse [T, h] (natural log, -inf for heads without keys): the softmax's log-sum-exp when already known (the
    sparse forward returns it) -- one pass over the keys instead of two.  out may be given (contiguous, written in
    full)."""
    d_rope = _check(q, kv, indices, d_v)
    cfg = dict(PROB_CONFIG, **(config or {}))
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    n_q, h, _ = q.shape
    if attn_lse is not None:
        if attn_lse.shape != (n_q, h):
            raise ValueError(f"attn_lse must be [T={n_q}, h={h}], got {tuple(attn_lse.shape)}")
        attn_lse = attn_lse.detach().float().contiguous()
    p = torch.empty(n_q, indices.shape[1], dtype=torch.float32, device=q.device) if out is None else out
    if n_q and indices.shape[1]:
        lse_arg = attn_lse if attn_lse is not None else p  # unused pointer when LSE_GIVEN is False
        _head_prob_kernel[(n_q,)](
            q, kv, indices, lse_arg, p,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), lse_arg.stride(0), p.stride(0),
            h, kv.shape[0], indices.shape[1], float(softmax_scale) * LOG2E,
            DV=d_v, DR=d_rope, BLOCK_H=_block_h(h), BLOCK_N=cfg["BLOCK_N"], LSE_GIVEN=attn_lse is not None,
            IEEE=q.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return p


@triton.jit
def _index_logits_block(IDX_ROW, KI, stride_kit, slot, topk, n_keys, offs_d, qi, w, scale,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Selected index keys in slots ``slot`` of one query: positions, validity, rows k [BLOCK_N, DI], the scaled
    per-head dots a [BLOCK_H, BLOCK_N] and the logits z = sum_h w_h relu(a_h) [BLOCK_N] (-inf on invalid slots)."""
    idx = tl.load(IDX_ROW + slot, mask=slot < topk, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < n_keys)
    k = tl.load(KI + tl.where(ok, idx, 0)[:, None] * stride_kit + offs_d[None, :], mask=ok[:, None], other=0.0)
    a = _mma(qi, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE) * scale
    z = tl.sum(w[:, None] * tl.maximum(a, 0.0), axis=0)
    z = tl.where(ok, z, float("-inf"))
    return idx, ok, k, a, z


@triton.jit
def _indexer_kl_kernel(
    QI, KI, W, IDX, P, CNT, KL, DQI, DW, DKI, BUF, G, ENDS, LSE, TOTAL,
    stride_qit, stride_qih, stride_kit, stride_wt, stride_it, stride_pt,
    t0, n_heads, n_keys, topk, scale, g_stride, key_end,
    DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NEED_GRAD: tl.constexpr, ATOMIC: tl.constexpr,
    DENSE: tl.constexpr, IEEE: tl.constexpr, SKIP_PAD: tl.constexpr, LSE_GIVEN: tl.constexpr,
):
    """SKIP_PAD: both passes stop after the query's last used slot (ENDS[t]; the slots after it are unused: no
    logit, P 0 there by the contract, no gradient) -- not with per-slot BUF rows, which must all be written.
    LSE_GIVEN: the logits' log-sum-exp (LSE[t], from the indexer) and the target's normaliser (TOTAL[t]) are given,
    so pass 1 is skipped."""
    tl_ = tl.program_id(0).to(tl.int64)  # row inside this launch's query range
    t = t0 + tl_
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DI)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < n_heads
    qi = tl.load(QI + t * stride_qit + offs_h[:, None] * stride_qih + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    w = tl.load(W + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    counted = tl.load(CNT + t) != 0
    idx_row = IDX + t * stride_it
    p_row = P + t * stride_pt
    n_end = tl.load(ENDS + t) if SKIP_PAD else topk

    # pass 1: log-sum-exp of the indexer logits, and the target's normaliser (given: no pass)
    if LSE_GIVEN:
        lse_z = tl.load(LSE + t)
        total = tl.load(TOTAL + t)
    else:
        m_i = float("-inf")
        l_i = 0.0
        total = 0.0
        for n0 in range(0, n_end, BLOCK_N):
            slot = n0 + offs_n
            idx, ok, k, a, z = _index_logits_block(idx_row, KI, stride_kit, slot, topk, n_keys, offs_d, qi, w, scale,
                                                   BLOCK_H, BLOCK_N, IEEE)
            m_new = tl.maximum(m_i, tl.max(z, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.exp(z - m_use), axis=0)
            m_i = m_new
            total += tl.sum(tl.load(p_row + slot, mask=slot < topk, other=0.0), axis=0)  # P is 0 on unused slots
        lse_z = m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))
    total = tl.where(total > 0, total, 1.0)

    # pass 2: KL and gradients
    kl = 0.0
    dqi = tl.zeros([BLOCK_H, DI], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        slot = n0 + offs_n
        idx, ok, k, a, z = _index_logits_block(idx_row, KI, stride_kit, slot, topk, n_keys, offs_d, qi, w, scale,
                                               BLOCK_H, BLOCK_N, IEEE)
        allowed = ok & counted
        tgt = tl.where(allowed, tl.load(p_row + slot, mask=slot < topk, other=0.0) / total, 0.0)
        log_ind = tl.where(allowed, z - lse_z, 0.0)
        pos = tgt > 0
        kl += tl.sum(tl.where(pos, tgt * (tl.log(tl.where(pos, tgt, 1.0)) - log_ind), 0.0), axis=0)
        if NEED_GRAD:
            g = tl.where(allowed, tl.exp(log_ind) - tgt, 0.0)
            dw += tl.sum(g[None, :] * tl.maximum(a, 0.0), axis=1)
            da = tl.where(a > 0, g[None, :] * w[:, None] * scale, 0.0).to(k.dtype)
            dqi = _mma(da, k, dqi, IEEE)
            if DENSE:  # G[key, row * n_heads + head] of this chunk (zeroed; keys below key_end by the host bounds)
                gp = G + tl.where(ok, idx, 0)[:, None] * g_stride + tl_ * n_heads + offs_h[None, :]
                tl.store(gp, tl.trans(da), mask=(ok & (idx < key_end))[:, None] & h_ok[None, :])
            elif ATOMIC:
                dk = _mma(tl.trans(da), qi, tl.zeros([BLOCK_N, DI], tl.float32), IEEE)
                tl.atomic_add(DKI + tl.where(ok, idx, 0)[:, None] * DI + offs_d[None, :], dk, mask=ok[:, None],
                              sem="relaxed")
            else:
                dk = _mma(tl.trans(da), qi, tl.zeros([BLOCK_N, DI], tl.float32), IEEE)
                brow = BUF + (tl_ * topk + slot)[:, None] * DI + offs_d[None, :]
                tl.store(brow, dk, mask=(slot < topk)[:, None])
    tl.store(KL + t, kl)
    if NEED_GRAD:
        tl.store(DQI + t * n_heads * DI + offs_h[:, None] * DI + offs_d[None, :], dqi, mask=h_ok[:, None])
        tl.store(DW + t * n_heads + offs_h, dw, mask=h_ok)


def _dk_dense(cfg: dict, row_hi, n_keys: int, topk: int, det: bool) -> bool:
    """Whether d_k_idx takes the dense path (module docstring): needs the host row bounds (``row_hi``)."""
    mode = cfg.get("DK", "auto")
    if mode not in ("auto", "dense", "atomic"):
        raise ValueError(f"triton indexer KL: unknown DK mode {mode!r} (auto, dense, atomic)")
    if mode == "dense" and row_hi is None:
        warn_once("triton", "indexer KL: DK='dense' needs the host row bounds our indexer leaves for its top-k lists "
                  "(these have none)", "the atomic d_k_idx path")
    if mode == "atomic" or row_hi is None:
        return False
    return mode == "dense" or (det and n_keys / max(1, min(topk, n_keys)) <= DENSE_KEY_RATIO["deterministic"])


def _tiles_form(cfg: dict, row_hi) -> bool:
    """Whether the KL takes the "tiles" form (KL_CONFIG's FORM): asked for, and the host row bounds (``row_hi``)
    known (else said once, and the slot form)."""
    form = cfg.get("FORM", "slots")
    if form not in ("tiles", "slots"):
        raise ValueError(f"triton indexer KL: unknown FORM {form!r} (slots, tiles)")
    if form == "tiles" and row_hi is None:
        warn_once("triton", "indexer KL: FORM='tiles' needs the host row bounds our indexer leaves for its top-k "
                  "lists (these have none)", "the slot form")
    return form == "tiles" and row_hi is not None


def _indexer_kl(q_idx, k_idx, weights, idx_scale, indices, head_sums, counted, need_grad, deterministic, config):
    """(per-token KL [T] fp32, d_q_idx, d_k_idx, d_w fp32 or None)."""
    row_hi = host_windows.row_ends(indices)
    lse_z = host_windows.selected_lse(indices, q_idx, k_idx, weights, idx_scale)
    q_idx, k_idx, indices = q_idx.detach().contiguous(), k_idx.detach().contiguous(), indices.contiguous()
    weights = weights.detach().contiguous()
    n_q, n_heads, d_i = q_idx.shape
    n_keys, topk = k_idx.shape[0], indices.shape[1]
    dev = q_idx.device
    kl = torch.zeros(n_q, dtype=torch.float32, device=dev)
    d_qi = torch.zeros(n_q, n_heads, d_i, dtype=torch.float32, device=dev) if need_grad else None
    d_w = torch.zeros(n_q, n_heads, dtype=torch.float32, device=dev) if need_grad else None
    d_ki = torch.zeros(n_keys, d_i, dtype=torch.float32, device=dev) if need_grad else None
    if n_q == 0 or topk == 0:
        return kl, d_qi, d_ki, d_w
    cfg0 = dict(KL_CONFIG, **(config or {}))
    cnt = counted.to(torch.int8).contiguous()
    if _tiles_form(cfg0, row_hi):
        tiles_cfg = dict(triton_kl_tiles.TILE_CONFIG, **(cfg0.get("TILES") or {}))
        rows = min(int(tiles_cfg["ROWS"]), _chunk_rows(n_q, n_keys * n_heads * k_idx.element_size(),
                                                       PDS_BUFFER_BYTES))
        ends = _host_chunk_key_ends(row_hi, rows, n_keys)
        try:
            triton_kl_tiles.kl_tiles(q_idx, k_idx, weights, idx_scale, indices, head_sums, cnt, need_grad, ends,
                                     rows, kl, d_qi, d_ki, d_w, config=tiles_cfg)
            return kl, d_qi, d_ki, d_w
        except OutOfResources as e:
            warn_once("triton", f"indexer KL: the tile form's kernel does not fit this GPU ({e})", "the slot form")
            for t in (kl, d_qi, d_ki, d_w):
                if t is not None:
                    t.zero_()
    dense = need_grad and _dk_dense(cfg0, row_hi, n_keys, topk, deterministic)
    det = need_grad and deterministic and not dense  # the dense path is deterministic by itself
    if dense:
        rows = min(int(cfg0["DENSE_ROWS"]), _chunk_rows(n_q, n_keys * n_heads * k_idx.element_size(),
                                                        PDS_BUFFER_BYTES))
        ends = _host_chunk_key_ends(row_hi, rows, n_keys)
        g_buf = torch.empty(max(1, max(ends) * rows * n_heads), dtype=k_idx.dtype, device=dev)
    else:
        rows = max(1, min(n_q, DET_BUFFER_BYTES // max(1, topk * d_i * 4))) if det else n_q
        g_buf = kl  # an unused pointer
    buf = torch.empty(rows * topk, d_i, dtype=torch.float32, device=dev) if det else kl
    dummy = kl
    lse_given = lse_z is not None and bool(cfg0.get("INDEXER_LSE", True))
    total = head_sums.sum(-1) if lse_given else kl  # the target's normaliser (P is 0 on unused slots)
    skip = bool(cfg0.get("SKIP_PAD", True)) and not det  # per-slot rows (deterministic, not dense): every slot
    slot_ends = used_slot_ends(indices, n_keys) if skip else kl
    configs = [cfg0] + ([dict(cfg0, **KL_FALLBACK)] if config is None else [])
    while True:
        cfg = configs.pop(0)
        try:
            for i, t0 in enumerate(range(0, n_q, rows)):
                n = min(rows, n_q - t0)
                key_end = ends[i] if dense else 0
                if dense:
                    g_buf[:key_end * n * n_heads].zero_()
                _indexer_kl_kernel[(n,)](
                    q_idx, k_idx, weights, indices, head_sums, cnt, kl,
                    d_qi if need_grad else dummy, d_w if need_grad else dummy, d_ki if need_grad else dummy, buf,
                    g_buf, slot_ends, lse_z if lse_given else kl, total, q_idx.stride(0), q_idx.stride(1),
                    k_idx.stride(0), weights.stride(0), indices.stride(0), head_sums.stride(0), t0,
                    n_heads, n_keys, topk, float(idx_scale), n * n_heads, key_end,
                    DI=d_i, BLOCK_H=_block_h(n_heads), BLOCK_N=cfg["BLOCK_N"], NEED_GRAD=need_grad, ATOMIC=not det,
                    DENSE=dense, IEEE=q_idx.dtype == torch.float32, SKIP_PAD=skip, LSE_GIVEN=lse_given,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                )
                if dense and key_end > 0:
                    mm_fp32_add_(d_ki[:key_end], g_buf[:key_end * n * n_heads].view(key_end, n * n_heads),
                                 q_idx[t0:t0 + n].reshape(n * n_heads, d_i))
                if det:
                    _segment_reduce_into(d_ki, buf, indices[t0:t0 + n], 1)
            return kl, d_qi, d_ki, d_w
        except OutOfResources:
            if not configs:
                raise
            if need_grad:
                d_ki.zero_()


def indexer_kl_loss_sparse(q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, indices, d_v,
                           token_mask=None, head_sum_reduce=None, attn_lse=None, deterministic=None, config=None,
                           head_probs=head_summed_probs, attn_head_probs=None):
    """Same contract as ``reference.indexer_kl_loss`` with indices given (d_v is the latent / value width), plus
    attn_lse: the sparse forward's log-sum-exp [T, h] for these q, kv, indices and scale (saves a pass).
    head_probs: the target's head sums, a function with ``head_summed_probs``'s signature (another backend's kernel).
    attn_head_probs: those head sums already computed ([T, K] fp32, this rank's heads: the Triton sparse forward
    writes them with ``head_probs=``); then no kernel computes them here (head_sum_reduce still applies).
    n_tokens is returned as a 0-dim device tensor (not an int), so that no layer waits for the GPU.
    deterministic: bitwise reproducible d_k_idx (default: GLM5_TRITON_DETERMINISTIC).
    """
    n_q = q.shape[0]
    n_k = kv.shape[0]
    idx_heads, idx_dim = q_idx.shape[1], q_idx.shape[2]
    if k_idx.shape[0] != n_k or q_idx.shape[0] != n_q or weights.shape != (n_q, idx_heads):
        raise ValueError("inconsistent shapes between q_idx/k_idx/weights and q/kv")
    if idx_dim & (idx_dim - 1):
        raise ValueError(f"triton indexer KL needs a power-of-two index head dim (got {idx_dim}); use --attn torch")
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights))
    with torch.no_grad():
        if attn_head_probs is not None:
            if attn_head_probs.shape != indices.shape:
                raise ValueError(f"attn_head_probs must be [T, topk] = {tuple(indices.shape)}, got "
                                 f"{tuple(attn_head_probs.shape)}")
            head_sums = attn_head_probs.float().contiguous()
        else:
            head_sums = head_probs(q.detach(), kv.detach(), indices, attn_softmax_scale, d_v, attn_lse=attn_lse)
        kl_sum, n_tokens, d_qi, d_ki, d_w = indexer_kl_grads(
            q_idx, k_idx, weights, indices, head_sums, idx_softmax_scale, token_mask=token_mask,
            head_sum_reduce=head_sum_reduce, deterministic=deterministic, config=config, need_grad=need_grad)
    if need_grad:
        kl_sum = reference._IndexerKLFunction.apply(
            q_idx, k_idx, weights, kl_sum,
            d_qi.to(q_idx.dtype) if q_idx.requires_grad else None,
            d_ki.to(k_idx.dtype) if k_idx.requires_grad else None,
            d_w.to(weights.dtype) if weights.requires_grad else None,
        )
    return kl_sum, n_tokens


def indexer_kl_grads(q_idx, k_idx, weights, indices, head_sums, idx_softmax_scale, token_mask=None,
                     head_sum_reduce=None, deterministic=None, config=None, need_grad=True):
    """The sparse KL from the target's head sums (this rank's heads, [T, topk] fp32; head_sum_reduce, the TP
    all-reduce, applied here): (kl_sum, n_tokens, d_q_idx, d_k_idx, d_weights) -- fp32 values and gradients of
    kl_sum (None without need_grad), n_tokens the counted queries as a 0-dim device tensor (no host-GPU
    synchronisation).  No autograd: ``indexer_kl_loss_sparse`` and the deferred KL (``deferred_kl``) scale them."""
    det = deterministic_default() if deterministic is None else bool(deterministic)
    counted = reference.counted_queries((indices >= 0).any(dim=-1), token_mask)
    with torch.no_grad():
        head_sums = head_sums.float().contiguous()
        if head_sum_reduce is not None:
            head_sums = head_sum_reduce(head_sums).contiguous()
        kl_tok, d_qi, d_ki, d_w = _indexer_kl(q_idx, k_idx, weights, idx_softmax_scale, indices, head_sums, counted,
                                              need_grad, det, config)
    return kl_tok.sum(), counted.sum(), d_qi, d_ki, d_w
