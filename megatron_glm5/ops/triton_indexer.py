"""Triton lightning-indexer top-k: fused scores + sortable keys, then an exact top-k per query chunk.

score[t, j] = sum_h w[t, h] * relu(softmax_scale * q_idx[t, h] . k_idx[j]) over the window
key_start[t] <= j <= query_end[t] (fp32 accumulation of the bf16 products).

Queries are processed in chunks (``reference.windows`` gives each chunk's key range [lo, hi]); the [T, Tk] score
matrix is never built: a chunk holds [rows, hi - lo + 1] int64 keys, rows bounded so that this buffer stays under
``BUFFER_BYTES``.  The Triton kernel writes, for every (query, key) of the chunk, one int64 that orders like
(score descending, position ascending): the fp32 score's bits mapped to an order-preserving int32 in the high half,
(2^32 - 1 - relative position) in the low half; keys outside the window get the -inf score.  All keys of a row are
distinct, so ``torch.topk`` on them is exact and deterministic, and its sorted output is the reference's order
(descending score, ties -> smaller row).  -0.0 scores are written as +0.0 so that equal scores tie.
Slots beyond a query's window size are -1, as in the reference.

``chunked_topk`` is that chunking / top-k driver with the scoring kernel as a parameter (``score_keys`` fills one
chunk's key buffer); ``indexer_topk`` plugs in the Triton kernel, ``tilelang_indexer`` its TileLang kernel.
Given the scores' softmax scale, the driver also leaves under the top-k list the log-sum-exp of each row's selected
scores (``host_windows.remember_selected_lse``), decoded from the sorted keys by ``_selected_lse_kernel``: the
indexer KL's softmax normaliser, which the KL kernel would otherwise find in a pass of its own over the keys.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import host_windows, triton_interpret_compat
from .reference import TOPK_DTYPE, windows

triton_interpret_compat.apply()

BUFFER_BYTES = 512 << 20
MAX_ROWS = 4096
CONFIG = dict(BLOCK_N=128, N_ITERS=4, num_warps=4, num_stages=2)


@triton.jit
def _score_keys_kernel(
    QI, KI, W, KS, QE, OUT,
    stride_qt, stride_qh, stride_kt, stride_wt, stride_ot,
    c0, lo, width, n_heads, scale,
    DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr, IEEE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    t = c0 + r
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DI)
    h_ok = offs_h < n_heads
    q = tl.load(QI + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    w = tl.load(W + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    ks = tl.load(KS + t)
    qe = tl.load(QE + t)
    for it in range(N_ITERS):
        rel = (tl.program_id(1) * N_ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = lo + rel
        inside = rel < width
        ok = inside & (j >= ks) & (j <= qe)
        z = tl.full([BLOCK_N], float("-inf"), tl.float32)
        # key blocks entirely outside the window (e.g. the causal future) skip the product
        if (lo + (tl.program_id(1) * N_ITERS + it) * BLOCK_N <= qe) & (lo + (tl.program_id(1) * N_ITERS + it + 1) * BLOCK_N > ks):
            k = tl.load(KI + tl.where(ok, j, 0)[:, None] * stride_kt + offs_d[None, :], mask=ok[:, None], other=0.0)
            if IEEE:
                a = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                a = tl.dot(q, tl.trans(k))
            a = tl.maximum(a * scale, 0.0)
            zz = tl.sum(a * w[:, None], axis=0)
            zz = tl.where(zz == 0.0, 0.0, zz)  # -0.0 -> +0.0
            z = tl.where(ok, zz, z)
        bits = z.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = ordered * 4294967296 + (4294967295 - rel.to(tl.int64))
        tl.store(OUT + r * stride_ot + rel, key, mask=inside)


@triton.jit
def _selected_lse_kernel(BEST, N_VALID, LSE, stride_b, k, BLOCK: tl.constexpr):
    """LSE[r] = log sum_s exp(score of row r's slot s) over its n_valid first slots of BEST (the sorted keys of
    torch.topk: the fp32 score's order-preserving int32 in the high half, so slot 0 holds the maximum)."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(N_VALID + r), k)
    offs = tl.arange(0, BLOCK)
    m = _decoded_score(tl.load(BEST + r * stride_b))
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, k, BLOCK):
        slot = s0 + offs
        z = _decoded_score(tl.load(BEST + r * stride_b + slot, mask=slot < n, other=0))
        acc += tl.where(slot < n, tl.exp(z - m), 0.0)
    tl.store(LSE + r, tl.where(n > 0, m + tl.log(tl.sum(acc, axis=0)), float("-inf")))


