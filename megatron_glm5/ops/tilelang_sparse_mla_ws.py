"""Our warp-specialised TileLang sparse MLA forward (``WS_CONFIG``): the ``--attn tilelang`` forward
(``tilelang_backend.forward_kernel``; ``GLM5_TILELANG_FWD=plain`` selects the plain loop instead).

Status (2026-12-02): passes the GPU tests of tests/test_ops_tilelang.py on the H200 and runs at 556-560 TFLOP/s at
S 4096 and 529-531 at 32768 (sessions 10, 11; 542 / 499-504 in session 9 on another H200; docs/performance.md).
``WS_BOUNDED_CONFIG`` (each query stops after its last used slot) passes the same tests and equals it bit for bit,
but measured slower (3.01-3.09 vs 2.09-2.10 ms at S 4096).  ptxas: 168 registers at launch, no spills, 222,208
bytes of dynamic shared memory.  Two earlier failures the builder and tests now guard against: 240 / 32 registers per
consumer / producer thread asked 8 more than the block holds (2 x 240 + 32 > 3 x 168), so the consumers'
setmaxnreg.inc waited forever (the builder rejects such counts; 232 / 40 by default); and both consumers used ONE
set of register tiles, which TileLang 0.1.15 binds to the threads of the first branch that uses it, dropping the
other branch's element-wise work (rel. L2 1.04) -- each consumer has its own tiles (one macro, ``consumer(c)``,
writes both branches), and the roles stay one if / elif / else chain (separate ifs get a block-wide __syncthreads
between them, a deadlock).  tests/test_ops_tilelang_ws.py checks each role's part in the lowered source.

Same contract as ``tilelang_sparse_mla.tilelang_sparse_fwd`` (out [T, h, d_v] bf16, lse [T, h] fp32 natural log,
-inf lse and 0 out for rows without keys, -1 / >= Tk slots unused, heads padded to 64), through the same wrapper:
``WS_CONFIG`` names this module's builder.  The schedule is the one of FlashMLA's sm90 sparse prefill kernel, written
here in TileLang:

* one thread block per (query token, 64 heads), 384 threads in three warpgroups; q (latent + rope) is TMA-loaded once;
* warpgroup 2, the producer (few registers), gathers the selected kv rows with cp.async, 64 rows per block, into two
  shared buffers: even blocks into buffer 0, odd blocks into buffer 1; each buffer has a "ready" mbarrier (completed
  by the cp.async arrivals) and a "free" one (both consumers arrive when done with it); with ``split_ready`` (the
  default) a block comes in two halves, the first 256 latent columns completing a "lo" barrier and the rest with
  the rope part "ready", and a consumer starts q k^T on the first half while the second is in flight (bitwise the
  same products; 1-2 % faster, session 17);
* consumer warpgroup c (c = 0, 1) computes the 64 x 64 score tile of the blocks in ITS buffer (q k^T over all 576
  columns), so both consumers do the same tensor-core work; the running row max is shared: consumer 0 publishes the
  max of its tile (and the previous max) in shared memory, consumer 1 folds in its own tile and publishes the block
  pair's max, which both use for exp2; each rounds its p to bf16 into the rope part of its own kv buffer (free once
  its scores are computed: p [64 heads, 64 slots] has the shape of k_rope [64 slots, 64]);
* consumer c owns output columns c * d_v / 2 .. of the 64 heads: acc_c = acc_c * alpha + p_0 v_0[:, half c] +
  p_1 v_1[:, half c], reading both consumers' p; row sums are per consumer and added in the epilogue;
* early release (``early_release``, the default): both consumers do the even block's p V first and free each buffer
  right after its last use (each publishes its p after an explicit async-proxy fence), so the producer refills the
  even buffer while the odd block's p V runs (1.05x at S 4096 on the H200); ``block_n=32`` keeps a whole second
  buffer set in flight instead (four 32-row buffers, p in its own tiles: slower, 436-457 TFLOP/s).

An unused slot (index -1 or >= Tk) gets score -inf, so p = 0 there; after the first block pair the producer gathers
nothing for it (``skip_unused``: its buffer row keeps an earlier block's finite values), in the first pair a clamped
row (shared memory starts uninitialised).  On the H200 with causal top-k 2048 that made it 1.70x faster at S 4096 (a
quarter of the slots unused) and 1.09x at 32768 (3 %).  The running max starts at the finite floor ``M_FLOOR``.
Needs d_rope == 64 (the p tile lives in the rope buffer) and d_v a multiple of 128; the top-k slots are padded to a
multiple of 128 (two blocks per step).  Other shapes take the plain kernel (``FWD_CONFIG``).
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
from typing import Optional, Tuple

import torch

from . import tilelang_sparse_mla
from .tilelang_sparse_mla import FWD_CONFIG, HEAD_BLOCK, LN2, LOG2E, M_FLOOR, check_tiles

__all__ = ["WS_CONFIG", "WS_BOUNDED_CONFIG", "WS_EXACT_CONFIG", "WS_GATHER_ALL_CONFIG",
           "WS_LATE_RELEASE_CONFIG", "WS32_CONFIG", "WS32_EARLY_CONFIG", "WS_L2_HINTS_CONFIG", "WS_L2_256B_CONFIG",
           "WS_WHOLE_BLOCKS_CONFIG", "WS_ASYNC_CONFIG", "WS_PERSISTENT_CONFIG", "WS_PERSISTENT_ASYNC_CONFIG",
           "WS_PERSISTENT_BOUNDED_CONFIG", "KV_HINTS", "block_gatherer", "buffer_filler", "build_sparse_fwd_ws",
           "check_kv_hint", "check_persistent", "consumer_epilogue", "consumer_prologue", "consumer_tiles",
           "item_loop", "kernel_prelude", "masked_scores", "producer_token", "query_tma_loader",
           "row_exchange_buffers", "scores_product", "tilelang_sparse_fwd_ws", "ws_fits"]

BLOCK_N = 64  # kv rows per block (= HEAD_BLOCK = d_rope: the p tile is stored in the block's rope buffer)
STEP = 2 * BLOCK_N  # top-k slots per step of the loop (a block per consumer; four 32-row blocks with block_n 32)
PRODUCER_THREADS = 128
ROWS_PER_PASS = PRODUCER_THREADS // 8  # eight producer threads per kv row, 16 bytes (8 bf16) per cp.async each
#: registers per thread ptxas gives a 384-thread block (65536 / 384 rounded down to a multiple of 8): the pool the
#: setmaxnreg redistribution works within (a block cannot grow past its launch allocation)
LAUNCH_REGS = 168


#: L2 cache hints of the kv gathers (``kv_hint``; docs/design.md): None -- plain cp.async (TileLang's own); "evict_last"
#: -- each 16-byte cp.async carries an L2 evict-last policy, so the gathered kv rows (re-read by every later query
#: that selects them) outlive the streamed q / out / index lines in L2; "evict_last_256b" -- the same with a 256-byte
#: L2 prefetch on a miss (a kv row is 1,152 contiguous bytes).  FlashMLA's sm90 sparse prefill gathers this way.
KV_HINTS = (None, "evict_last", "evict_last_256b")
#: the device functions the hinted gathers call (a kernel's prelude: TileLang's cp.async takes no cache policy)
GATHER_PRELUDE = r"""
__device__ __forceinline__ unsigned long long glm5_evict_last_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void glm5_cp_async16_evict_last(void *smem, const void *gmem) {
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(gmem), "l"(glm5_evict_last_policy()) : "memory");
}
__device__ __forceinline__ void glm5_cp_async16_evict_last_256b(void *smem, const void *gmem) {
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(gmem), "l"(glm5_evict_last_policy()) : "memory");
}
"""


def check_kv_hint(kv_hint, split_ready: bool = False) -> None:
    """kv_hint is one of KV_HINTS, and not combined with split_ready: the two together stopped the backward's scores
    kernel with an illegal instruction on the H100 (session 17; each alone passes the GPU tests)."""
    if kv_hint not in KV_HINTS:
        raise ValueError(f"kv_hint must be one of {KV_HINTS}, got {kv_hint!r}")
    if kv_hint and split_ready:
        raise ValueError(f"kv_hint {kv_hint!r} needs split_ready=False: the two together stopped a kernel with an "
                         "illegal instruction on the H100 (2026-12-07); each alone is tested")


def kernel_prelude(kv_hint):
    """The ``T.Kernel`` prelude a kernel gathering with ``kv_hint`` needs (None without a hint)."""
    check_kv_hint(kv_hint)
    return GATHER_PRELUDE if kv_hint else None


GATHER_PARTS = ("all", "lo", "hi")


def block_gatherer(block_n: int, d_v: int, skip_unused: bool, kv_hint=None, part: str = "all"):
    """T.macro: the producer warpgroup's gather of one block of block_n kv rows (slots slot0 ..) into a shared
    buffer by cp.async, eight producer threads per row (thread r0, column col), 16 bytes each (``row``: the caller's
    int32 var).  An unused slot (-1 or >= n_kv: its score is masked, p = 0) is not gathered after the first step
    (``it`` 0; skip_unused): its row keeps an earlier block's finite values; the first step fills it from a clamped
    row (shared memory starts uninitialised).  kv_hint (``KV_HINTS``): the L2 policy of each copy; a hinted gather
    needs ``kernel_prelude(kv_hint)`` in its kernel.  part: "all" the row, "lo" the first half of its latent
    columns, "hi" the rest and the rope part (a block gathered in two halves, each completing its own barrier:
    the consumers start q k^T on the first half while the second is in flight).  Our warp-specialised forward and
    backward scores kernel share it."""
    import tilelang.language as T

    check_kv_hint(kv_hint)
    if part not in GATHER_PARTS:
        raise ValueError(f"part must be one of {GATHER_PARTS}, got {part!r}")
    hinted = {"evict_last": "glm5_cp_async16_evict_last",
              "evict_last_256b": "glm5_cp_async16_evict_last_256b"}.get(kv_hint)
    tiles = d_v // 64  # 64-column pieces of the latent part (8 threads x 8 columns each)
    lat_tiles = {"all": range(tiles), "lo": range(tiles // 2), "hi": range(tiles // 2, tiles)}[part]
    lat0, n_lat, with_rope = lat_tiles.start, len(lat_tiles), part != "lo"

    @T.macro
    def copy16(dst, src):
        if hinted is None:
            T.ptx_cp_async(T.access_ptr(dst, "w", 8), T.access_ptr(src, "r", 8), 8)
        else:  # the shared pointer passed as read ("r"): TileLang's sync pass then puts no barrier among the
            # producer's threads between rows (it does for an extern call it sees writing shared memory; its own
            # cp.async it knows to be asynchronous); the consumers wait on the mbarriers either way
            T.call_extern("handle", hinted, T.access_ptr(dst, "r", 8), T.access_ptr(src, "r", 8))

    @T.macro
    def gather_block(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row):
        for r in T.serial(block_n // ROWS_PER_PASS):
            sel = Idx[tok, slot0 + r * ROWS_PER_PASS + r0]
            gather = T.if_then_else(sel >= 0, T.if_then_else(sel < n_kv, 1, 0), 0) if skip_unused else 1
            if T.if_then_else(it == 0, 1, gather) == 1:
                row[0] = T.max(T.min(sel, n_kv - 1), 0)  # a store into the caller's var, as in the kernel body
                for u in T.unroll(n_lat):
                    copy16(k_lat_b[r * ROWS_PER_PASS + r0, (lat0 + u) * 64 + col], KV[row[0], (lat0 + u) * 64 + col])
                if with_rope:
                    copy16(k_rope_b[r * ROWS_PER_PASS + r0, col], KV[row[0], d_v + col])

    return gather_block


def buffer_filler(block_n: int, d_v: int, skip_unused: bool, kv_hint=None, split_ready: bool = False):
    """T.macro: the producer's fill of kv buffer b with one block (``block_gatherer``) once its consumers freed it
    (bar_free[b] at parity free_phase): the whole block completing bar_ready[b], or with split_ready the first
    latent half completing bar_lo[b] and then the rest bar_ready[b] (cp.async.mbarrier.arrive.noinc fires once this
    thread's copies issued before it are done).  bar_lo: None without split_ready."""
    import tilelang.language as T

    check_kv_hint(kv_hint, split_ready)
    whole = block_gatherer(block_n, d_v, skip_unused, kv_hint)
    lo = block_gatherer(block_n, d_v, skip_unused, kv_hint, "lo")
    hi = block_gatherer(block_n, d_v, skip_unused, kv_hint, "hi")

    @T.macro
    def fill(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row, bar_free, free_phase, bar_lo, bar_ready,
             b):
        T.barrier_wait(bar_free[b], free_phase)
        if split_ready:
            lo(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row)
            T.cp_async_barrier_noinc(bar_lo[b])
            hi(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row)
        else:
            whole(KV, Idx, tok, slot0, it, n_kv, k_lat_b, k_rope_b, r0, col, row)
        T.cp_async_barrier_noinc(bar_ready[b])

    return fill


def scores_product(d_v: int, split_ready: bool, async_wgmma: bool = False, wait: bool = True):
    """T.macro: s = q k^T (latent + rope, fp32, cleared first) of kv buffer b once its producer is done with it
    (phase: the buffer's use parity); with split_ready the first latent half is multiplied after bar_lo[b] and the
    rest after bar_ready[b].  async_wgmma: the products issued as asynchronous wgmma (``T.wgmma_gemm``) with one wait
    at the end, instead of ``T.gemm``'s wait after each (the tensor pipe drained between the latent halves and the
    rope part); the same wgmma instructions in the same order; ``wait`` False leaves them in flight (the caller
    issues more and waits).  Our warp-specialised forward and the backward's scores kernel share it."""
    import tilelang.language as T

    half = d_v // 2
    mm = T.wgmma_gemm if async_wgmma else T.gemm

    @T.macro
    def product(q_lat, q_rope, k_lat_b, k_rope_b, s, bar_lo, bar_ready, b, phase):
        if split_ready:  # q k^T on the first latent half while the rest is in flight
            T.barrier_wait(bar_lo[b], phase)
            mm(q_lat[:, 0:half], k_lat_b[:, 0:half], s, transpose_B=True, clear_accum=True)
            T.barrier_wait(bar_ready[b], phase)
            mm(q_lat[:, half:d_v], k_lat_b[:, half:d_v], s, transpose_B=True)
        else:
            T.barrier_wait(bar_ready[b], phase)
            mm(q_lat, k_lat_b, s, transpose_B=True, clear_accum=True)
        mm(q_rope, k_rope_b, s, transpose_B=True)
        if async_wgmma and wait:
            T.wait_wgmma(0)

    return product


def masked_scores(block_n: int, c_log2: float):
    """T.macro: a forward consumer's scores tile s [64 heads, block_n] (slots slot0 ..) scaled into log2 units
    (c_log2 = softmax scale x log2 e), an unused slot's (-1 or >= n_kv) -inf, and m_new = each row's max."""
    import tilelang.language as T

    @T.macro
    def run(Idx, tok, slot0, n_kv, s, m_new):
        for i, j in T.Parallel(HEAD_BLOCK, block_n):
            sel = Idx[tok, slot0 + j]
            s[i, j] = T.if_then_else((sel >= 0) and (sel < n_kv), s[i, j] * c_log2, -T.infinity("float32"))
        T.reduce_max(s, m_new, dim=1, clear=True)

    return run


def consumer_tiles(block_n: int, half: int):
    """One consumer's register tiles, allocated (TileLang fragments) where it is called inside a kernel body: the
    scores s [64 heads, block_n] and output accumulator acc [64, half] (fp32), then the row vectors m_run, m_new,
    alpha, l_run, l_blk.  Each consumer takes a set of its own (module docstring); the forwards share it."""
    import tilelang.language as T

    return (T.alloc_fragment((HEAD_BLOCK, block_n), "float32"), T.alloc_fragment((HEAD_BLOCK, half), "float32"),
            *(T.alloc_fragment((HEAD_BLOCK,), "float32") for _ in range(5)))


def row_exchange_buffers():
    """The shared row vectors the two consumers of a forward exchange, allocated where it is called inside a kernel
    body: m0_sh (consumer 0's running max), m1_sh (the block pair's max), l0_sh / l1_sh (each one's row sums)."""
    import tilelang.language as T

    return tuple(T.alloc_shared((HEAD_BLOCK,), "float32") for _ in range(4))


def query_tma_loader(d_v: int, q_evict_first: bool = False):
    """T.macro: the TMA loads of q's latent and rope parts for (token tok, heads h0 ..) into shared memory, both
    completing bar_q (the caller arrives on it); q_evict_first: with an L2 evict-first hint (each q is read once).
    Our warp-specialised kernels share it."""
    import tilelang.language as T

    policy = "evict_first" if q_evict_first else None

    @T.macro
    def load(Q, tok, h0, q_lat, q_rope, bar_q):
        T.tma_copy(Q[tok, h0:h0 + HEAD_BLOCK, 0:d_v], q_lat, barrier=bar_q, eviction_policy=policy)
        T.tma_copy(Q[tok, h0:h0 + HEAD_BLOCK, d_v:], q_rope, barrier=bar_q, eviction_policy=policy)

    return load


def check_persistent(persistent) -> None:
    """A persistent kernel's grid is a positive int (0: not persistent; the wrappers put the SM count for True)."""
    if persistent and (not isinstance(persistent, int) or isinstance(persistent, bool) or persistent < 0):
        raise ValueError(f"persistent must be a positive int (thread blocks), got {persistent!r}")


def item_loop(persistent: int, bounded: bool, n_steps: int, n_q, hb_n: int, token):
    """T.macro: one role's tokens.  ``token``: a T.macro taking (tok, h0, *tiles, n_it, g0, k_ph, *bars) -- one
    token's part, n_it its steps, g0 the steps of this role's tokens before it (the kv barriers' parities), k_ph its
    token count mod 2.  Not persistent: the thread block's own token (n_it from the caller).  Persistent: the items
    (token, head block) bx, bx + persistent, ... of thread block ``tok`` (= bx) over n_q tokens x hb_n head blocks,
    each of n_steps steps, or (bounded) of min(Ends[token], n_steps) summed in ``steps`` ([this item's, the ones'
    before it]: a local int32[2] of the role's own).  Our persistent forward and backward scores kernel share it."""
    import tilelang.language as T

    def items(bx):
        return T.max(T.floordiv(n_q * hb_n - bx + persistent - 1, persistent), 0)

    def item_of(bx, k):
        w = bx + k * persistent
        return w // hb_n, (w % hb_n) * HEAD_BLOCK

    @T.macro
    def run(tok, h0, Ends, n_it, steps, tiles, bars):
        if persistent and bounded:
            steps[1] = 0
            for k in T.serial(items(tok)):
                w_tok, w_h0 = item_of(tok, k)
                steps[0] = T.min(Ends[w_tok], n_steps)
                token(w_tok, w_h0, *tiles, steps[0], steps[1], k & 1, *bars)
                steps[1] = steps[1] + steps[0]
        elif persistent:
            for k in T.serial(items(tok)):
                token(*item_of(tok, k), *tiles, n_steps, k * n_steps, k & 1, *bars)
        else:
            token(tok, h0, *tiles, n_it, 0, 0, *bars)

    return run


def producer_token(persistent: int, load_q, produce):
    """T.macro in ``item_loop``'s token form: the producer's part of one token -- persistent: first its q, once both
    consumers are done with the previous token's (bar_qfree, parity k_ph ^ 1; a fresh barrier passes at once), by TMA
    into bar_q -- then its kv blocks (``produce(KV, Idx, tok, g0, n_kv, k_lat, k_rope, r0, col, row, n_it, bar_free,
    bar_lo, bar_ready)``, the kernel's own gather loop)."""
    import tilelang.language as T

    @T.macro
    def run(tok, h0, Q, KV, Idx, n_kv, q_lat, q_rope, k_lat, k_rope, r0, col, row, n_it, g0, k_ph, bar_q, bar_qfree,
            bar_free, bar_lo, bar_ready):
        if persistent:
            T.barrier_wait(bar_qfree, k_ph ^ 1)
            load_q(Q, tok, h0, q_lat, q_rope, bar_q)
            T.barrier_arrive(bar_q)
        produce(KV, Idx, tok, g0, n_kv, k_lat, k_rope, r0, col, row, n_it, bar_free, bar_lo, bar_ready)

    return run


def consumer_prologue(consumer_regs: int, set_regs: bool = True):
    """T.macro: the start of a forward's consumer (of a token): its registers raised to consumer_regs (setmaxnreg;
    not with set_regs False -- a persistent kernel raises them once, before its loop over tokens), acc and the row
    sums zeroed, the running max at M_FLOOR, then the wait for q (bar_q at parity q_phase)."""
    import tilelang.language as T

    @T.macro
    def run(acc, l_run, m_run, bar_q, q_phase):
        if set_regs:
            T.set_max_nreg(consumer_regs, 1)
        T.fill(acc, 0)
        T.fill(l_run, 0)
        T.fill(m_run, M_FLOOR)
        T.barrier_wait(bar_q, q_phase)

    return run


def consumer_epilogue(c: int, half: int):
    """T.macro: the end of a forward's consumer c: both consumers' row sums added (l_sh: their shared row vectors,
    complete at bar_l), its output columns c * half .. divided by them (0 for rows without keys) and written, and
    lse (natural log, -inf for rows without keys) written by consumer 0; l_phase: bar_l's parity (a persistent
    kernel's token count so far, mod 2)."""
    import tilelang.language as T

    cols = slice(c * half, (c + 1) * half)

    @T.macro
    def run(tok, h0, Out, Lse, l_sh, acc, m_run, l_run, lse_f, bar_l, l_phase):
        T.copy(l_run, l_sh[c])
        T.barrier_arrive(bar_l)
        T.barrier_wait(bar_l, l_phase)
        for i in T.Parallel(HEAD_BLOCK):
            l_run[i] = l_run[i] + l_sh[1 - c][i]
        for i, j in T.Parallel(HEAD_BLOCK, half):
            acc[i, j] = T.if_then_else(l_run[i] > 0, acc[i, j] / l_run[i], 0)
        T.copy(acc, Out[tok, h0:h0 + HEAD_BLOCK, cols])
        if c == 0:
            for i in T.Parallel(HEAD_BLOCK):
                lse_f[i] = T.if_then_else(l_run[i] > 0, (T.log2(l_run[i]) + m_run[i]) * LN2, -T.infinity("float32"))
            T.copy(lse_f, Lse[tok, h0:h0 + HEAD_BLOCK])

    return run


def build_sparse_fwd_ws(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, consumer_regs: int = 232,
                        producer_regs: int = 40, skip_unused: bool = True, block_n: int = BLOCK_N,
                        early_release: bool = False, bounded: bool = False, kv_hint=None, q_evict_first: bool = False,
                        split_ready: bool = False, async_wgmma: bool = False, persistent: int = 0,
                        dtype: str = "bfloat16"):
    """The TileLang prim_func of the warp-specialised forward (module docstring); same arguments as
    ``tilelang_sparse_mla.build_sparse_fwd``'s kernel.  heads % 64 == 0, topk % 128 == 0, d_rope == 64.
    consumer_regs / producer_regs: the per-thread registers of each role after setmaxnreg (multiples of 8); their
    sum over the three warpgroups must fit the block's launch allocation (``LAUNCH_REGS`` per thread), else the
    consumers' setmaxnreg.inc waits forever for registers nobody frees.  skip_unused: the producer gathers no row for
    an unused slot after the first block pair (False: a clamped row, as in the first pair).
    block_n: kv rows per block, 64 (two kv buffers: a block pair's gather waits until both consumers are done with
    the previous pair) or 32 (four buffers in two sets: the producer gathers the next pair into one set while the
    consumers work on the other; p then has its own shared tiles).  early_release: both consumers take the pair's
    buffers in the same order (even block first) and free each right after its last use (p published with an
    explicit async-proxy fence), so the producer can refill the even buffer during the odd block's p V.
    bounded: the kernel takes Ends int32 [n_q] after Idx, each query's count of 128-slot steps up to its last
    used slot (``triton_sparse_mla.used_slot_ends``), and stops there (the causal padding of early tokens is not
    computed).  kv_hint: the L2 policy of the kv gathers (``KV_HINTS``); q_evict_first: q's TMA loads (each q read
    once) carry an L2 evict-first hint.  split_ready: the producer gathers each block in two halves (the first half
    of the latent columns, then the rest with the rope part), each completing its own "ready" barrier, and the
    consumer starts q k^T on the first half while the second is in flight.  async_wgmma (with early_release): a
    consumer's products issued as asynchronous wgmma, waited for only where a result or a buffer is needed -- q k^T
    once after its three parts (``scores_product``), the pair's two p V products back to back, the even buffer freed
    after wait_wgmma(1) and the odd one after wait_wgmma(0) -- instead of the tensor pipe drained after each
    ``T.gemm``; the same wgmma instructions in the same order, so the same results bit for bit.
    persistent (> 0): that many thread blocks (the GPU's SM count: one block per SM fits), each taking (token, head
    block) items bx, bx + persistent, ... in turn, so that a token's fixed costs overlap the previous token's work:
    the producer loads the next token's q by TMA once both consumers are done with the current q (their last q k^T:
    the ``bar_qfree`` barrier) and gathers its first blocks into the buffers the consumers free, while they finish
    the last p V and write the output.  Every barrier's parity counts on across tokens; with bounded each role sums
    its items' step counts (read from Ends per item) for the kv buffers' parities, and a token without a step frees
    its q at once."""
    import tilelang.language as T

    check_persistent(persistent)
    if async_wgmma and not early_release:
        raise ValueError("async_wgmma needs early_release (its p V order: both consumers take the even block first)")
    if block_n not in (32, BLOCK_N):
        raise ValueError(f"block_n must be 32 or {BLOCK_N}, got {block_n}")
    sets = BLOCK_N // block_n  # buffer sets in flight: 1 (64 rows) or 2 (32 rows)
    set_ids = tuple(range(sets))  # (TileLang's parser turns range() inside a kernel into a loop)
    check_tiles(heads, topk, 2 * block_n * sets)
    if 2 * consumer_regs + producer_regs > 3 * LAUNCH_REGS or consumer_regs % 8 or producer_regs % 8:
        raise ValueError(f"consumer_regs ({consumer_regs}) x 2 + producer_regs ({producer_regs}) must be at most "
                         f"{3 * LAUNCH_REGS} (3 warpgroups x {LAUNCH_REGS} registers at launch), multiples of 8")
    if d_rope != BLOCK_N or d_v % 128:
        raise ValueError(f"the warp-specialised forward needs d_rope == {BLOCK_N} and d_v % 128 == 0, "
                         f"got {d_rope} / {d_v}")
    d_qk = d_v + d_rope
    half = d_v // 2
    hb_n = heads // HEAD_BLOCK
    n_outer = topk // (2 * block_n * sets)
    p_in_rope = block_n == d_rope  # p [heads, block_n] has the shape of a block's rope part [block_n, d_rope]
    acc_t, idx_t = "float32", "int32"
    c_log2 = float(softmax_scale) * LOG2E
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    wg = 128  # threads per warpgroup
    ends_shape = (n_q,) if bounded else (1,)  # unbounded: a placeholder

    qk = scores_product(d_v, split_ready, async_wgmma)
    pv = T.wgmma_gemm if async_wgmma else T.gemm  # the p V products (async: waited for before each buffer's free)
    mask = masked_scores(block_n, c_log2)
    start = consumer_prologue(consumer_regs, set_regs=not persistent)

    def consumer(c: int):
        """T.macro: consumer warpgroup c's whole part (block 2 it + c of each pair it, in kv buffer 2 set + c;
        output columns c * half ..); k_lat / k_rope / p_of (by buffer), m_sh / l_sh (by consumer): tuples;
        s .. l_blk: its own register tiles."""
        o = 1 - c
        cols = slice(c * half, (c + 1) * half)
        end = consumer_epilogue(c, half)

        @T.macro
        def token(tok, h0, Idx, Out, Lse, q_lat, q_rope, k_lat, k_rope, p_of, m_sh, l_sh, s, acc, m_run, m_new,
                  alpha, l_run, l_blk, lse_f, n_it, g0, k_ph, bar_q, bar_ready, bar_free, bar_m0, bar_m1, bar_p, bar_l,
                  bar_lo, bar_qfree):
            """One token's part: g0 the steps of the tokens before it (0 unless persistent), k_ph its token count
            mod 2 (bar_q's and bar_l's parity)."""
            start(acc, l_run, m_run, bar_q, k_ph)
            for it0 in T.serial(n_it):
                for st in set_ids:  # a Python tuple: unrolled, buffer indices stay Python ints
                    it = it0 * sets + st
                    ph = (g0 * sets + it) & 1
                    mine, other = 2 * st + c, 2 * st + o
                    qk(q_lat, q_rope, k_lat[mine], k_rope[mine], s, bar_lo, bar_ready, mine, (g0 + it0) & 1)
                    if persistent and st == sets - 1:  # its last q k^T done: q's buffers free for the next token
                        if it0 == n_it - 1:
                            T.barrier_arrive(bar_qfree)
                    mask(Idx, tok, (2 * it + c) * block_n, n_kv, s, m_new)
                    if c == 0:  # publish max(previous max, this tile's max), then take the block pair's max
                        for i in T.Parallel(HEAD_BLOCK):
                            m_sh[0][i] = T.max(m_run[i], m_new[i])
                        T.barrier_arrive(bar_m0)
                        T.barrier_wait(bar_m1, ph)
                        for i in T.Parallel(HEAD_BLOCK):
                            m_new[i] = m_sh[1][i]
                    else:  # fold in consumer 0's and publish the block pair's max
                        T.barrier_wait(bar_m0, ph)
                        for i in T.Parallel(HEAD_BLOCK):
                            m_new[i] = T.max(m_new[i], m_sh[0][i])
                            m_sh[1][i] = m_new[i]
                        T.barrier_arrive(bar_m1)
                    for i in T.Parallel(HEAD_BLOCK):
                        alpha[i] = T.exp2(m_run[i] - m_new[i])
                        m_run[i] = m_new[i]
                    for i, j in T.Parallel(HEAD_BLOCK, block_n):
                        s[i, j] = T.exp2(s[i, j] - m_run[i])
                    T.reduce_sum(s, l_blk, dim=1)
                    for i in T.Parallel(HEAD_BLOCK):
                        l_run[i] = l_run[i] * alpha[i] + l_blk[i]
                    # p_of[b]: the p tile [heads, slots] of the block in buffer b (written by consumer b % 2);
                    # never bound to a local name (TileLang would rename the shared buffer after it)
                    T.copy(s, p_of[mine])
                    for i, j in T.Parallel(HEAD_BLOCK, half):
                        acc[i, j] = acc[i, j] * alpha[i]
                    if early_release:  # both take the even block first; each buffer freed after its last use
                        T.fence_proxy_async()  # p's stores visible to the other consumer's wgmma
                        T.barrier_arrive(bar_p[c])
                        if c == 1:
                            T.barrier_wait(bar_p[0], ph)
                        pv(p_of[2 * st], k_lat[2 * st][:, cols], acc)
                        if not async_wgmma:
                            T.barrier_arrive(bar_free[2 * st])
                        if c == 0:
                            T.barrier_wait(bar_p[1], ph)
                        pv(p_of[2 * st + 1], k_lat[2 * st + 1][:, cols], acc)
                        if async_wgmma:  # both products were in flight: each buffer freed once its product is done
                            T.wait_wgmma(1)
                            T.barrier_arrive(bar_free[2 * st])
                            T.wait_wgmma(0)
                        T.barrier_arrive(bar_free[2 * st + 1])
                    else:
                        T.gemm(p_of[mine], k_lat[mine][:, cols], acc)  # the fence for p's stores precedes this gemm
                        T.barrier_arrive(bar_p[c])
                        T.barrier_wait(bar_p[o], ph)
                        T.gemm(p_of[other], k_lat[other][:, cols], acc)
                        T.barrier_arrive(bar_free[2 * st])
                        T.barrier_arrive(bar_free[2 * st + 1])
            if persistent and bounded:  # a token without a step: its q is free at once
                if n_it == 0:
                    T.barrier_arrive(bar_qfree)
            end(tok, h0, Out, Lse, l_sh, acc, m_run, l_run, lse_f, bar_l, k_ph)

        tokens = item_loop(persistent, bounded, n_outer, n_q, hb_n, token)

        @T.macro
        def run(tok, h0, Idx, Ends, Out, Lse, q_lat, q_rope, k_lat, k_rope, p_of, m_sh, l_sh, s, acc, m_run, m_new,
                alpha, l_run, l_blk, lse_f, n_it, steps, bar_q, bar_ready, bar_free, bar_m0, bar_m1, bar_p, bar_l,
                bar_lo, bar_qfree):
            """The consumer's whole part: the token and first head of this thread block, or with persistent (tok:
            the thread block, h0 unused) those of each item it takes in turn (persistent and bounded: ``steps`` its
            own [this item's steps, the steps of its items before it])."""
            if persistent:  # raised once, before the loop over tokens (else in each token's prologue)
                T.set_max_nreg(consumer_regs, 1)
            tokens(tok, h0, Ends, n_it, steps, (Idx, Out, Lse, q_lat, q_rope, k_lat, k_rope, p_of, m_sh, l_sh, s, acc,
                                                m_run, m_new, alpha, l_run, l_blk, lse_f),
                   (bar_q, bar_ready, bar_free, bar_m0, bar_m1, bar_p, bar_l, bar_lo, bar_qfree))

        return run

    consumer0, consumer1 = consumer(0), consumer(1)
    fill = buffer_filler(block_n, d_v, skip_unused, kv_hint, split_ready)
    load_q = query_tma_loader(d_v, q_evict_first)
    n_buf = 2 * sets

    @T.macro
    def produce(KV, Idx, tok, g0, n_kv, k_lat, k_rope, r0, col, row, n_it, bar_free, bar_lo, bar_ready):
        """The producer's gathers of one token: block 2 it + b into buffer 2 set + b (g0: the steps of the tokens
        before it, for the free barriers' parity)."""
        for it0 in T.serial(n_it):
            for st in set_ids:  # Python-unrolled
                for b in (0, 1):
                    buf = 2 * st + b
                    fill(KV, Idx, tok, (2 * (it0 * sets + st) + b) * block_n, it0, n_kv, k_lat[buf], k_rope[buf], r0,
                         col, row, bar_free, ((g0 + it0) & 1) ^ 1, bar_lo, bar_ready, buf)

    producer_tokens = item_loop(persistent, bounded, n_outer, n_q, hb_n, producer_token(persistent, load_q, produce))

    @T.prim_func
    def sparse_mla_fwd_ws_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        Ends: T.Tensor(ends_shape, idx_t),
        Out: T.Tensor((n_q, heads, d_v), dtype),
        Lse: T.Tensor((n_q, heads), acc_t),
    ):
        # persistent: a 1-D grid of that many thread blocks (tok: the block; ``hb`` unused)
        with T.Kernel(*((persistent, 1) if persistent else (n_q, hb_n)), threads=3 * wg,
                      prelude=kernel_prelude(kv_hint)) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            # kv buffer b of set st holds block 2 (sets it0 + st) + b; with 64-row blocks its rope part then holds
            # p of consumer b [heads, slots]
            k0_lat = T.alloc_shared((block_n, d_v), dtype)
            k0_rope = T.alloc_shared((block_n, d_rope), dtype)
            k1_lat = T.alloc_shared((block_n, d_v), dtype)
            k1_rope = T.alloc_shared((block_n, d_rope), dtype)
            k2_lat = T.alloc_shared((block_n, d_v), dtype) if sets == 2 else None
            k2_rope = T.alloc_shared((block_n, d_rope), dtype) if sets == 2 else None
            k3_lat = T.alloc_shared((block_n, d_v), dtype) if sets == 2 else None
            k3_rope = T.alloc_shared((block_n, d_rope), dtype) if sets == 2 else None
            p0_sh = T.alloc_shared((HEAD_BLOCK, block_n), dtype) if not p_in_rope else None
            p1_sh = T.alloc_shared((HEAD_BLOCK, block_n), dtype) if not p_in_rope else None
            m0_sh, m1_sh, l0_sh, l1_sh = row_exchange_buffers()
            # register tiles: one set PER CONSUMER (a tile both branches use loses consumer 1's element-wise work in
            # TileLang's lowering: module docstring)
            s0, acc0, m_run0, m_new0, alpha0, l_run0, l_blk0 = consumer_tiles(block_n, half)
            lse_f = T.alloc_fragment((HEAD_BLOCK,), acc_t)  # consumer 0 writes lse
            s1, acc1, m_run1, m_new1, alpha1, l_run1, l_blk1 = consumer_tiles(block_n, half)
            row = T.alloc_local((1,), idx_t)  # the producer's gathered kv row (block_gatherer)
            n_it = n_outer  # the steps of this query (a Python int unless bounded)
            if bounded and not persistent:
                n_it = T.alloc_var(idx_t)
                n_it = T.min(Ends[tok], n_outer)
            # persistent and bounded: each role's [this item's steps, the steps of its items before it]
            steps0 = T.alloc_local((2,), idx_t) if persistent and bounded else None
            steps1 = T.alloc_local((2,), idx_t) if persistent and bounded else None
            steps_p = T.alloc_local((2,), idx_t) if persistent and bounded else None

            # q loaded: by every thread, or (persistent) by the producer, token after token
            bar_q = T.alloc_barrier(arrive_count=wg if persistent else 3 * wg)
            # persistent: both consumers done with a token's q (its last q k^T); None otherwise
            bar_qfree = T.alloc_barrier(arrive_count=2 * wg) if persistent else None
            bar_ready = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * n_buf)  # kv buffer b gathered
            # split_ready: the first latent half of kv buffer b gathered (None without it: a macro argument bound to
            # bar_ready would rename that barrier in the source)
            bar_lo = T.alloc_barrier(arrive_count=[PRODUCER_THREADS] * n_buf) if split_ready else None
            bar_free = T.alloc_barrier(arrive_count=[2 * wg] * n_buf)  # kv buffer b read by both consumers
            bar_m0 = T.alloc_barrier(arrive_count=wg)  # m0_sh written
            bar_m1 = T.alloc_barrier(arrive_count=wg)  # m1_sh written
            bar_p = T.alloc_barrier(arrive_count=[wg] * 2)  # p of consumer c stored
            bar_l = T.alloc_barrier(arrive_count=2 * wg)  # both row sums written

            h0 = hb * HEAD_BLOCK
            tx = T.get_thread_binding()
            if not persistent:
                load_q(Q, tok, h0, q_lat, q_rope, bar_q)
                T.barrier_arrive(bar_q)

            # buffer b's / consumer c's shared tiles (indexed by b or c in the roles below)
            k_lat = (k0_lat, k1_lat, k2_lat, k3_lat)[:n_buf]
            k_rope = (k0_rope, k1_rope, k2_rope, k3_rope)[:n_buf]
            p_of = k_rope if p_in_rope else (p0_sh, p1_sh, p0_sh, p1_sh)[:n_buf]  # buffer b's block's p tile
            m_sh, l_sh = (m0_sh, m1_sh), (l0_sh, l1_sh)
            bars = (bar_q, bar_ready, bar_free, bar_m0, bar_m1, bar_p, bar_l, bar_lo, bar_qfree)
            # one if / elif / else chain: separate ifs make TileLang put a block-wide __syncthreads between the roles
            if tx < wg:
                consumer0(tok, h0, Idx, Ends, Out, Lse, q_lat, q_rope, k_lat, k_rope, p_of, m_sh, l_sh, s0, acc0,
                          m_run0, m_new0, alpha0, l_run0, l_blk0, lse_f, n_it, steps0, *bars)
            elif tx < 2 * wg:
                consumer1(tok, h0, Idx, Ends, Out, Lse, q_lat, q_rope, k_lat, k_rope, p_of, m_sh, l_sh, s1, acc1,
                          m_run1, m_new1, alpha1, l_run1, l_blk1, lse_f, n_it, steps1, *bars)
            else:  # producer: gathers block 2 it + b into buffer 2 set + b
                T.set_max_nreg(producer_regs, 0)
                p = tx - 2 * wg
                r0 = p // 8
                col = (p % 8) * 8
                producer_tokens(tok, h0, Ends, n_it, steps_p,
                                (Q, KV, Idx, n_kv, q_lat, q_rope, k_lat, k_rope, r0, col, row),
                                (bar_q, bar_qfree, bar_free, bar_lo, bar_ready))

    return sparse_mla_fwd_ws_kernel


