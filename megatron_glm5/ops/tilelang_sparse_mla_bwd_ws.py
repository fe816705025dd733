"""Our warp-specialised TileLang kernel for the sparse MLA backward's scores step, with cuBLAS for every product
that is a plain GEMM: the ``--attn tilelang`` backward where the dense formulation applies (``backward_kernel``).

The backward of sparse MLA per query t, head h and selected slot j (key k = indices[t, j]):
    p = exp(scale q.kv_k - lse),  dp = dO . v_k,  ds = p (dp - Delta) scale     (Delta = rowsum(dO * O) - d_lse)
    dq[t, h] = sum_j ds kv_k,   dkv[k] += ds q[t, h] (+ p dO[t, h] on the latent part)
Of these, only p and ds need the gather; once p and ds sit in [key, query x head] matrices (the "dense"
formulation of ``triton_sparse_mla``: a query's keys are distinct, so every entry is written once and the rest is
zero) dq and dkv are three cuBLAS GEMMs over the keys below the query chunk's key end (known on the host from the
indexer's row bounds; ``triton_sparse_mla.dense_products``).  This module's kernel writes those matrices; it has no
dq or dkv accumulator, no atomics, so the backward is deterministic in both modes.

The kernel (``build_sparse_pds_ws``): one thread block per (query token, 64 heads), 384 threads in three warpgroups,
the schedule of our warp-specialised forward (tilelang_sparse_mla_ws):
* q (latent + rope) is TMA-loaded into shared memory once; each consumer loads dO [64 heads, d_v] into its own
  registers (the A operand of dp = dO v^T);
* warpgroup 2, the producer, gathers the selected kv rows with cp.async, 64 per block, even blocks into buffer 0 and
  odd ones into buffer 1 (ready / free mbarriers), each block in two halves (``split_ready``, as in the forward: q
  k^T starts on the first 256 latent columns); after the first pair it gathers no row for an unused slot;
* consumer c takes the blocks of buffer c: s = q k^T (576 columns, both operands in shared memory) and dp = dO
  k_lat^T (dO from registers), then p = exp2(s scale log2 e - lse log2 e) (0 for an unused slot) and
  ds = p (dp - Delta) scale; p^T and ds^T go in bf16 into the spent latent part of its buffer (``staged``), the
  column sums of p over the 64 heads (the indexer KL target's head sums, ``head_sums``) are one small product,
  p^T times a ones matrix (TileLang 0.1.15's cross-warp reduce synchronises through named barriers that both
  consumers would share), and each used slot's 64 heads of p and ds are stored as one 128-byte row at
  [key, t, head] of P and DS; then the buffer is free;
* a token's loop stops after the block pair holding its last used slot (``Ends``: the causal padding of early
  tokens is not computed); the head sums of the slots after it are written 0.

Status (2026-12-02, session 11, H200, docs/performance.md): the GPU tests pass (dq / dkv against the fp32
reference at GLM-5 shapes, causal and packed; head sums within 1e-3 of the Triton backward's; bitwise repeatable;
padded heads, rows without keys, d_lse); S 4096 backward 6.84-7.03 ms (415-427 TFLOP/s; the kernel 2.54 ms, the
cuBLAS GEMMs 2.84, the zero fills 0.80) against the Triton backward's 8.60-9.05 and cuDNN's 465 TFLOP/s
(2026-11-30).  ptxas: 168 registers at launch, no spills.

Persistent thread blocks (``persistent``, opt-in, session 21, not yet run on a GPU; benchmark rows ``dsa_kernels.py
--bwd-only --dense-match persistent``): one per SM, each taking token after token as our persistent forward does
(``tilelang_sparse_mla_ws.build_sparse_fwd_ws``) -- the producer loads the next token's q once both consumers are
done with the current one and gathers its first blocks while they finish; each consumer loads the next token's dO,
lse and Delta when done with its own part; each role sums its tokens' steps (read from Ends) for the barriers'
parities.  ptxas (CUDA 13.0, TileLang's flags): 92 bytes spilled against the default's 12 -- in the SASS 29 of the 40
local loads / stores are the producer's (its 24 registers now also hold the loop over tokens), 5 each consumer's.

Shared memory: q 72 KB + two kv buffers of 72 KB; registers: dO 128 per consumer thread + the two fp32 64 x 64
tiles.  Needs heads % 64 == 0 (the wrapper pads; padded heads get lse -inf and write nothing), d_rope == 64, d_v
% 128 == 0, bf16; the top-k slots are padded with -1 to a multiple of 128.
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
from typing import Optional, Tuple

import torch

from . import host_windows
from . import triton_sparse_mla as tsm
from .base import pad_topk, warn_once
from .tilelang_sparse_mla import (HEAD_BLOCK, LOG2E, check_tiles, compiled_kernel, pop_pass_configs,
                                  tilelang_unsupported_reason, with_sm_grid)
from .tilelang_sparse_mla_ws import (LAUNCH_REGS, PRODUCER_THREADS, buffer_filler, check_persistent, item_loop,
                                     kernel_prelude, producer_token, query_tma_loader, scores_product)

__all__ = ["PDS_WS_CONFIG", "build_sparse_pds_ws", "pds_ws_unsupported_reason", "tilelang_sparse_bwd_dense"]

BLOCK_N = 64  # kv rows per block
PAIR = 2 * BLOCK_N  # slots per step of the loop (one block per consumer)
ONES_N = 16  # columns of the ones matrix of the head sums' product (column 0 is read)
#: consumer / producer registers per thread after setmaxnreg (2 x 240 + 24 = 3 x LAUNCH_REGS; ptxas: no spills,
#: where 232 / 40 spilled 12 bytes)
PDS_WS_CONFIG = dict(consumer_regs=240, producer_regs=24, skip_unused=True, fast_math=True, staged=True,
                     bounded=True, split_ready=True)


def build_sparse_pds_ws(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, heads_real: int,
                        topk_real: int, head_sums: bool = True, consumer_regs: int = 240, producer_regs: int = 24,
                        skip_unused: bool = True, write_pds: bool = True, staged: bool = True,
                        bounded: bool = True, kv_hint=None, q_evict_first: bool = False, split_ready: bool = False,
                        async_wgmma: bool = False, persistent: int = 0, dtype: str = "bfloat16"):
    """The TileLang prim_func of the scores step (module docstring) for these static sizes: heads (a multiple of
    64) of which heads_real are real (the column of head h of query t is t * heads_real + h), topk slots (a multiple
    of 128) of which topk_real are the caller's (the head sums' row length).

    Arguments of the kernel (n_q, n_kv and n_kc dynamic): Q [n_q, heads, d_v + d_rope], KV [n_kv, d_v +
    d_rope], Idx int32 [n_q, topk], dO [n_q, heads, d_v], Lse fp32 [n_q, heads] (natural log, -inf: no keys),
    Delta fp32 [n_q, heads], Ends int32 [n_q] (block pairs to compute per query), DS and P [n_kc, n_q, heads_real]
    (zeroed by the caller; every used slot's entries written), HS fp32 [n_q, topk_real] (written in full when
    head_sums).
    write_pds False leaves DS and P unwritten: a diagnostic for the benchmark (the cost of the scattered stores),
    never a result.  staged: p^T / ds^T go through shared memory so that each slot's heads are one contiguous row
    (False: stored from the register tiles).  bounded: each query stops after its last used slot (Ends; False:
    every step, Ends unread).  kv_hint / q_evict_first / split_ready: the L2 hints of the kv gathers and q's TMA
    loads, and the block gathered in two halves (q k^T starts on the first), as in the forward
    (``tilelang_sparse_mla_ws.build_sparse_fwd_ws``).  async_wgmma: a step's q k^T (three parts) and dO v^T issued
    as asynchronous wgmma with one wait after the last, instead of a wait after each (the same products, so the same
    results bit for bit; opt-in, session 20, not yet run on a GPU).  persistent (> 0): that many thread blocks, each
    taking (token, head block) items in turn as in our persistent forward (``build_sparse_fwd_ws``): the producer
    loads the next item's q once both consumers are done with the current one (their last q k^T, ``bar_qfree``) and
    gathers its first blocks while the consumers finish; the consumers load the next item's dO, lse and Delta as
    soon as they are done with the current one; the barriers' parities count on across items (with bounded: each
    role sums its items' steps).  Opt-in, session 21, not yet run on a GPU."""
    import tilelang.language as T

    check_persistent(persistent)
    check_tiles(heads, topk, PAIR)
    if 2 * consumer_regs + producer_regs > 3 * LAUNCH_REGS or consumer_regs % 8 or producer_regs % 8:
        raise ValueError(f"consumer_regs ({consumer_regs}) x 2 + producer_regs ({producer_regs}) must be at most "
                         f"{3 * LAUNCH_REGS} (3 warpgroups x {LAUNCH_REGS} registers at launch), multiples of 8")
    if d_rope != 64 or d_v % 128:
        raise ValueError(f"the scores kernel needs d_rope == 64 and d_v % 128 == 0, got {d_rope} / {d_v}")
    if heads // HEAD_BLOCK > 1 and head_sums:
        raise ValueError("head sums need all heads in one block (heads <= 64)")
    d_qk = d_v + d_rope
    hb_n = heads // HEAD_BLOCK
    n_pairs = topk // PAIR
    acc_t, idx_t = "float32", "int32"
    scale = float(softmax_scale)
    c_log2 = scale * LOG2E
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    n_kc = T.dynamic("n_kc")
    wg = 128
    hs_shape = (n_q, topk_real) if head_sums else (1, 1)  # without head sums: a 1 x 1 placeholder

    qk = scores_product(d_v, split_ready, async_wgmma, wait=False)

    def consumer(c: int):
        """T.macro: consumer warpgroup c's part (block 2 it + c of each step, in kv buffer c); do_f .. hsum: its
        own register tiles (tiles shared by two role branches lose one branch's work in TileLang's lowering)."""

        @T.macro
        def token(tok, h0, dO, Idx, Lse, Delta, DS, P, HS, q_lat, q_rope, k_lat, k_rope, ones, do_f, s, dp, lse2, dlt,
                  hsum, n_it, g0, k_ph, bar_q, bar_ready, bar_free, bar_lo, bar_qfree):
            """One token's part: g0 the steps of the tokens before it (0 unless persistent), k_ph its token count
            mod 2 (bar_q's parity)."""
            T.copy(dO[tok, h0:h0 + HEAD_BLOCK, :], do_f)
            for i in T.Parallel(HEAD_BLOCK):
                lse2[i] = T.if_then_else(Lse[tok, h0 + i] == -T.infinity(acc_t), T.infinity(acc_t),
                                         Lse[tok, h0 + i] * LOG2E)
                dlt[i] = Delta[tok, h0 + i]
            T.barrier_wait(bar_q, k_ph)
            for it in T.serial(n_it):
                qk(q_lat, q_rope, k_lat[c], k_rope[c], s, bar_lo, bar_ready, c, (g0 + it) & 1)
                if async_wgmma:  # dO v^T in flight behind q k^T; one wait for both
                    T.wgmma_gemm(do_f, k_lat[c], dp, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                else:
                    T.gemm(do_f, k_lat[c], dp, transpose_B=True, clear_accum=True)
                if persistent:  # its last q k^T done (waited for above): q's buffers free for the next token
                    if it == n_it - 1:
                        T.barrier_arrive(bar_qfree)
                if not head_sums and not staged:
                    T.barrier_arrive(bar_free[c])
                for i, j in T.Parallel(HEAD_BLOCK, BLOCK_N):
                    sel = Idx[tok, (2 * it + c) * BLOCK_N + j]
                    s[i, j] = T.if_then_else((sel >= 0) and (sel < n_kv), T.exp2(s[i, j] * c_log2 - lse2[i]), 0)
                    dp[i, j] = s[i, j] * (dp[i, j] - dlt[i]) * scale
                if staged:
                    # p^T and ds^T (bf16, [slots, heads]) into the spent latent part of the buffer: columns 0..63
                    # and 64..127; then the head sums (p^T ones) and the rows of P / DS from there, each slot's 64
                    # heads one contiguous 128-byte row; then the buffer is free
                    for i, j in T.Parallel(HEAD_BLOCK, BLOCK_N):
                        k_lat[c][j, i] = T.cast(s[i, j], dtype)
                        k_lat[c][j, HEAD_BLOCK + i] = T.cast(dp[i, j], dtype)
                    if head_sums:
                        T.fence_proxy_async()
                        T.gemm(k_lat[c][:, 0:HEAD_BLOCK], ones, hsum, clear_accum=True)
                        for j, u in T.Parallel(BLOCK_N, ONES_N):
                            if u == 0 and (2 * it + c) * BLOCK_N + j < topk_real:
                                HS[tok, (2 * it + c) * BLOCK_N + j] = hsum[j, u]
                    for j, i in T.Parallel(BLOCK_N, HEAD_BLOCK):
                        sel = Idx[tok, (2 * it + c) * BLOCK_N + j]
                        if write_pds and (sel >= 0) and (sel < n_kv) and (h0 + i < heads_real):
                            P[sel, tok, h0 + i] = k_lat[c][j, i]
                            DS[sel, tok, h0 + i] = k_lat[c][j, HEAD_BLOCK + i]
                    T.barrier_arrive(bar_free[c])
                elif head_sums:
                    # the column sums of p over the heads as a product, p^T ones (bf16 p in the spent rope part of
                    # the buffer; T.reduce_sum over the heads would synchronise through named barriers that the two
                    # consumers share in TileLang 0.1.15); then the buffer is free
                    T.copy(s, k_rope[c])
                    T.fence_proxy_async()
                    T.gemm(k_rope[c], ones, hsum, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(bar_free[c])
                    for j, u in T.Parallel(BLOCK_N, ONES_N):
                        if u == 0 and (2 * it + c) * BLOCK_N + j < topk_real:
                            HS[tok, (2 * it + c) * BLOCK_N + j] = hsum[j, u]
                if not staged:  # straight from the register tiles: 2-byte stores, 16 contiguous bytes per 8 lanes
                    for i, j in T.Parallel(HEAD_BLOCK, BLOCK_N):
                        sel = Idx[tok, (2 * it + c) * BLOCK_N + j]
                        if write_pds and (sel >= 0) and (sel < n_kv) and (h0 + i < heads_real):
                            DS[sel, tok, h0 + i] = T.cast(dp[i, j], dtype)
                            P[sel, tok, h0 + i] = T.cast(s[i, j], dtype)
            if persistent and bounded:  # a token without a step: its q is free at once
                if n_it == 0:
                    T.barrier_arrive(bar_qfree)
            if head_sums and bounded:  # the blocks after the last used pair: no keys, head sums 0
                for it2 in T.serial(n_pairs - n_it):
                    for j in T.Parallel(BLOCK_N):
                        if (2 * (n_it + it2) + c) * BLOCK_N + j < topk_real:
                            HS[tok, (2 * (n_it + it2) + c) * BLOCK_N + j] = T.cast(0, acc_t)

        tokens = item_loop(persistent, bounded, n_pairs, n_q, hb_n, token)

        @T.macro
        def run(tok, h0, dO, Idx, Ends, Lse, Delta, DS, P, HS, q_lat, q_rope, k_lat, k_rope, ones, do_f, s, dp, lse2,
                dlt, hsum, n_it, steps, bar_q, bar_ready, bar_free, bar_lo, bar_qfree):
            """The consumer's whole part: the token and first head of this thread block, or with persistent (tok:
            the thread block, h0 unused) those of each item it takes in turn (persistent and bounded: ``steps`` its
            own [this item's steps, the steps of its items before it])."""
            T.set_max_nreg(consumer_regs, 1)
            tokens(tok, h0, Ends, n_it, steps, (dO, Idx, Lse, Delta, DS, P, HS, q_lat, q_rope, k_lat, k_rope, ones,
                                                do_f, s, dp, lse2, dlt, hsum), (bar_q, bar_ready, bar_free, bar_lo,
                                                                                bar_qfree))

        return run

    consumer0, consumer1 = consumer(0), consumer(1)
    fill = buffer_filler(BLOCK_N, d_v, skip_unused, kv_hint, split_ready)
    load_q = query_tma_loader(d_v, q_evict_first)

    @T.macro
    def produce(KV, Idx, tok, g0, n_kv, k_lat, k_rope, r0, col, row, n_it, bar_free, bar_lo, bar_ready):
        """The producer's gathers of one token: block 2 it + b into buffer b (g0: the steps of the tokens before it,
        for the free barriers' parity)."""
        for it in T.serial(n_it):
            for b in (0, 1):  # Python-unrolled: buffer indices stay Python ints
                fill(KV, Idx, tok, (2 * it + b) * BLOCK_N, it, n_kv, k_lat[b], k_rope[b], r0, col, row, bar_free,
                     ((g0 + it) & 1) ^ 1, bar_lo, bar_ready, b)

    producer_tokens = item_loop(persistent, bounded, n_pairs, n_q, hb_n, producer_token(persistent, load_q, produce))

    @T.prim_func
    def sparse_mla_pds_ws_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        dO: T.Tensor((n_q, heads, d_v), dtype),
        Lse: T.Tensor((n_q, heads), acc_t),
        Delta: T.Tensor((n_q, heads), acc_t),
        Ends: T.Tensor((n_q,), idx_t),
        DS: T.Tensor((n_kc, n_q, heads_real), dtype),
        P: T.Tensor((n_kc, n_q, heads_real), dtype),
        HS: T.Tensor(hs_shape, acc_t),
    ):
        # persistent: a 1-D grid of that many thread blocks (tok: the block; ``hb`` unused)
        with T.Kernel(*((persistent, 1) if persistent else (n_q, hb_n)), threads=3 * wg,
                      prelude=kernel_prelude(kv_hint)) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            k0_lat = T.alloc_shared((BLOCK_N, d_v), dtype)
            k0_rope = T.alloc_shared((BLOCK_N, d_rope), dtype)
            k1_lat = T.alloc_shared((BLOCK_N, d_v), dtype)
            k1_rope = T.alloc_shared((BLOCK_N, d_rope), dtype)
            ones = T.alloc_shared((HEAD_BLOCK, ONES_N), dtype)  # B of the head sums' product
            do0 = T.alloc_fragment((HEAD_BLOCK, d_v), dtype)
            s0 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), acc_t)
            dp0 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), acc_t)
            lse2_0 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            dlt0 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            hsum0 = T.alloc_fragment((BLOCK_N, ONES_N), acc_t)
            do1 = T.alloc_fragment((HEAD_BLOCK, d_v), dtype)
            s1 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), acc_t)
            dp1 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), acc_t)
            lse2_1 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            dlt1 = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            hsum1 = T.alloc_fragment((BLOCK_N, ONES_N), acc_t)
            row = T.alloc_local((1,), idx_t)  # the producer's gathered kv row (block_gatherer)

            # q loaded: by every thread, or (persistent) by the producer, token after token
            bar_q = T.alloc_barrier(arrive_count=wg if persistent else 3 * wg)
            # persistent: both consumers done with a token's q (their last q k^T); None otherwise
            bar_qfree = T.alloc_barrier(arrive_count=2 * wg) if persistent else None
            bar_ready = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * 2)  # kv buffer b gathered
            bar_free = T.alloc_barrier(arrive_count=[wg] * 2)  # kv buffer b read by its consumer
            # split_ready: the first latent half of kv buffer b gathered (None without it: a macro argument bound to
            # bar_ready would rename that barrier in the source)
            bar_lo = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * 2) if split_ready else None

            h0 = hb * HEAD_BLOCK
            tx = T.get_thread_binding()
            n_it = n_pairs  # the steps of this query (a Python int unless bounded)
            if bounded and not persistent:
                n_it = T.alloc_var(idx_t)
                n_it = T.min(Ends[tok], n_pairs)
            # persistent and bounded: each role's [this item's steps, the steps of its items before it]
            steps0 = T.alloc_local((2,), idx_t) if persistent and bounded else None
            steps1 = T.alloc_local((2,), idx_t) if persistent and bounded else None
            steps_p = T.alloc_local((2,), idx_t) if persistent and bounded else None
            if not persistent:
                load_q(Q, tok, h0, q_lat, q_rope, bar_q)
            for i, u in T.Parallel(HEAD_BLOCK, ONES_N):
                ones[i, u] = T.cast(1, dtype)
            if not persistent:
                T.barrier_arrive(bar_q)

            k_lat, k_rope = (k0_lat, k1_lat), (k0_rope, k1_rope)
            bars = (bar_q, bar_ready, bar_free, bar_lo, bar_qfree)
            # one if / elif / else chain: separate ifs make TileLang put a block-wide __syncthreads between the roles
            if tx < wg:
                consumer0(tok, h0, dO, Idx, Ends, Lse, Delta, DS, P, HS, q_lat, q_rope, k_lat, k_rope, ones, do0, s0,
                          dp0, lse2_0, dlt0, hsum0, n_it, steps0, *bars)
            elif tx < 2 * wg:
                consumer1(tok, h0, dO, Idx, Ends, Lse, Delta, DS, P, HS, q_lat, q_rope, k_lat, k_rope, ones, do1, s1,
                          dp1, lse2_1, dlt1, hsum1, n_it, steps1, *bars)
            else:  # producer: block 2 it + b into buffer b
                T.set_max_nreg(producer_regs, 0)
                p = tx - 2 * wg
                r0 = p // 8
                col = (p % 8) * 8
                producer_tokens(tok, h0, Ends, n_it, steps_p,
                                (Q, KV, Idx, n_kv, q_lat, q_rope, k_lat, k_rope, r0, col, row),
                                (bar_q, bar_qfree, bar_free, bar_lo, bar_ready))

    return sparse_mla_pds_ws_kernel


