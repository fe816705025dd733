"""Our TileLang kernel for the DSA indexer KL loss's target (``--attn tilelang``): the one-pass head sums.

``tilelang_head_summed_probs`` has the contract of ``triton_kl.head_summed_probs`` with ``attn_lse`` given: for
query t and top-k slot j holding key indices[t, j],
    P[t, j] = sum_h exp(scale * q[t, h] . kv[indices[t, j]] - lse[t, h])
i.e. the sum over heads of each head's softmax over the selected keys, using the sparse forward's log-sum-exp
(natural log, [T, h] fp32, -inf for a head / row without keys).  P is fp32 [T, K], unnormalised (the KL kernel
divides by the row total), 0 on unused slots (-1 or >= Tk) and 0 for heads whose lse is -inf.

The kernel (``build_head_probs``): one thread block per (query token, group of HEAD_BLOCK = 64 heads), the heads the
M dimension of the score product, exactly as the sparse forward (tilelang_sparse_mla): q's latent and rope parts
stay in shared memory, the selected kv rows are gathered block_n at a time (an unused slot reads a clamped row and
gets p = 0), s = q_lat k_lat^T + q_rope k_rope^T in fp32 (bf16 operands), p = exp2(s * scale * log2 e - lse *
log2 e), and the [64, block_n] tile is reduced over its heads (a column sum) into block_n fp32 values written to
Part[t, head block, slots].  With more than one head block the host sums the blocks' rows (GLM-5: 64 heads per
rank, one block, the kernel writes P directly).  Head counts that are not a multiple of 64 are zero-padded with
lse = +inf (no contribution); K is padded with -1 to a multiple of block_n.  One kernel is compiled lazily per
(heads, d_v, d_rope, padded K, scale, config) and cached; the token count and Tk are dynamic.

``TilelangBackend.indexer_kl_loss`` uses it for the target when the forward's lse is given (the normal training
path); the fused indexer side of the loss (logits, KL and its gradients: ``triton_kl._indexer_kl_kernel``) stays
Triton's.  Without attn_lse, or for shapes the kernel does not take, the whole loss is the Triton backend's, with a
warning logged once per reason.

Verified on a CPU-only machine with tilelang 0.1.15: both configurations lower to CUDA for sm_90a and nvcc 13.0
compiles them (ptxas: 168 registers, no spills, 217 KB of shared memory for PROB_CONFIG; 164 registers, no spills,
161 KB for PLAIN_PROB_CONFIG; tests/test_ops_tilelang_kl.py).  On the H200 (2026-11-30, tilelang 0.1.15 carried as
wheels) its @pytest.mark.gpu tests pass: both configurations against the fp32 reference (given the reference lse)
and the Triton head sums (given our forward's lse) at GLM-5 shapes, causal and packed, rel. L2 <= 1e-3 (measured
5e-8 against Triton), NaN-poisoned outputs, padded heads (16, 80), rows without keys; and the loss with its
gradients through ``TilelangBackend.indexer_kl_loss`` against the Triton backend's (rel. 1e-3).  Speed at S 4096,
top-k 2048: 3.64 ms (plain loop: 4.01) vs the Triton kernel's 3.43 ms -- ours is 6 % slower.
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
from typing import Optional

import torch

from .base import pad_topk
from .tilelang_sparse_mla import (HEAD_BLOCK, LOG2E, check_tiles, compiled_kernel, query_loader, selected_scores,
                                  tilelang_unsupported_reason)

__all__ = ["build_head_probs", "tilelang_head_summed_probs", "head_probs_unsupported_reason", "PROB_CONFIG",
           "PLAIN_PROB_CONFIG"]

#: kv rows gathered per step, threads per block (two warpgroups), software-pipeline stages of the gather loop
#: (0: a plain loop; 2: cp.async gather of the next block overlapping this block's math), and how the tile is summed
#: over its heads (smem_sum False: T.reduce_sum of the register tile; True: through a shared fp32 copy of the tile).
#: H200, S 4096, causal, top-k 2048: PROB_CONFIG 3.63 ms, PLAIN_PROB_CONFIG 4.00 ms (Triton: 3.43 ms); 64 rows with
#: two stages leave no room for smem_sum's 16 KB (233 KB > 227 KB).
PROB_CONFIG = dict(block_n=64, threads=256, num_stages=2, smem_sum=False)
PLAIN_PROB_CONFIG = dict(block_n=64, threads=256, num_stages=0, smem_sum=True)



def build_head_probs(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, block_n: int = 64,
                     threads: int = 256, num_stages: int = 2, smem_sum: bool = False, dtype: str = "bfloat16"):
    """The TileLang prim_func of the one-pass head sums for these static sizes (see the module docstring).

    Arguments of the kernel: Q [n_q, heads, d_v + d_rope], KV [n_kv, d_v + d_rope], Idx int32 [n_q, topk],
    Lse fp32 [n_q, heads] (natural log; -inf or +inf: the head contributes nothing), Part fp32
    [n_q, heads / 64, topk] (written: each head block's sum).  n_q and n_kv are dynamic.
    heads must be a multiple of HEAD_BLOCK and topk a multiple of block_n.
    """
    import tilelang.language as T

    check_tiles(heads, topk, block_n)
    d_qk = d_v + d_rope
    hb_n = heads // HEAD_BLOCK
    n_blocks = topk // block_n
    acc_t, idx_t = "float32", "int32"
    c_log2 = float(softmax_scale) * LOG2E
    row_groups = max(1, threads // block_n)  # partial column sums per column in the shared-memory reduction
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    load_query, gather_and_score = query_loader(d_v, d_qk), selected_scores(block_n, d_v, d_rope)

    @T.prim_func
    def head_probs_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        Lse: T.Tensor((n_q, heads), acc_t),
        Part: T.Tensor((n_q, hb_n, topk), acc_t),
    ):
        with T.Kernel(n_q, hb_n, threads=threads) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            k_lat = T.alloc_shared((block_n, d_v), dtype)
            k_rope = T.alloc_shared((block_n, d_rope), dtype)
            s = T.alloc_fragment((HEAD_BLOCK, block_n), acc_t)
            col = T.alloc_fragment((block_n,), acc_t)
            lse2 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            if smem_sum:
                s_sh = T.alloc_shared((HEAD_BLOCK, block_n), acc_t)
                part_sh = T.alloc_shared((row_groups, block_n), acc_t)

            h0 = hb * HEAD_BLOCK
            load_query(Q, tok, h0, q_lat, q_rope)
            for i in T.Parallel(HEAD_BLOCK):
                # natural log -> log2 units of the scaled scores; -inf (a head without keys) -> +inf: p = 0
                lse2[i] = T.if_then_else(Lse[tok, h0 + i] == -T.infinity(acc_t), T.infinity(acc_t),
                                         Lse[tok, h0 + i] * LOG2E)

            for kb in (T.Pipelined(n_blocks, num_stages=num_stages) if num_stages > 0 else T.serial(n_blocks)):
                gather_and_score(KV, Idx, tok, kb, n_kv, q_lat, q_rope, k_lat, k_rope, s)  # unused slots zeroed:
                for i, j in T.Parallel(HEAD_BLOCK, block_n):
                    sel = Idx[tok, kb * block_n + j]
                    s[i, j] = T.if_then_else((sel >= 0) and (sel < n_kv), T.exp2(s[i, j] * c_log2 - lse2[i]), 0)
                if smem_sum:  # through shared memory: each thread sums 64 / row_groups heads of one column
                    T.copy(s, s_sh)
                    for g, j in T.Parallel(row_groups, block_n):
                        part_sh[g, j] = 0
                        for r in T.serial(HEAD_BLOCK // row_groups):
                            part_sh[g, j] += s_sh[g * (HEAD_BLOCK // row_groups) + r, j]
                    for j in T.Parallel(block_n):
                        col[j] = 0
                        for g in T.serial(row_groups):
                            col[j] += part_sh[g, j]
                else:  # a reduction of the register tile over its rows (warp shuffles + shared memory)
                    T.reduce_sum(s, col, dim=0)
                T.copy(col, Part[tok, hb, kb * block_n:(kb + 1) * block_n])

    return head_probs_kernel


def _compiled(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, cfg: dict):
    return compiled_kernel(build_head_probs, heads, d_v, d_rope, topk, float(softmax_scale), **cfg)


def head_probs_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int,
                                  attn_lse: Optional[torch.Tensor]) -> Optional[str]:
    """Why our TileLang head sums cannot take these inputs (None when they can)."""
    if attn_lse is None:
        return "the TileLang KL target needs the sparse forward's lse (attn_lse)"
    why = tilelang_unsupported_reason(q, kv, d_v)
    if why is not None:
        return why.replace("TileLang forward", "TileLang KL target")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        return f"indices must be [T={q.shape[0]}, topk], got {tuple(indices.shape)}"
    return None


def tilelang_head_summed_probs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                               d_v: int, attn_lse: torch.Tensor, config: Optional[dict] = None,
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, K] fp32: sum over heads of softmax_j(scale * q[t, h] . kv[indices[t, j]]) (0 on unused slots), from the
    sparse forward's attn_lse [T, h] (natural log); same contract as ``triton_kl.head_summed_probs`` with attn_lse
    given.  out may be given (contiguous fp32 [T, K], written in full)."""
    why = head_probs_unsupported_reason(q, kv, indices, d_v, attn_lse)
    if why is not None:
        raise ValueError(why)
    cfg = dict(PROB_CONFIG, **(config or {}))
    n_q, h, d_qk = q.shape
    topk = indices.shape[1]
    if attn_lse.shape != (n_q, h):
        raise ValueError(f"attn_lse must be [T={n_q}, h={h}], got {tuple(attn_lse.shape)}")
    p = torch.empty(n_q, topk, dtype=torch.float32, device=q.device) if out is None else out
    if n_q == 0 or topk == 0:
        return p
    h_pad = -(-h // HEAD_BLOCK) * HEAD_BLOCK
    q_k = q.detach().contiguous()
    lse = attn_lse.detach().float().contiguous()
    if h_pad != h:  # zero heads up to a whole head block; lse +inf: they contribute nothing
        q_k = torch.nn.functional.pad(q_k, (0, 0, 0, h_pad - h))
        lse = torch.nn.functional.pad(lse, (0, h_pad - h), value=float("inf"))
    idx = pad_topk(indices, cfg["block_n"])
    k_pad, hb_n = idx.shape[1], h_pad // HEAD_BLOCK
    direct = hb_n == 1 and k_pad == topk and p.is_contiguous()
    part = p.view(n_q, 1, topk) if direct else torch.empty(n_q, hb_n, k_pad, dtype=torch.float32, device=q.device)
    kernel = _compiled(h_pad, d_v, d_qk - d_v, k_pad, softmax_scale, cfg)
    kernel(q_k, kv.detach().contiguous(), idx, lse, part)
    if not direct:
        p.copy_(part.sum(dim=1)[:, :topk])
    return p