#: the tilelang backend's forward: this module's kernel through ``tilelang_sparse_fwd`` (top-k padded to two blocks)
WS_CONFIG = dict(builder=build_sparse_fwd_ws, topk_multiple=STEP, consumer_regs=232, producer_regs=40,
                 fast_math=True, early_release=True, bounded=False, split_ready=True)
#: the same kernel stopping after each query's last used slot: SLOWER on the H200 (3.01 vs 2.09 ms at S 4096,
#: causal top-k 2048, although it computes a quarter fewer steps; the lowered source differs only in the loop bound
#: and a bounds check; session 11, docs/performance.md; its loop bounds were computed by eight torch kernels over
#: the whole list until session 21 -- docs/design.md), kept for the benchmark's comparison
WS_BOUNDED_CONFIG = dict(WS_CONFIG, bounded=True)
#: the same kernel with exact exp2f (TileLang's fast-math pass off), for the benchmark's comparison
WS_EXACT_CONFIG = dict(WS_CONFIG, fast_math=False)
#: the same kernel gathering a (clamped) row for every slot, unused ones too, for the benchmark's comparison
WS_GATHER_ALL_CONFIG = dict(WS_CONFIG, skip_unused=False)
#: schedule variants (``build_sparse_fwd_ws``'s block_n / early_release), for the benchmark's comparison
WS_LATE_RELEASE_CONFIG = dict(WS_CONFIG, early_release=False)
WS32_CONFIG = dict(WS_CONFIG, block_n=32, early_release=False, split_ready=False)  # (as GPU-tested: whole blocks)
WS32_EARLY_CONFIG = dict(WS_CONFIG, block_n=32, split_ready=False)
#: L2 hints (``KV_HINTS``): evict-last kv gathers with q's TMA loads evict-first, and the same with a 256-byte L2
#: prefetch, for the benchmark's comparison (no gain measured on the H100: docs/performance.md, session 17)
WS_L2_HINTS_CONFIG = dict(WS_CONFIG, kv_hint="evict_last", q_evict_first=True, split_ready=False)
WS_L2_256B_CONFIG = dict(WS_L2_HINTS_CONFIG, kv_hint="evict_last_256b")
#: each kv block gathered whole before q k^T starts (``split_ready`` False: the default before 2026-12-07)
WS_WHOLE_BLOCKS_CONFIG = dict(WS_CONFIG, split_ready=False)
#: the consumers' products as asynchronous wgmma, waited for only where a result or a buffer is needed (session 20;
#: not yet run on a GPU: opt-in, a benchmark row, bitwise the default by construction -- the GPU tests check it)
WS_ASYNC_CONFIG = dict(WS_CONFIG, async_wgmma=True)
#: persistent thread blocks, one per SM (``persistent`` True: the wrapper puts in the GPU's SM count), each taking
#: token after token so that the next token's q load and first gathers overlap the current one's last products and
#: output (session 21; opt-in until measured: a benchmark round row), and the same with asynchronous wgmma / bounded
WS_PERSISTENT_CONFIG = dict(WS_CONFIG, persistent=True)
WS_PERSISTENT_ASYNC_CONFIG = dict(WS_PERSISTENT_CONFIG, async_wgmma=True)
#: persistent and bounded: each token stops after its last used slot (its loop bounds now one pass over the top-k
#: list, session 21), its steps summed per thread block for the barriers' parities
WS_PERSISTENT_BOUNDED_CONFIG = dict(WS_PERSISTENT_CONFIG, bounded=True)


build_sparse_fwd_ws.takes_ends = True  # the kernel's 4th argument is Ends (a placeholder unless bounded)


def ws_fits(q: torch.Tensor, d_v: int) -> bool:
    """Whether the warp-specialised kernel takes these shapes (d_rope == 64, d_v % 128 == 0)."""
    return q.shape[-1] - d_v == BLOCK_N and d_v % 128 == 0


def tilelang_sparse_fwd_ws(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int,
                           config: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                           lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``tilelang_sparse_fwd`` with this module's kernel (config: overrides of WS_CONFIG), or the plain kernel
    (``FWD_CONFIG``) for shapes it does not take."""
    cfg = dict(WS_CONFIG, **(config or {})) if ws_fits(q, d_v) else dict(FWD_CONFIG)
    return tilelang_sparse_mla.tilelang_sparse_fwd(q, kv, indices, softmax_scale, d_v, config=cfg, out=out, lse=lse)