def pds_ws_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> Optional[str]:
    """Why this backward cannot take these inputs (None when it can): the forward's rules, d_rope 64, d_v % 128."""
    why = tilelang_unsupported_reason(q, kv, d_v)
    if why is not None:
        return why.replace("TileLang forward", "TileLang dense backward")
    if q.shape[-1] - d_v != 64 or d_v % 128:
        return f"the TileLang dense backward needs d_rope == 64 and d_v % 128 == 0, got {q.shape[-1] - d_v} / {d_v}"
    if q.shape[1] > HEAD_BLOCK:
        return f"the TileLang dense backward takes at most {HEAD_BLOCK} heads per rank, got {q.shape[1]}"
    return None


def _pad_heads(x: torch.Tensor, pad: int, value: float = 0.0) -> torch.Tensor:
    if not pad:
        return x.contiguous()
    widths = (0, pad) if x.dim() == 2 else (0, 0, 0, pad)
    return torch.nn.functional.pad(x, widths, value=value)


def tilelang_sparse_bwd_dense(q, kv, indices, out, lse, d_out, d_lse, softmax_scale: float, d_v: int,
                              deterministic: Optional[bool] = None, config: Optional[dict] = None,
                              dq: Optional[torch.Tensor] = None, head_sums: Optional[torch.Tensor] = None,
                              dkv_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dq like q, dkv like kv): ``triton_sparse_mla.sparse_mla_bwd``'s contract (head_sums included) with this
    module's kernel and cuBLAS, where the dense formulation applies (``triton_sparse_mla.dense_plan``: the
    indexer's host row bounds known, few enough keys per slot); elsewhere, and for inputs the kernel does not
    take, the Triton backward (said once per reason).  Deterministic in both modes.  config: PDS_WS_CONFIG's keys
    and the dense plan's (upper case, triton_sparse_mla.BWD_CONFIG's: DENSE_ROWS).  With BWD_CONFIG's DENSE_PREFIX
    (``triton_sparse_mla.dense_prefix_split``) the leading rows whose keys all lie low take this formulation and
    the rest the Triton "slots" backward, their fp32 dkv summed.  dkv_dtype: as sparse_mla_bwd's."""
    if head_sums is not None and (head_sums.shape != indices.shape or head_sums.dtype != torch.float32
                                  or not head_sums.is_contiguous()):
        raise ValueError(f"head_sums must be a contiguous fp32 [T, topk] = {tuple(indices.shape)} tensor, got "
                         f"{head_sums.dtype} {tuple(head_sums.shape)}")
    cfg = dict(PDS_WS_CONFIG, **(config or {}))
    plan_cfg = {k: cfg.pop(k) for k in list(cfg) if k.isupper()}  # the dense plan's BWD_CONFIG keys (DENSE_ROWS)
    why = pds_ws_unsupported_reason(q, kv, d_v)
    split = tsm.dense_prefix_split(q, kv, indices, deterministic, plan_cfg) if why is None else 0
    if split:
        return _dense_prefix_then_slots(split, q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v,
                                        deterministic, config, dq, head_sums, dkv_dtype)
    plan = tsm.dense_plan(q, kv, indices, deterministic, plan_cfg) if why is None else None
    if why is None and plan is None:
        why = ("the dense formulation does not apply here (top-k lists without the indexer's host row bounds, or "
               "more keys per top-k slot than triton_sparse_mla.DENSE_KEY_RATIO)")
    if why is not None:
        warn_once("tilelang", why)
        return tsm.sparse_mla_bwd(q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v, deterministic,
                                  dq=dq, head_sums=head_sums, dkv_dtype=dkv_dtype)
    passes = pop_pass_configs(cfg)
    n_q, h, d_qk = q.shape
    n_keys, topk = kv.shape[0], indices.shape[1]
    pad = HEAD_BLOCK - h
    q, kv, d_out = q.contiguous(), kv.contiguous(), d_out.contiguous()
    delta = tsm.bwd_delta(out, d_out, d_lse)
    q_k, do_k = _pad_heads(q, pad), _pad_heads(d_out, pad)
    lse_k, delta_k = _pad_heads(lse.float(), pad, float("-inf")), _pad_heads(delta, pad)
    idx = pad_topk(indices, PAIR).to(torch.int32).contiguous()
    ends = tsm.used_slot_ends(indices, n_keys, PAIR)  # each query's steps up to its last used slot
    dq = torch.empty_like(q) if dq is None else dq
    dkv = torch.zeros(n_keys, d_qk, dtype=torch.float32, device=q.device)
    hs = head_sums if head_sums is not None else torch.empty(1, 1, dtype=torch.float32, device=q.device)
    kernel = compiled_kernel(build_sparse_pds_ws, HEAD_BLOCK, d_v, d_qk - d_v, idx.shape[1], float(softmax_scale),
                             h, topk, pass_configs=passes, head_sums=head_sums is not None,
                             **with_sm_grid(cfg, q.device))
    for t0, n, kc, ds_mat, p_mat in plan.chunks():
        if kc > 0:
            rows = slice(t0, t0 + n)
            kernel(q_k[rows], kv, idx[rows], do_k[rows], lse_k[rows], delta_k[rows], ends[rows], ds_mat.view(kc, n, h),
                   p_mat.view(kc, n, h), hs[rows] if head_sums is not None else hs)
        elif head_sums is not None:
            head_sums[t0:t0 + n].zero_()
        plan.products(dkv, dq, kc, n, t0, q, d_out, kv, d_v)
    return dq, dkv.to(dkv_dtype or kv.dtype)


