"""Indexer KL loss for the Triton backend: a Triton kernel for the target, a chunked torch composition for the rest.

Only the sparse stage (indices given) runs here; the dense warm-up (indices None) uses the reference.

* Target (the expensive part: h = 64 heads x 576 dims per selected key): ``_head_prob_kernel``, one program per
  query token, makes two passes over the selected kv rows -- the first for each head's log-sum-exp, the second
  for sum_h softmax_h(j) -- and writes the head-summed probabilities [T, K] (fp32, 0 on unused slots).  No
  [T, h, K] tensor exists.
* Indexer distribution, KL and the gradients to q_idx / k_idx / weights: plain torch on query chunks of [C, K]
  (C bounded by ``reference.CHUNK_BUDGET``), with the same formulas as ``reference.indexer_kl_loss`` and its
  helpers (``_index_logits``, ``_KeySet``, ``_IndexerKLFunction``).  head_sum_reduce is applied per chunk, as in
  the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference, triton_interpret_compat
from .triton_sparse_mla import _block_h, _check, _load_selected, _scores

triton_interpret_compat.apply()

CONFIG = dict(BLOCK_N=32, num_warps=8, num_stages=1)


@triton.jit
def _head_prob_kernel(
    Q, KV, IDX, P,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_pt,
    n_heads, n_keys, topk, scale_log2,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < n_heads
    q_base = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_v[None, :], mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_base + DV + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        slot = n0 + offs_n
        idx, ok, k_lat, k_rope = _load_selected(IDX + t * stride_it, KV, stride_kvt, slot, topk, n_keys, offs_v, offs_r,
                                                DV)
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


def head_summed_probs(q, kv, indices, softmax_scale: float, d_v: int, config=None, out=None) -> torch.Tensor:
    """[T, K] fp32: sum over heads of softmax_j(scale * q[t, h] . kv[indices[t, j]]) (0 on unused slots).
    out may be given (contiguous, written in full)."""
    d_rope = _check(q, kv, indices, d_v)
    cfg = dict(CONFIG, **(config or {}))
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    n_q, h, _ = q.shape
    p = torch.empty(n_q, indices.shape[1], dtype=torch.float32, device=q.device) if out is None else out
    if n_q and indices.shape[1]:
        _head_prob_kernel[(n_q,)](
            q, kv, indices, p, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), p.stride(0),
            h, kv.shape[0], indices.shape[1], float(softmax_scale) * 1.4426950408889634,
            DV=d_v, DR=d_rope, BLOCK_H=_block_h(h), BLOCK_N=cfg["BLOCK_N"], IEEE=q.dtype == torch.float32,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return p


def indexer_kl_loss_sparse(q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, indices, d_v,
                           token_mask=None, head_sum_reduce=None, chunk_size=None):
    """Same contract as ``reference.indexer_kl_loss`` with indices given; d_v is the latent (value) width."""
    n_q = q.shape[0]
    n_k = kv.shape[0]
    idx_heads, idx_dim = q_idx.shape[1], q_idx.shape[2]
    if k_idx.shape[0] != n_k or q_idx.shape[0] != n_q or weights.shape != (n_q, idx_heads):
        raise ValueError("inconsistent shapes between q_idx/k_idx/weights and q/kv")
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights))
    cdt = torch.float32
    width = indices.shape[1]
    has_keys = (indices >= 0).any(dim=-1)
    counted, counted_host, n_tokens, kl_sum, d_qi, d_ki, d_w = reference.kl_accumulators(
        q_idx, k_idx, weights, has_keys, token_mask, need_grad, cdt)
    chunk = reference.DEFAULT_CHUNK if chunk_size is None else int(chunk_size)
    plan = reference._sparse_plan(n_q, width, chunk, idx_heads + idx_dim + 4)

    with torch.no_grad():
        head_sum_all = head_summed_probs(q.detach(), kv.detach(), indices, attn_softmax_scale, d_v)
        for c0, c1, lo, hi in plan:
            if head_sum_reduce is None and not bool(counted_host[c0:c1].any()):
                continue  # with a reduce hook every rank must call it for every chunk
            keys = reference._KeySet(c0, c1, lo, hi, indices, None, None)
            allowed = keys.mask & counted[c0:c1].unsqueeze(-1)
            head_sum = head_sum_all[c0:c1]
            if head_sum_reduce is not None:
                head_sum = head_sum_reduce(head_sum)
            total = head_sum.sum(dim=-1, keepdim=True)
            target = (head_sum / torch.where(total > 0, total, torch.ones_like(total))).masked_fill(~allowed, 0.0)

            qi = q_idx[c0:c1].to(cdt)
            kic = keys.take(k_idx, cdt)
            w = weights[c0:c1].to(cdt)
            a, z = reference._index_logits(qi, kic, w, idx_softmax_scale)
            log_ind = torch.log_softmax(z.masked_fill(~keys.mask, float("-inf")), dim=-1).masked_fill(~allowed, 0.0)
            pos = target > 0
            safe_t = torch.where(pos, target, torch.ones_like(target))
            kl_sum += torch.where(pos, target * (torch.log(safe_t) - log_ind), torch.zeros_like(target)).sum()
            if need_grad:
                g = torch.where(allowed, torch.exp(log_ind) - target, torch.zeros_like(target))
                d_w[c0:c1] = (torch.relu(a) @ g.unsqueeze(-1)).squeeze(-1)
                da = (g.unsqueeze(1) * w.unsqueeze(-1)) * (a > 0) * idx_softmax_scale
                del a
                d_qi[c0:c1] = da @ kic
                keys.add_into(d_ki, keys.outer(da, qi))

    if need_grad:
        kl_sum = reference._IndexerKLFunction.apply(
            q_idx, k_idx, weights, kl_sum,
            d_qi.to(q_idx.dtype) if q_idx.requires_grad else None,
            d_ki.to(k_idx.dtype) if k_idx.requires_grad else None,
            d_w.to(weights.dtype) if weights.requires_grad else None,
        )
    return kl_sum, n_tokens
