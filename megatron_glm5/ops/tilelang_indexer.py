"""``--attn tilelang``'s lightning-indexer top-k: our TileLang scoring kernel + the shared exact top-k driver.

score[t, j] = sum_h w[t, h] * relu(softmax_scale * q_idx[t, h] . k_idx[j]) over the window
key_start[t] <= j <= query_end[t], fp32 accumulation of the bf16 products (``reference.indexer_topk``).

The kernel (``build_score_keys``) writes, for one query chunk of ``triton_indexer.chunked_topk`` (rows queries,
the chunk's key rows lo .. lo + width - 1), the same int64 sortable keys as the Triton kernel: the order-preserving
int32 of the fp32 score in the high half (-0.0 written as +0.0, -inf outside the window), 2^32 - 1 - (j - lo) in
the low half; ``chunked_topk`` then runs ``torch.topk`` on them, so the result is exactly the reference's order
(descending score, ties -> smaller key row) and -1 padding.  The kernel receives the chunk's slices
(q [rows * heads, Di], k [width, Di], w fp32 [rows, heads], key_start - lo and query_end - lo as int32), so rows
and width are its only dynamic sizes.

One thread block per (block_q = block_m / heads queries, n_iters * block_n keys); GLM-5 (32 heads, Di 128):
4 queries, 4 x 128 keys.  The block's queries (all their heads: 128 rows of Di) stay in shared memory; for each
tile of block_n key rows one GEMM k_tile [block_n, Di] x q^T [Di, block_q * heads] in fp32 (wgmma), then relu of
the scaled products times w, a sum over each query's heads (the fragment viewed as [block_n, block_q, heads]),
the scores staged through shared memory so that the int64 keys are written coalesced.  Tiles outside every
window of the block's queries (the causal future) skip the GEMM and write -inf keys.  Two configurations:
INDEXER_CONFIG (plain loop, synchronous loads) and PIPELINED_INDEXER_CONFIG (T.Pipelined, two stages: TileLang
makes it warp-specialised, a producer warpgroup loading the key tiles with TMA).  ptxas for sm_90a (nvcc 13.0):
128 registers, no spills, 68608 bytes of dynamic shared memory (default); 168 registers (384 threads: a producer
warpgroup + two consumers), no spills, 101376 bytes dynamic + 1 KB static (pipelined).  Kernels are compiled
lazily, one per (heads, Di, scale, config).

Verified: on the CPU machine (tilelang 0.1.15) both configurations lower for sm_90a and nvcc 13.0 compiles them;
the host side is tested against a stand-in kernel (tests/test_ops_tilelang_indexer.py).  On an H200 (2026-11-30,
tilelang 0.1.15 carried as wheels) its 10 ``@pytest.mark.gpu`` tests passed: top-k lists identical to the reference
at exact inputs (GLM-5 shapes, S 4096, top-k 2048, causal and packed, both configurations; 16 heads x 64 with
tails, several chunks and empty windows), scores decoded from the keys within rel. L2 1e-5 of the fp32 reference,
-0.0 written as +0.0, every entry written.  Causal, top-k 2048, one call (scores = total - the same driver without
scores): S 4096 1.71 ms total (scores ~0.49) vs Triton 1.83 (~0.61); S 32768 34.4 ms (~14.3) vs Triton 50.5
(~30.4).  The pipelined configuration is no faster (1.71 / 35.0 ms).

Taken: bf16 q_idx / k_idx, heads a power of two in [8, block_m], Di a power of two in [32, 256] (run on the GPU:
32 x 128 and 16 x 64);
``indexer_unsupported_reason`` says why not otherwise (``TilelangBackend.indexer_topk`` then uses the Triton
kernel, with a warning logged once).
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
from typing import Optional

import torch

from .tilelang_sparse_mla import compiled_kernel

__all__ = ["build_score_keys", "indexer_unsupported_reason", "tilelang_indexer_topk", "INDEXER_CONFIG",
           "PIPELINED_INDEXER_CONFIG"]

#: block_m: query-head rows per block (block_m / heads queries: the GEMM's N); block_n: key rows per GEMM (its M);
#: n_iters: key tiles per block (the queries are loaded once for them); num_stages 0: a plain loop, 2: pipelined
INDEXER_CONFIG = dict(block_m=128, block_n=128, n_iters=4, threads=256, num_stages=0)
PIPELINED_INDEXER_CONFIG = dict(block_m=128, block_n=128, n_iters=4, threads=256, num_stages=2)



def build_score_keys(heads: int, dim: int, softmax_scale: float, block_m: int = 128, block_n: int = 128,
                     n_iters: int = 4, threads: int = 256, num_stages: int = 0, dtype: str = "bfloat16"):
    """The TileLang prim_func writing one chunk's sortable keys (see the module docstring).

    Arguments of the kernel: Q [rows * heads, dim], K [width, dim], W fp32 [rows, heads], KS / QE int32 [rows]
    (window bounds relative to K's first row), Out int64 [rows, width] (written in full); rows and width are dynamic.
    """
    import tilelang.language as T

    if block_m % heads:
        raise ValueError(f"heads ({heads}) must divide block_m ({block_m})")
    block_q = block_m // heads
    span = block_n * n_iters
    acc_t, i32, i64 = "float32", "int32", "int64"  # names, not string literals, in the annotations
    scale = float(softmax_scale)
    rows = T.dynamic("rows")
    width = T.dynamic("width")

    @T.prim_func
    def indexer_score_keys_kernel(
        Q: T.Tensor((rows * heads, dim), dtype),
        K: T.Tensor((width, dim), dtype),
        W: T.Tensor((rows, heads), acc_t),
        KS: T.Tensor((rows,), i32),
        QE: T.Tensor((rows,), i32),
        Out: T.Tensor((rows, width), i64),
    ):
        with T.Kernel(T.ceildiv(width, span), T.ceildiv(rows, block_q), threads=threads) as (kb, qb):
            q_s = T.alloc_shared((block_m, dim), dtype)
            k_s = T.alloc_shared((block_n, dim), dtype)
            w_s = T.alloc_shared((block_q, heads), acc_t)
            ks_s = T.alloc_shared((block_q,), i32)
            qe_s = T.alloc_shared((block_q,), i32)
            z_s = T.alloc_shared((block_q, block_n), acc_t)
            s = T.alloc_fragment((block_n, block_m), acc_t)
            s3 = T.reshape(s, (block_n, block_q, heads))
            z = T.alloc_fragment((block_n, block_q), acc_t)
            lo_b = T.alloc_var(i32)
            hi_b = T.alloc_var(i32)

            q0 = qb * block_q
            T.copy(Q[q0 * heads:(q0 + block_q) * heads, :], q_s)  # rows past the end read as 0
            for i, h in T.Parallel(block_q, heads):
                w_s[i, h] = T.if_then_else(q0 + i < rows, W[T.min(q0 + i, rows - 1), h], 0)
            for i in T.Parallel(block_q):  # queries past the end get an empty window
                ks_s[i] = T.if_then_else(q0 + i < rows, KS[T.min(q0 + i, rows - 1)], 1)
                qe_s[i] = T.if_then_else(q0 + i < rows, QE[T.min(q0 + i, rows - 1)], 0)
            # the union of the block's non-empty windows: tiles outside it skip the GEMM
            lo_b = width
            hi_b = -1
            for i in T.serial(block_q):
                if q0 + i < rows and KS[T.min(q0 + i, rows - 1)] <= QE[T.min(q0 + i, rows - 1)]:
                    lo_b = T.min(lo_b, KS[q0 + i])
                    hi_b = T.max(hi_b, QE[q0 + i])

            for it in (T.Pipelined(n_iters, num_stages=num_stages) if num_stages > 0 else T.serial(n_iters)):
                k0 = kb * span + it * block_n
                T.copy(K[k0:k0 + block_n, :], k_s)  # rows past the end read as 0
                T.clear(s)
                if k0 <= hi_b and k0 + block_n > lo_b:
                    T.gemm(k_s, q_s, s, transpose_B=True)
                for j, i, h in T.Parallel(block_n, block_q, heads):
                    s3[j, i, h] = T.max(s3[j, i, h] * scale, 0) * w_s[i, h]
                T.reduce_sum(s3, z, dim=2)
                for j, i in T.Parallel(block_n, block_q):
                    z_s[i, j] = z[j, i]
                for i, j in T.Parallel(block_q, block_n):
                    inside = (k0 + j >= ks_s[i]) and (k0 + j <= qe_s[i])
                    bits = T.reinterpret(T.if_then_else(inside, z_s[i, j], -T.infinity(acc_t)), i32)
                    # order-preserving int32: negatives reversed (bits ^ 0x7FFFFFFF); -0.0 (-> -1) ties with +0.0
                    flipped = bits ^ 0x7FFFFFFF
                    ordered = T.if_then_else(bits >= 0, bits, T.if_then_else(flipped == -1, 0, flipped))
                    if q0 + i < rows and k0 + j < width:
                        Out[q0 + i, k0 + j] = (T.Cast(i64, ordered) * T.int64(4294967296)
                                               + (T.int64(4294967295) - T.Cast(i64, k0 + j)))

    return indexer_score_keys_kernel


def _compiled(heads: int, dim: int, softmax_scale: float, cfg: dict):
    return compiled_kernel(build_score_keys, heads, dim, float(softmax_scale), **cfg)


def indexer_unsupported_reason(q_idx: torch.Tensor, k_idx: torch.Tensor,
                               config: Optional[dict] = None) -> Optional[str]:
    """Why our TileLang indexer kernel cannot take these inputs (None when it can)."""
    block_m = dict(INDEXER_CONFIG, **(config or {}))["block_m"]
    if q_idx.dim() != 3 or k_idx.dim() != 2:
        return None  # not a shape question: chunked_topk raises the usual error
    if q_idx.dtype != torch.bfloat16 or k_idx.dtype != torch.bfloat16:
        return f"the TileLang indexer is bf16 only (got {q_idx.dtype} / {k_idx.dtype})"
    heads, dim = q_idx.shape[1:]
    if heads < 8 or heads > block_m or heads & (heads - 1):
        return f"the TileLang indexer needs a power-of-two head count in [8, {block_m}], got {heads}"
    if dim < 32 or dim > 256 or dim & (dim - 1):
        return f"the TileLang indexer needs a power-of-two index head dim in [32, 256], got {dim}"
    return None


@torch.no_grad()
def tilelang_indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, config=None):
    """Same contract as ``reference.indexer_topk`` (int32 [T, topk], -1 padded), scores by our TileLang kernel."""
    from . import triton_indexer  # the shared chunked top-k (imports triton)

    triton_indexer.check_shapes(q_idx, k_idx, weights)
    why = indexer_unsupported_reason(q_idx, k_idx, config)
    if why is not None:
        raise ValueError(why)
    cfg = dict(INDEXER_CONFIG, **(config or {}))
    n_q, heads, dim = q_idx.shape
    q2 = q_idx.contiguous().view(n_q * heads, dim)
    k = k_idx.contiguous()
    w = weights.to(torch.float32).contiguous()

    def score_keys(c0, rows, lo, width, ks, qe, keys):
        kernel = _compiled(heads, dim, softmax_scale, cfg)
        kernel(q2[c0 * heads:(c0 + rows) * heads], k[lo:lo + width], w[c0:c0 + rows],
               (ks[c0:c0 + rows] - lo).to(torch.int32), (qe[c0:c0 + rows] - lo).to(torch.int32), keys)

    return triton_indexer.chunked_topk(q_idx, k_idx, weights, topk, key_start, query_end, score_keys, softmax_scale)
