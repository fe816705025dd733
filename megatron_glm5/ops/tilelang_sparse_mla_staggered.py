"""Our staggered warp-specialised TileLang sparse MLA forward (``WS_STAGGERED_CONFIG``): the same roles, buffers and
gathers as ``tilelang_sparse_mla_ws`` (a producer warpgroup gathering 64-row kv blocks with cp.async into two
buffers, two consumer warpgroups), with the consumers no longer in lockstep.

Why: in the lockstep kernel (``WS_CONFIG``) both consumers compute q k^T together, exchange the row max, run the
softmax together and only then the p V products, so the tensor cores idle through both softmaxes (a reading of
the schedule in session 17, not a measured profile; docs/design.md).  Here, as in FlashMLA's sm90 sparse prefill schedule (learned from, not copied):

* consumer 0 (output columns 0 .. d_v/2) scores block 2 it (kv buffer 0), runs its softmax on ITS running max
  (the previous pair's max and this tile's), publishes that max and at once multiplies its own p -- from registers,
  a register-A wgmma -- with the first latent half of buffer 0, freeing that half for the producer;
* consumer 1 (columns d_v/2 ..) scores block 2 it + 1 (buffer 1), folds consumer 0's max into its own to get the
  pair's max, publishes it, multiplies its p (registers) with the second latent half of buffer 1, stores that p for
  consumer 0, then multiplies consumer 0's p with the second half of buffer 0 and frees both second halves;
* consumer 0, once the pair's max is known, rescales its p and its accumulator by exp2(own max - pair's max),
  stores that p for consumer 1 (in buffer 0's rope part, free once its scores are done), multiplies consumer 1's p
  with buffer 1's first half and, before waiting for that product, issues the next block's q k^T (async wgmma);
* the producer fills the four half-buffers in the order they are freed: buffer 0's first half, buffer 1's second,
  buffer 0's second, buffer 1's first (each half has its own "free" and "ready" mbarrier).

So one consumer's softmax runs while the other's products use the tensor cores.  Consumer 0's own p is rounded to
bf16 before the rescale and consumer 1's copy after it, so the output is NOT bitwise the lockstep kernel's (same
maths; within 5e-3 rel. L2 of it at GLM-5 shapes, the GPU test).  Same contract, shapes and unused-slot handling as ``WS_CONFIG``
(``skip_unused``; the running max starts at ``M_FLOOR``); consumer 1's p has its own 8 KB tile (consumer 0 reads it
after buffer 1's second half is refilled): 230,400 bytes of shared memory with q, under the H100's 232,448.

Status (2026-12-07, session 18, one H200; docs/performance.md): correct -- its GPU tests pass (GLM-5 shapes causal
and packed against the fp32 reference and within 5e-3 of the lockstep kernel, padded heads, rows without keys) --
but SLOWER than the lockstep kernel in the same run: 437.7 vs 514.9 TFLOP/s at S 32768, 435.3 vs 522.1 at 4096
(interleaved rounds), so opt-in, for the benchmark's comparison.  ptxas spills 432 bytes in consumer 1 (the
wgmma descriptors of its q k^T, hoisted out of the loop and kept on the stack); why the schedule that gives FlashMLA
its speed does not pay here is not settled (docs/design.md gives the arithmetic that points at the gathers).
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly

from .tilelang_sparse_mla import HEAD_BLOCK, LOG2E, check_tiles
from .tilelang_sparse_mla_ws import (BLOCK_N, LAUNCH_REGS, PRODUCER_THREADS, STEP, block_gatherer,
                                     consumer_epilogue, consumer_prologue, consumer_tiles, kernel_prelude,
                                     masked_scores, query_tma_loader, row_exchange_buffers)

__all__ = ["WS_STAGGERED_CONFIG", "build_sparse_fwd_staggered"]


def build_sparse_fwd_staggered(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float,
                               consumer_regs: int = 232, producer_regs: int = 40, skip_unused: bool = True,
                               kv_hint=None, q_evict_first: bool = False, dtype: str = "bfloat16"):
    """The TileLang prim_func of the staggered forward (module docstring): kernel(Q, KV, Idx, Out, Lse) with
    ``tilelang_sparse_mla.build_sparse_fwd``'s contract.  heads % 64 == 0, topk % 128 == 0, d_rope == 64,
    d_v % 128 == 0; consumer_regs / producer_regs, skip_unused, kv_hint, q_evict_first as in
    ``tilelang_sparse_mla_ws.build_sparse_fwd_ws``."""
    import tilelang.language as T

    check_tiles(heads, topk, STEP)
    if 2 * consumer_regs + producer_regs > 3 * LAUNCH_REGS or consumer_regs % 8 or producer_regs % 8:
        raise ValueError(f"consumer_regs ({consumer_regs}) x 2 + producer_regs ({producer_regs}) must be at most "
                         f"{3 * LAUNCH_REGS} (3 warpgroups x {LAUNCH_REGS} registers at launch), multiples of 8")
    if d_rope != BLOCK_N or d_v % 128:
        raise ValueError(f"the staggered forward needs d_rope == {BLOCK_N} and d_v % 128 == 0, got {d_rope} / {d_v}")
    d_qk = d_v + d_rope
    half = d_v // 2
    hb_n = heads // HEAD_BLOCK
    n_it = topk // STEP
    acc_t, idx_t = "float32", "int32"
    c_log2 = float(softmax_scale) * LOG2E
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    wg = 128  # threads per warpgroup

    def half_filler(part: str):
        """T.macro: the producer's fill of one half of kv buffer b (``block_gatherer`` part "lo" or "hi") once
        bar_free[b] (at parity free_ph) says it is free, completing bar_done[b]."""
        gather = block_gatherer(BLOCK_N, d_v, skip_unused, kv_hint, part)

        @T.macro
        def fill(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row, bar_free, free_ph, bar_done, b):
            T.barrier_wait(bar_free[b], free_ph)
            gather(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row)
            T.cp_async_barrier_noinc(bar_done[b])

        return fill

    fill_lo, fill_hi = half_filler("lo"), half_filler("hi")

    mask = masked_scores(BLOCK_N, c_log2)

    @T.macro
    def softmax_step(s, acc, m_run, m_new, alpha, l_run, l_blk):
        """The online softmax at the new running max m_new: acc and l rescaled, s -> p (fp32), l += its row sums."""
        for i in T.Parallel(HEAD_BLOCK):
            alpha[i] = T.exp2(m_run[i] - m_new[i])
            m_run[i] = m_new[i]
        for i, j in T.Parallel(HEAD_BLOCK, half):
            acc[i, j] = acc[i, j] * alpha[i]
        for i, j in T.Parallel(HEAD_BLOCK, BLOCK_N):
            s[i, j] = T.exp2(s[i, j] - m_run[i])
        T.reduce_sum(s, l_blk, dim=1)
        for i in T.Parallel(HEAD_BLOCK):
            l_run[i] = l_run[i] * alpha[i] + l_blk[i]

    epilogue0, epilogue1 = consumer_epilogue(0, half), consumer_epilogue(1, half)
    start = consumer_prologue(consumer_regs)

    @T.macro
    def consumer0(tok, h0, Idx, Out, Lse, q_lat, q_rope, k0_lat, k0_rope, k1_lat, p1_sh, m0_sh, m1_sh, l_sh, s, p,
                  acc, m_run, m_new, alpha, l_run, l_blk, lse_f, bar_q, bar_lo, bar_ready, bar_free_lo, bar_m0,
                  bar_m1, bar_p0, bar_p1, bar_l):
        start(acc, l_run, m_run, bar_q, 0)
        T.barrier_wait(bar_lo[0], 0)  # the first block's scores (later ones are issued at the end of each step)
        T.wgmma_gemm(q_lat[:, 0:half], k0_lat[:, 0:half], s, transpose_B=True, clear_accum=True)
        T.barrier_wait(bar_ready[0], 0)
        T.wgmma_gemm(q_lat[:, half:d_v], k0_lat[:, half:d_v], s, transpose_B=True)
        T.wgmma_gemm(q_rope, k0_rope, s, transpose_B=True)
        T.wait_wgmma(0)
        for it in T.serial(n_it):
            ph = it & 1
            mask(Idx, tok, 2 * it * BLOCK_N, n_kv, s, m_new)
            for i in T.Parallel(HEAD_BLOCK):  # own running max: the previous pair's and this tile's
                m_new[i] = T.max(m_run[i], m_new[i])
                m0_sh[i] = m_new[i]
            T.barrier_arrive(bar_m0)
            softmax_step(s, acc, m_run, m_new, alpha, l_run, l_blk)
            T.copy(s, p)  # own p in registers: the A operand of its product
            T.wgmma_gemm(p, k0_lat[:, 0:half], acc)
            T.wait_wgmma(0)
            T.barrier_arrive(bar_free_lo[0])
            T.barrier_wait(bar_m1, ph)  # the pair's max: rescale own p (for consumer 1), acc and l to it
            for i in T.Parallel(HEAD_BLOCK):
                alpha[i] = T.exp2(m_run[i] - m1_sh[i])
                m_run[i] = m1_sh[i]
                l_run[i] = l_run[i] * alpha[i]
            for i, j in T.Parallel(HEAD_BLOCK, BLOCK_N):
                s[i, j] = s[i, j] * alpha[i]
            T.copy(s, k0_rope)  # block 2 it's p for consumer 1, in buffer 0's rope part (its scores are done)
            T.fence_proxy_async()  # the stores visible to consumer 1's wgmma
            T.barrier_arrive(bar_p0)
            for i, j in T.Parallel(HEAD_BLOCK, half):
                acc[i, j] = acc[i, j] * alpha[i]
            T.barrier_wait(bar_p1, ph)
            T.wgmma_gemm(p1_sh, k1_lat[:, 0:half], acc)
            if it + 1 < n_it:  # the next block's scores issued while that product runs
                T.barrier_wait(bar_lo[0], ph ^ 1)
                T.wgmma_gemm(q_lat[:, 0:half], k0_lat[:, 0:half], s, transpose_B=True, clear_accum=True)
                T.wait_wgmma(1)
                T.barrier_arrive(bar_free_lo[1])
                T.barrier_wait(bar_ready[0], ph ^ 1)
                T.wgmma_gemm(q_lat[:, half:d_v], k0_lat[:, half:d_v], s, transpose_B=True)
                T.wgmma_gemm(q_rope, k0_rope, s, transpose_B=True)
                T.wait_wgmma(0)
            else:
                T.wait_wgmma(0)
                T.barrier_arrive(bar_free_lo[1])
        epilogue0(tok, h0, Out, Lse, l_sh, acc, m_run, l_run, lse_f, bar_l, 0)

    @T.macro
    def consumer1(tok, h0, Idx, Out, Lse, q_lat, q_rope, k0_lat, k0_rope, k1_lat, k1_rope, p1_sh, m0_sh, m1_sh, l_sh,
                  s, p, acc, m_run, m_new, alpha, l_run, l_blk, lse_f, bar_q, bar_lo, bar_ready, bar_free_hi, bar_m0,
                  bar_m1, bar_p0, bar_p1, bar_l):
        start(acc, l_run, m_run, bar_q, 0)
        for it in T.serial(n_it):
            ph = it & 1
            T.barrier_wait(bar_ready[1], ph)  # buffer 1's second half is gathered first
            T.wgmma_gemm(q_lat[:, half:d_v], k1_lat[:, half:d_v], s, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(q_rope, k1_rope, s, transpose_B=True)
            T.barrier_wait(bar_lo[1], ph)
            T.wgmma_gemm(q_lat[:, 0:half], k1_lat[:, 0:half], s, transpose_B=True)
            T.wait_wgmma(0)
            mask(Idx, tok, (2 * it + 1) * BLOCK_N, n_kv, s, m_new)
            T.barrier_wait(bar_m0, ph)  # fold in consumer 0's max: the pair's max
            for i in T.Parallel(HEAD_BLOCK):
                m_new[i] = T.max(m_new[i], m0_sh[i])
                m1_sh[i] = m_new[i]
            T.barrier_arrive(bar_m1)
            softmax_step(s, acc, m_run, m_new, alpha, l_run, l_blk)
            T.copy(s, p)
            T.wgmma_gemm(p, k1_lat[:, half:d_v], acc)
            T.copy(s, p1_sh)  # for consumer 0, while the product runs
            T.fence_proxy_async()
            T.barrier_arrive(bar_p1)
            T.barrier_wait(bar_p0, ph)
            T.wgmma_gemm(k0_rope, k0_lat[:, half:d_v], acc)  # consumer 0's p (in buffer 0's rope part)
            T.wait_wgmma(1)
            T.barrier_arrive(bar_free_hi[1])
            T.wait_wgmma(0)
            T.barrier_arrive(bar_free_hi[0])
        epilogue1(tok, h0, Out, Lse, l_sh, acc, m_run, l_run, lse_f, bar_l, 0)

    load_q = query_tma_loader(d_v, q_evict_first)

    @T.prim_func
    def sparse_mla_fwd_staggered_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        Out: T.Tensor((n_q, heads, d_v), dtype),
        Lse: T.Tensor((n_q, heads), acc_t),
    ):
        with T.Kernel(n_q, hb_n, threads=3 * wg, prelude=kernel_prelude(kv_hint)) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            k0_lat = T.alloc_shared((BLOCK_N, d_v), dtype)  # block 2 it; its rope part later holds that block's p
            k0_rope = T.alloc_shared((BLOCK_N, d_rope), dtype)
            k1_lat = T.alloc_shared((BLOCK_N, d_v), dtype)  # block 2 it + 1
            k1_rope = T.alloc_shared((BLOCK_N, d_rope), dtype)
            p1_sh = T.alloc_shared((HEAD_BLOCK, BLOCK_N), dtype)  # block 2 it + 1's p (consumer 1 -> consumer 0)
            m0_sh, m1_sh, l0_sh, l1_sh = row_exchange_buffers()
            # register tiles: one set PER CONSUMER (tilelang_sparse_mla_ws's docstring says why); p: own p in bf16
            s0, acc0, m_run0, m_new0, alpha0, l_run0, l_blk0 = consumer_tiles(BLOCK_N, half)
            p0 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), dtype)
            lse_f = T.alloc_fragment((HEAD_BLOCK,), acc_t)  # consumer 0 writes lse
            s1, acc1, m_run1, m_new1, alpha1, l_run1, l_blk1 = consumer_tiles(BLOCK_N, half)
            p1 = T.alloc_fragment((HEAD_BLOCK, BLOCK_N), dtype)
            row = T.alloc_local((1,), idx_t)  # the producer's gathered kv row (block_gatherer)

            bar_q = T.alloc_barrier(arrive_count=3 * wg)
            bar_lo = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * 2)  # buffer b's first latent half gathered
            bar_ready = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * 2)  # the rest of buffer b (with rope)
            bar_free_lo = T.alloc_barrier(arrive_count=[wg] * 2)  # buffer b's first half read (consumer 0)
            bar_free_hi = T.alloc_barrier(arrive_count=[wg] * 2)  # buffer b's second half read (consumer 1)
            bar_m0 = T.alloc_barrier(arrive_count=wg)  # m0_sh written
            bar_m1 = T.alloc_barrier(arrive_count=wg)  # m1_sh written
            bar_p0 = T.alloc_barrier(arrive_count=wg)  # block 2 it's p stored (k0_rope)
            bar_p1 = T.alloc_barrier(arrive_count=wg)  # block 2 it + 1's p stored (p1_sh)
            bar_l = T.alloc_barrier(arrive_count=2 * wg)  # both row sums written

            h0 = hb * HEAD_BLOCK
            tx = T.get_thread_binding()
            load_q(Q, tok, h0, q_lat, q_rope, bar_q)
            T.barrier_arrive(bar_q)

            l_sh = (l0_sh, l1_sh)
            # one if / elif / else chain (separate ifs get a block-wide __syncthreads between the roles)
            if tx < wg:
                consumer0(tok, h0, Idx, Out, Lse, q_lat, q_rope, k0_lat, k0_rope, k1_lat, p1_sh, m0_sh, m1_sh, l_sh,
                          s0, p0, acc0, m_run0, m_new0, alpha0, l_run0, l_blk0, lse_f, bar_q, bar_lo, bar_ready,
                          bar_free_lo, bar_m0, bar_m1, bar_p0, bar_p1, bar_l)
            elif tx < 2 * wg:
                consumer1(tok, h0, Idx, Out, Lse, q_lat, q_rope, k0_lat, k0_rope, k1_lat, k1_rope, p1_sh, m0_sh,
                          m1_sh, l_sh, s1, p1, acc1, m_run1, m_new1, alpha1, l_run1, l_blk1, lse_f, bar_q, bar_lo,
                          bar_ready, bar_free_hi, bar_m0, bar_m1, bar_p0, bar_p1, bar_l)
            else:  # producer: the four half-buffers in the order the consumers free them
                T.set_max_nreg(producer_regs, 0)
                pt = tx - 2 * wg
                r0 = pt // 8
                col = (pt % 8) * 8
                for it in T.serial(n_it):
                    free_ph = (it & 1) ^ 1
                    slot0 = 2 * it * BLOCK_N
                    fill_lo(KV, Idx, tok, slot0, it, n_kv, k0_lat, k0_rope, r0, col, row, bar_free_lo, free_ph,
                            bar_lo, 0)
                    fill_hi(KV, Idx, tok, slot0 + BLOCK_N, it, n_kv, k1_lat, k1_rope, r0, col, row, bar_free_hi,
                            free_ph, bar_ready, 1)
                    fill_hi(KV, Idx, tok, slot0, it, n_kv, k0_lat, k0_rope, r0, col, row, bar_free_hi, free_ph,
                            bar_ready, 0)
                    fill_lo(KV, Idx, tok, slot0 + BLOCK_N, it, n_kv, k1_lat, k1_rope, r0, col, row, bar_free_lo,
                            free_ph, bar_lo, 1)

    return sparse_mla_fwd_staggered_kernel


#: the staggered kernel through ``tilelang_sparse_mla.tilelang_sparse_fwd`` (top-k padded to two blocks)
WS_STAGGERED_CONFIG = dict(builder=build_sparse_fwd_staggered, topk_multiple=STEP, consumer_regs=232,
                           producer_regs=40, fast_math=True)