@triton.jit
def _decoded_score(key):
    """The fp32 score of a sortable key (the inverse of the scoring kernels' encoding)."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


def decoded_scores(best: torch.Tensor) -> torch.Tensor:
    """fp32 scores of sortable keys (int64; torch ops, for the CPU)."""
    ordered = torch.div(best, 4294967296, rounding_mode="floor").to(torch.int32)
    return torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).view(torch.float32)


def _selected_lse(best: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: the LSE of each row's first n_valid sorted scores (-inf without any)."""
    rows, k = best.shape
    if triton_interpret_compat.runs_kernels(best):
        lse = torch.empty(rows, dtype=torch.float32, device=best.device)
        if rows:
            _selected_lse_kernel[(rows,)](best, n_valid, lse, best.stride(0), k,
                                          BLOCK=min(1024, triton.next_power_of_2(max(k, 16))))
        return lse
    z = decoded_scores(best).masked_fill(torch.arange(k, device=best.device) >= n_valid[:, None], float("-inf"))
    return torch.logsumexp(z, dim=-1)


def check_shapes(q_idx, k_idx, weights):
    if q_idx.dim() != 3 or k_idx.dim() != 2 or weights.dim() != 2:
        raise ValueError("expected q_idx [T, Hi, Di], k_idx [Tk, Di], weights [T, Hi]")


@torch.no_grad()
def chunked_topk(q_idx, k_idx, weights, topk, key_start, query_end, score_keys, softmax_scale=None):
    """Same contract as ``reference.indexer_topk`` (int32 [T, topk], -1 padded) for any scoring kernel.

    ``score_keys(c0, rows, lo, width, ks, qe, keys)`` must fill ``keys`` (int64 [rows, width], uninitialised) with
    the sortable keys of queries c0 .. c0 + rows - 1 against key rows lo .. lo + width - 1 (see the module
    docstring); ks / qe are key_start / query_end as int64 on q_idx's device.  softmax_scale: the scale the
    scores were computed with; given, the LSE of each row's selected scores is remembered under the result for
    these q_idx, k_idx, weights (``host_windows.remember_selected_lse``).
    """
    check_shapes(q_idx, k_idx, weights)
    n_q, n_k = q_idx.shape[0], k_idx.shape[0]
    topk = int(topk)
    out = torch.full((n_q, topk), -1, dtype=TOPK_DTYPE, device=q_idx.device)
    if n_q == 0 or topk <= 0:
        return out
    win = windows(key_start, query_end, n_q, n_k)
    n_valid = win.n_valid_on(q_idx.device)
    ks = key_start.to(device=q_idx.device, dtype=torch.int64).contiguous()
    qe = query_end.to(device=q_idx.device, dtype=torch.int64).contiguous()
    lse = None
    if softmax_scale is not None:
        lse = torch.full((n_q,), float("-inf"), dtype=torch.float32, device=q_idx.device)
    c0 = 0
    while c0 < n_q:
        rows = min(MAX_ROWS, n_q - c0)
        while True:
            lo, hi = win.span(c0, c0 + rows)
            width = hi - lo + 1
            if rows == 1 or rows * max(width, 1) * 8 <= BUFFER_BYTES:
                break
            rows = max(1, rows // 2)
        if width > 0:
            keys = torch.empty(rows, width, dtype=torch.int64, device=q_idx.device)
            score_keys(c0, rows, lo, width, ks, qe, keys)
            k = min(topk, width)
            best = torch.topk(keys, k, dim=-1, largest=True, sorted=True).values
            pos = 4294967295 - (best & 4294967295) + lo
            slot = torch.arange(k, device=pos.device)
            sel = torch.where(slot[None, :] < n_valid[c0:c0 + rows, None], pos, torch.full_like(pos, -1))
            out[c0:c0 + rows, :k] = sel.to(TOPK_DTYPE)
            if lse is not None:
                lse[c0:c0 + rows] = _selected_lse(best, n_valid[c0:c0 + rows])
        c0 += rows
    host_windows.remember_row_ends(out, win.row_hi)  # the sparse backward sizes its dense products from these
    if lse is not None:  # the indexer KL's softmax normaliser (ops/triton_kl.py)
        host_windows.remember_selected_lse(out, lse, q_idx, k_idx, weights, softmax_scale)
    return out


@torch.no_grad()
def indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=None,
                 config=None):
    """Same contract as ``reference.indexer_topk``: int32 [T, topk], -1 padded."""
    check_shapes(q_idx, k_idx, weights)
    n_heads, d_i = q_idx.shape[1:]
    if d_i & (d_i - 1):
        raise ValueError(f"triton indexer_topk needs a power-of-two index head dim (got {d_i}); use --attn torch")
    cfg = dict(CONFIG, **(config or {}))
    qc, kc, wc = q_idx.contiguous(), k_idx.contiguous(), weights.contiguous()
    tile = cfg["BLOCK_N"] * cfg["N_ITERS"]
    block_h = max(16, triton.next_power_of_2(n_heads))

    def score_keys(c0, rows, lo, width, ks, qe, keys):
        _score_keys_kernel[(rows, triton.cdiv(width, tile))](
            qc, kc, wc, ks, qe, keys,
            qc.stride(0), qc.stride(1), kc.stride(0), wc.stride(0), keys.stride(0),
            c0, lo, width, n_heads, float(softmax_scale),
            DI=d_i, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], N_ITERS=cfg["N_ITERS"],
            IEEE=qc.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    return chunked_topk(q_idx, k_idx, weights, topk, key_start, query_end, score_keys, softmax_scale)