def _dense_prefix_then_slots(rows, q, kv, indices, out, lse, d_out, d_lse, softmax_scale, d_v, deterministic, config,
                             dq, head_sums, dkv_dtype):
    """Query rows [0, rows) in the dense formulation (this module's kernel + cuBLAS; their host row bounds carried
    over to the slice), the rest by the Triton backward's "slots"; dq and the head sums written in place per part,
    the two fp32 dkv summed in that order (deterministic when both parts are)."""
    row_hi = host_windows.row_ends(indices)  # the caller's list (dense_prefix_split found its bounds)
    q, d_out, out, lse = q.contiguous(), d_out.contiguous(), out.contiguous(), lse.contiguous()
    dq = torch.empty_like(q) if dq is None else dq
    parts = (slice(0, rows), slice(rows, q.shape[0]))
    idx_a = indices[parts[0]]
    host_windows.remember_row_ends(idx_a, row_hi[parts[0]])
    dkv = []
    for part, idx, cfg in ((parts[0], idx_a, dict(config or {}, DK="dense", DENSE_PREFIX=False)),
                           (parts[1], indices[parts[1]], None)):
        args = (q[part], kv, idx, out[part], lse[part], d_out[part], None if d_lse is None else d_lse[part],
                softmax_scale, d_v, deterministic)
        hs = None if head_sums is None else head_sums[part]
        if cfg is not None:
            dkv.append(tilelang_sparse_bwd_dense(*args, config=cfg, dq=dq[part], head_sums=hs,
                                                 dkv_dtype=torch.float32)[1])
        else:
            dkv.append(tsm.sparse_mla_bwd(*args, config=dict(DK="slots"), dq=dq[part], head_sums=hs,
                                          dkv_dtype=torch.float32)[1])
    return dq, dkv[0].add_(dkv[1]).to(dkv_dtype or kv.dtype)  # in place: no third fp32 [n_keys, d] matrix
