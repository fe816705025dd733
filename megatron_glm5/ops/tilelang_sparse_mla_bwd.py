"""Our TileLang sparse MLA backward (dq, dkv) for ``--attn tilelang``.

Semantics are those of ``triton_sparse_mla.sparse_mla_bwd``: q [T, h, D] with D = d_v + d_rope (GLM-5: 512 latent
+ 64 rope; the latent part of kv is also V), kv [Tk, D] shared by all heads, indices [T, K] int (-1 or >= Tk:
unused), out [T, h, d_v] and lse [T, h] (fp32, natural log of the scaled scores, -inf for a row without keys) from
the forward, d_out [T, h, d_v] and d_lse [T, h] or None.  Returns dq like q and dkv like kv.  d_lse is honoured the
same way as the Triton backward: Delta = rowsum(out * d_out) - d_lse.

The kernel (``build_sparse_bwd``): one thread block per (query token, group of HEAD_BLOCK = 64 heads), the heads
the M dimension of the matrix products.  Prologue: q (latent and rope parts) and d_out of the 64 heads into shared
memory, Delta = rowsum(d_out * out) - d_lse computed there (no separate preprocess launch and no fp32 copies of
out / d_out on the host), lse turned into base 2 (-inf, a row without keys, becomes +inf so that p = 0).  Then the
K selected kv rows are gathered block_n at a time into shared memory (an unused slot reads a clamped row and gets
p = 0), and per block:
    s  = q_lat k_lat^T + q_rope k_rope^T,  p = exp2(s * scale * log2 e - lse * log2 e)  (0 for unused slots)
    dp = d_out k_lat^T,                     ds = p * (dp - Delta) * scale
    dq += ds k  (fp32, in registers for the whole loop)
    dk  = ds^T q  (+ p^T d_out on the latent part)  -> fp32 atomic adds into a zeroed fp32 [Tk, D] buffer
p and ds are rounded to bf16 for the products (accumulation fp32), as in the Triton backward.  The latent dk is
computed dkv_cols columns at a time (a [block_n, dkv_cols] fp32 fragment instead of [block_n, d_v]) to keep the
register file for dq.  Atomic adds make the summation order -- and so the last bits of dkv -- not reproducible.
Host side (``tilelang_sparse_bwd``): heads zero-padded to a multiple of 64 (padded heads get lse -inf: no
contribution), top-k padded with -1 to a multiple of block_n (``base.pad_topk``), dkv cast to kv's
dtype at the end.  One kernel is compiled lazily per (heads, d_v, d_rope, padded K, scale, config) and cached; the
token count and Tk are dynamic.

Falls back to ``triton_sparse_mla.sparse_mla_bwd``, with a warning logged once per reason: deterministic mode
(``deterministic=True`` or GLM5_TRITON_DETERMINISTIC=1; there is no deterministic dkv reduction here), and every
shape the kernel does not take (the forward's rules: bf16, power-of-two d_v and d_rope >= 16).

Verified: on a CPU-only machine with tilelang 0.1.15 the kernel lowers to CUDA source for sm_90a and nvcc 13.0
compiles it to a cubin (``lower_artifact``; tests/test_ops_tilelang.py).  ptxas for sm_90a: 255 registers, no
spills, 181 KB of dynamic shared memory (NARROW_BWD_CONFIG); 255 registers, no spills, 225 KB (BWD_CONFIG; the H200
allows 227 KB).  On the H200 (2026-11-30) the @pytest.mark.gpu tests in tests/test_ops_tilelang.py pass: dq / dkv
against the fp32 torch reference, rel. L2 <= 1e-2, both configurations, causal and packed, padded heads, rows
without keys, with and without d_lse.
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
from typing import Optional, Tuple

import torch

from .base import pad_topk, warn_once
from .tilelang_sparse_mla import (HEAD_BLOCK, LOG2E, compiled_kernel, query_loader, selected_scores,
                                  tilelang_unsupported_reason)

__all__ = ["build_sparse_bwd", "tilelang_sparse_bwd", "tilelang_bwd_unsupported_reason", "NARROW_BWD_CONFIG",
           "BWD_CONFIG"]

#: kv rows gathered per step, threads per block (two warpgroups), latent dkv columns per product / atomic pass.
#: BWD_CONFIG (the default): 64 rows (M = 64: wgmma for every product, 225 KB of shared memory -- just under the
#: H200's 227 KB); NARROW_BWD_CONFIG: 32 rows (the dk products, M = 32, are mma.sync).  On the H200 the default
#: measured 265 vs 191 TFLOP/s at S 4096 and 210 vs 163 at S 32768 (docs/performance.md).
BWD_CONFIG = dict(block_n=64, threads=256, dkv_cols=128)
NARROW_BWD_CONFIG = dict(block_n=32, threads=256, dkv_cols=256)



def build_sparse_bwd(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, block_n: int = 32,
                     threads: int = 256, dkv_cols: int = 256, dtype: str = "bfloat16"):
    """The TileLang prim_func of the sparse MLA backward for these static sizes (see the module docstring).

    Arguments of the kernel: Q [n_q, heads, d_v + d_rope], KV [n_kv, d_v + d_rope], Idx int32 [n_q, topk],
    Out [n_q, heads, d_v], dO [n_q, heads, d_v], Lse fp32 [n_q, heads], dLse fp32 [n_q, heads] (zeros when lse
    has no gradient), dQ [n_q, heads, d_v + d_rope] (written), dKV fp32 [n_kv, d_v + d_rope] (zeroed by the caller,
    atomically accumulated); n_q and n_kv are dynamic.  heads must be a multiple of HEAD_BLOCK, topk of block_n and
    d_v of dkv_cols.
    """
    if heads % HEAD_BLOCK or topk % block_n or d_v % dkv_cols:
        raise ValueError(f"heads ({heads}) must be a multiple of {HEAD_BLOCK}, topk ({topk}) of {block_n} and "
                         f"d_v ({d_v}) of dkv_cols ({dkv_cols})")
    import tilelang.language as T
    d_qk = d_v + d_rope
    hb_n = heads // HEAD_BLOCK
    n_blocks = topk // block_n
    n_col_chunks = d_v // dkv_cols
    acc_t, idx_t = "float32", "int32"
    scale = float(softmax_scale)
    c_log2 = scale * LOG2E
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    load_query, gather_and_score = query_loader(d_v, d_qk), selected_scores(block_n, d_v, d_rope)

    @T.prim_func
    def sparse_mla_bwd_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        Out: T.Tensor((n_q, heads, d_v), dtype),
        dO: T.Tensor((n_q, heads, d_v), dtype),
        Lse: T.Tensor((n_q, heads), acc_t),
        dLse: T.Tensor((n_q, heads), acc_t),
        dQ: T.Tensor((n_q, heads, d_qk), dtype),
        dKV: T.Tensor((n_kv, d_qk), acc_t),
    ):
        with T.Kernel(n_q, hb_n, threads=threads) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            do_s = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            k_lat = T.alloc_shared((block_n, d_v), dtype)
            k_rope = T.alloc_shared((block_n, d_rope), dtype)
            p_s = T.alloc_shared((HEAD_BLOCK, block_n), dtype)
            ds_s = T.alloc_shared((HEAD_BLOCK, block_n), dtype)

            delta_s = T.alloc_shared((HEAD_BLOCK,), acc_t)

            od = T.alloc_fragment((HEAD_BLOCK, dkv_cols), acc_t)  # prologue only: a slice of out * d_out
            od_sum = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            delta = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            lse2 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            s = T.alloc_fragment((HEAD_BLOCK, block_n), acc_t)
            dp = T.alloc_fragment((HEAD_BLOCK, block_n), acc_t)
            dq_lat = T.alloc_fragment((HEAD_BLOCK, d_v), acc_t)
            dq_rope = T.alloc_fragment((HEAD_BLOCK, d_rope), acc_t)
            dk_lat = T.alloc_fragment((block_n, dkv_cols), acc_t)
            dk_rope = T.alloc_fragment((block_n, d_rope), acc_t)

            h0 = hb * HEAD_BLOCK
            load_query(Q, tok, h0, q_lat, q_rope)
            T.copy(dO[tok, h0:h0 + HEAD_BLOCK, :], do_s)

            # Delta = rowsum(out * d_out) - d_lse, dkv_cols columns at a time; through shared memory into the
            # fragment layout of the score tiles
            for i in T.Parallel(HEAD_BLOCK):
                delta_s[i] = -dLse[tok, h0 + i]
            for cc in T.serial(n_col_chunks):
                for i, c in T.Parallel(HEAD_BLOCK, dkv_cols):
                    od[i, c] = (T.cast(Out[tok, h0 + i, cc * dkv_cols + c], acc_t)
                                * T.cast(do_s[i, cc * dkv_cols + c], acc_t))
                T.reduce_sum(od, od_sum, dim=1)
                for i in T.Parallel(HEAD_BLOCK):
                    delta_s[i] = delta_s[i] + od_sum[i]
            for i in T.Parallel(HEAD_BLOCK):
                delta[i] = delta_s[i]
                lse2[i] = T.if_then_else(Lse[tok, h0 + i] == -T.infinity(acc_t), T.infinity(acc_t),
                                         Lse[tok, h0 + i] * LOG2E)

            T.fill(dq_lat, 0)
            T.fill(dq_rope, 0)
            for kb in T.serial(n_blocks):
                gather_and_score(KV, Idx, tok, kb, n_kv, q_lat, q_rope, k_lat, k_rope, s)
                T.gemm(do_s, k_lat, dp, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(HEAD_BLOCK, block_n):
                    sel = Idx[tok, kb * block_n + j]
                    s[i, j] = T.if_then_else((sel >= 0) and (sel < n_kv), T.exp2(s[i, j] * c_log2 - lse2[i]), 0)
                    dp[i, j] = s[i, j] * (dp[i, j] - delta[i]) * scale
                T.copy(s, p_s)
                T.copy(dp, ds_s)

                T.gemm(ds_s, k_lat, dq_lat)
                T.gemm(ds_s, k_rope, dq_rope)

                T.gemm(ds_s, q_rope, dk_rope, transpose_A=True, clear_accum=True)
                for j, c in T.Parallel(block_n, d_rope):
                    sel = Idx[tok, kb * block_n + j]
                    if (sel >= 0) and (sel < n_kv):
                        T.atomic_add(dKV[sel, d_v + c], dk_rope[j, c])
                for cc in T.serial(n_col_chunks):
                    T.gemm(ds_s, q_lat[:, cc * dkv_cols:(cc + 1) * dkv_cols], dk_lat, transpose_A=True,
                           clear_accum=True)
                    T.gemm(p_s, do_s[:, cc * dkv_cols:(cc + 1) * dkv_cols], dk_lat, transpose_A=True)
                    for j, c in T.Parallel(block_n, dkv_cols):
                        sel = Idx[tok, kb * block_n + j]
                        if (sel >= 0) and (sel < n_kv):
                            T.atomic_add(dKV[sel, cc * dkv_cols + c], dk_lat[j, c])

            T.copy(dq_lat, dQ[tok, h0:h0 + HEAD_BLOCK, 0:d_v])
            T.copy(dq_rope, dQ[tok, h0:h0 + HEAD_BLOCK, d_v:d_qk])

    return sparse_mla_bwd_kernel


def _compiled(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, cfg: dict):
    return compiled_kernel(build_sparse_bwd, heads, d_v, d_rope, topk, float(softmax_scale), **cfg)


def tilelang_bwd_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int,
                                    cfg: Optional[dict] = None) -> Optional[str]:
    """Why our TileLang backward cannot take these inputs (None when it can)."""
    why = tilelang_unsupported_reason(q, kv, d_v)
    if why is not None:
        return why.replace("TileLang forward", "TileLang backward")
    cols = dict(NARROW_BWD_CONFIG, **(cfg or {}))["dkv_cols"]
    if d_v % cols:
        return f"the TileLang backward needs d_v a multiple of dkv_cols = {cols}, got {d_v}"
    return None


def _resolve_deterministic(deterministic: Optional[bool]) -> bool:
    if deterministic is not None:
        return bool(deterministic)
    from . import triton_sparse_mla

    return triton_sparse_mla.deterministic_default()


def tilelang_sparse_bwd(q, kv, indices, out, lse, d_out, d_lse, softmax_scale: float, d_v: int,
                        deterministic: Optional[bool] = None, config: Optional[dict] = None,
                        dq: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dq like q, dkv like kv) from our TileLang kernel; same signature and contract as
    ``triton_sparse_mla.sparse_mla_bwd`` (d_lse may be None; dq may be given: contiguous, written in full).
    Deterministic mode and shapes the kernel does not take go to the Triton backward (warning logged once)."""
    cfg = dict(NARROW_BWD_CONFIG, **(config or {}))
    why = tilelang_bwd_unsupported_reason(q, kv, d_v, cfg)
    if why is None and _resolve_deterministic(deterministic):
        why = "the TileLang backward has no deterministic dkv reduction (deterministic mode)"
    if why is not None:
        from . import triton_sparse_mla

        warn_once("tilelang", why)
        return triton_sparse_mla.sparse_mla_bwd(q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v,
                                                deterministic, dq=dq)
    n_q, h, d_qk = q.shape
    n_kv = kv.shape[0]
    h_pad = -(-h // HEAD_BLOCK) * HEAD_BLOCK
    pad = h_pad - h
    dev = q.device
    d_lse = torch.zeros(n_q, h, dtype=torch.float32, device=dev) if d_lse is None else d_lse.float()
    q_k, out_k, do_k = q.contiguous(), out.to(q.dtype).contiguous(), d_out.to(q.dtype).contiguous()
    lse_k, dlse_k = lse.float().contiguous(), d_lse.contiguous()
    if pad:  # zero heads up to a whole head block; lse -inf makes them contribute nothing
        q_k = torch.nn.functional.pad(q_k, (0, 0, 0, pad))
        out_k = torch.nn.functional.pad(out_k, (0, 0, 0, pad))
        do_k = torch.nn.functional.pad(do_k, (0, 0, 0, pad))
        lse_k = torch.nn.functional.pad(lse_k, (0, pad), value=float("-inf"))
        dlse_k = torch.nn.functional.pad(dlse_k, (0, pad))
    idx = pad_topk(indices, cfg["block_n"])
    dq_k = dq if dq is not None and not pad else torch.empty(n_q, h_pad, d_qk, dtype=q.dtype, device=dev)
    dkv = torch.zeros(n_kv, d_qk, dtype=torch.float32, device=dev)
    if n_q > 0 and n_kv > 0:
        kernel = _compiled(h_pad, d_v, d_qk - d_v, idx.shape[1], softmax_scale, cfg)
        kernel(q_k, kv.contiguous(), idx, out_k, do_k, lse_k, dlse_k, dq_k, dkv)
    else:
        dq_k.zero_()
    if pad:
        if dq is not None:
            dq.copy_(dq_k[:, :h])
            dq_k = dq
        else:
            dq_k = dq_k[:, :h].contiguous()
    return dq_k, dkv.to(kv.dtype)
