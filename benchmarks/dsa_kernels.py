"""Benchmark of the Triton DSA kernels (megatron_glm5/ops/triton_*.py) at GLM-5 shapes on one GPU.

    python benchmarks/dsa_kernels.py [--seqs 4096 32768] [--sweep] [--bwd-only] [--json kernels.json]

Shapes: T = S query tokens (batch 1, causal), h = 64 heads, d_qk = 576 (512 latent + 64 rope), d_v = 512,
top-k 2048, indexer 32 heads x 128, bf16.  The top-k indices are the Triton indexer's own output on random
indexer inputs (so early tokens have fewer than 2048 keys, -1 padded, as in training).
Timing: CUDA events around each call after 3 warm-ups, median of --reps runs, inputs refilled with fresh random
numbers (never zeros) before every run, outside the timed region.
FLOP convention: sparse forward = 2 * T * h * topk * (576 + 512) (every top-k slot counted, also the -1 padding
of early tokens, as FlashMLA / TileLang count); backward = 2.5 x forward.  The indexer and KL rows give times only.
--sweep first times several block configurations of the forward and backward kernels at S = --sweep-seq and uses
the fastest for the table.  The backward rows cover each variant of BWD_VARIANTS (the default "auto", each dk
formulation of triton_sparse_mla, the earlier one-kernel backward) in both dkv modes, in the same run;
--bwd-only keeps just the sparse MLA forward and backward rows, ours in TileLang included (and the backward's sweep).
MoE rows (--moe-tokens, default 4096 16384): our fused token permute + unpermute (ops/triton_moe_permute.py)
against megatron-core's unfused ops, forward and forward + backward, GB/s of hidden-row traffic.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from statistics import median  # the rounds' median (interleaved_ms), the profile's wall

import torch

from cuda_timing import idle_ms, median_ms, queued_ms  # benchmarks/, the script's folder

H, DQK, DV, TOPK, HI, DI = 64, 576, 512, 2048, 32, 128
# the ceiling the TFLOP/s rows are compared with: a bf16 8192^3 torch.matmul measured on the H200
# (../shared/GLM5_REFERENCE.md); --peak-tflops for another GPU
PEAK_TFLOPS = 751.0

FWD_SWEEP = [
    dict(BLOCK_N=64, V_SPLIT=1, num_warps=8, num_stages=2),
    dict(BLOCK_N=128, V_SPLIT=1, num_warps=8, num_stages=1),
]
# backward block shapes, swept on the "slots" formulation (the one used at long sequences; kernel 1 is shared with
# "dense"): kernel 1's (BLOCK_N, H_SPLIT, warps, stages) and the dkv kernel's (DK_BLOCK_S slots x DK_BLOCK_C
# columns, warps, stages); entries are overrides of tsm.BWD_CONFIG, the fastest one's shapes become the default
BWD_SWEEP = [
    dict(),
    dict(DK_BLOCK_S=64, DK_num_warps=4),
    dict(H_SPLIT=2, num_stages=2),
    dict(H_SPLIT=2, BLOCK_N=128, num_stages=2),
    dict(H_SPLIT=2, BLOCK_N=32, num_stages=2),
    # kernel 1 with all 64 heads (issue 16): smaller key blocks (fewer live registers), a second stage, 4 warps
    dict(BLOCK_N=32),
    dict(BLOCK_N=32, num_stages=2),
    dict(BLOCK_N=64, num_warps=4),
]
# the "dense" dkv kernel (_dense_dkv_kernel), swept with DK "dense": key block, (query, head) split, stages
DENSE_SWEEP = [
    dict(),
    dict(DENSE_SPLIT=1),
    dict(DENSE_SPLIT=4),
    dict(DENSE_BLOCK_K=64, DENSE_SPLIT=1),
]
# the backward variants timed side by side in one run (overrides of tsm.BWD_CONFIG, or the name of one of its
# configurations): the default (DK "auto"), each dk formulation, "slots" without the padding skip, and the previous
# one-kernel backward (dk products per head group inside it, ONE_KERNEL_BWD_CONFIG)
BWD_VARIANTS = {"auto": {}, "auto-memsets-in-order": dict(ZERO_AHEAD=False, ZEROS="memset"),
                "auto-memsets": dict(ZEROS="memset"), "auto-kept-zero": dict(ZEROS="restore"),
                "slots": dict(DK="slots"),
                "dense": dict(DK="dense"),
                "dense-triton-dkv": dict(DK="dense", DENSE_DKV="triton"),
                "dense-dq-in-kernel": dict(DK="dense", DENSE_DQ=False),
                "slots, no padding skip": dict(DK="slots", SKIP_PAD=False), "one-kernel": "ONE_KERNEL_BWD_CONFIG"}
PROB_SWEEP = [  # the KL target's head sums, one pass (the forward's lse given)
    dict(BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_N=32, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, num_warps=8, num_stages=2),
]
KL_SWEEP = [
    dict(BLOCK_N=32, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_N=32, num_warps=2, num_stages=3),
]


def timed(fn, refill, reps):
    """Median milliseconds of fn() over reps runs (CUDA events), refill() before each, 3 warm-ups."""
    return median_ms(fn, reps, 3, refill)


def interleaved_ms(runs, refill, reps, rounds):
    """{name: [ms of round 1, ..., ms of round `rounds`]}: each run (a dict name -> callable, in order) timed once per
    round (``timed``: the median of reps), the rounds one after another -- so a drift of the GPU's clocks over the
    run spreads over every configuration instead of favouring the ones timed first."""
    out = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            out[name].append(timed(fn, refill, reps))
    return out


class Problem:
    def __init__(self, seq):
        from megatron_glm5.ops import triton_indexer

        self.seq = seq
        dev = "cuda"
        self.q = torch.empty(seq, H, DQK, device=dev, dtype=torch.bfloat16)
        self.kv = torch.empty(seq, DQK, device=dev, dtype=torch.bfloat16)
        self.d_out = torch.empty(seq, H, DV, device=dev, dtype=torch.bfloat16)
        self.qi = torch.empty(seq, HI, DI, device=dev, dtype=torch.bfloat16)
        self.ki = torch.empty(seq, DI, device=dev, dtype=torch.bfloat16)
        self.w = torch.empty(seq, HI, device=dev, dtype=torch.float32)
        self.key_start = torch.zeros(seq, device=dev, dtype=torch.int64)
        self.query_end = torch.arange(seq, device=dev, dtype=torch.int64)
        self.refill()
        self.indices = triton_indexer.indexer_topk(self.qi, self.ki, self.w, TOPK, self.key_start, self.query_end,
                                                   DI ** -0.5)
        self.scale = DQK ** -0.5

    def refill(self):
        for t in (self.q, self.kv, self.d_out, self.qi, self.ki):
            t.normal_()
        self.w.normal_().mul_(HI ** -0.5)

    @property
    def fwd_flop(self):
        return 2.0 * self.seq * H * TOPK * (DQK + DV)


def _try_configs(label, configs, run, refill, reps, log, flop=None):
    """Times run(cfg) for each block configuration (a failing one, e.g. out of shared memory, is recorded);
    returns (rows, the fastest configuration or None)."""
    rows = []
    for cfg in configs:
        try:
            ms = timed(lambda: run(cfg), refill, reps)
            rows.append(dict(config=cfg, ms=ms, **({"tflops": flop / ms / 1e9} if flop else {})))
            log(f"sweep {label} {cfg}: {ms:.2f} ms" + (f"  {flop / ms / 1e9:.0f} TFLOP/s" if flop else ""))
        except Exception as e:
            rows.append(dict(config=cfg, error=str(e).splitlines()[0][:200]))
            log(f"sweep {label} {cfg}: failed: {str(e).splitlines()[0][:200]}")
    ok = [r for r in rows if "ms" in r]
    return rows, (min(ok, key=lambda r: r["ms"])["config"] if ok else None)


def sweep(seq, reps, log, only=None):
    """Times the block configurations of each Triton kernel at S = seq and makes the fastest the default."""
    from megatron_glm5.ops import triton_kl
    from megatron_glm5.ops import triton_sparse_mla as tsm

    p = Problem(seq)
    out, lse = tsm.sparse_mla_fwd(p.q, p.kv, p.indices, p.scale, DV)
    qi, ki, w = (x.detach().requires_grad_() for x in (p.qi, p.ki, p.w))
    kernels = {
        "fwd": (FWD_SWEEP, tsm.FWD_CONFIG, p.fwd_flop,
                lambda cfg: tsm.sparse_mla_fwd(p.q, p.kv, p.indices, p.scale, DV, config=cfg)),
        "bwd": (BWD_SWEEP, tsm.BWD_CONFIG, 2.5 * p.fwd_flop,
                lambda cfg: tsm.sparse_mla_bwd(p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
                                               deterministic=False, config=dict(tsm.BWD_CONFIG, DK="slots", **cfg))),
        "bwd_dense": (DENSE_SWEEP, tsm.BWD_CONFIG, 2.5 * p.fwd_flop,
                      lambda cfg: tsm.sparse_mla_bwd(p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
                                                     deterministic=False,
                                                     config=dict(tsm.BWD_CONFIG, DK="dense", DENSE_DKV="triton",
                                                                 **cfg))),
        "prob": (PROB_SWEEP, triton_kl.PROB_CONFIG, None,  # the KL target's head sums, one pass
                 lambda cfg: triton_kl.head_summed_probs(p.q, p.kv, p.indices, p.scale, DV, attn_lse=lse, config=cfg)),
        "kl": (KL_SWEEP, triton_kl.KL_CONFIG, None,  # the fused indexer KL kernel, forward + gradients
               lambda cfg: triton_kl.indexer_kl_loss_sparse(qi, ki, w, DI ** -0.5, p.q, p.kv, p.scale, p.indices, DV,
                                                            attn_lse=lse, config=cfg)[0].backward()),
    }
    res = {}
    for name, (configs, default, flop, run) in kernels.items():
        if only and name not in only:
            continue
        res[name], best = _try_configs(f"{name} S={seq}", configs, run, p.refill, reps, log, flop)
        if best is not None:
            default.update(best)
    log(f"chosen fwd {tsm.FWD_CONFIG}, bwd {tsm.BWD_CONFIG}, head sums {triton_kl.PROB_CONFIG}, "
        f"kl {triton_kl.KL_CONFIG}")
    torch.cuda.empty_cache()
    return res


def _fwd_bwd_rows(p, reps, add, tsm, variants=None, baseline=None):
    """The Triton forward's row, then one row per backward variant (BWD_VARIANTS, or the names in ``variants``)
    and dkv mode, and with ``baseline`` (another copy of triton_sparse_mla, loaded by load_baseline) its default
    backward in both modes on the same inputs; returns the forward's (out, lse) they use."""
    add("sparse_mla fwd (triton)", timed(lambda: tsm.sparse_mla_fwd(p.q, p.kv, p.indices, p.scale, DV), p.refill,
                                         reps), p.fwd_flop)
    out, lse = tsm.sparse_mla_fwd(p.q, p.kv, p.indices, p.scale, DV)
    for det in ((False, True) if baseline is not None else ()):
        add(f"sparse_mla bwd (baseline {baseline.__name__.rsplit('.', 1)[-1]} auto, "
            f"{'deterministic' if det else 'atomic'})", timed(
                lambda: baseline.sparse_mla_bwd(p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
                                                deterministic=det), p.refill, reps), 2.5 * p.fwd_flop)
    for variant, over in BWD_VARIANTS.items():
        if variants and variant not in variants:
            continue
        cfg = getattr(tsm, over) if isinstance(over, str) else dict(tsm.BWD_CONFIG, **over)
        for det in (False, True):
            add(f"sparse_mla bwd (triton {variant}, {'deterministic' if det else 'atomic'})", timed(
                lambda: tsm.sparse_mla_bwd(p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
                                           deterministic=det, config=cfg), p.refill, reps), 2.5 * p.fwd_flop)
    return out, lse


def _slot_ends_rows(p, reps, add):
    """The loop bounds of the bounded kernels and the padding skips (triton_sparse_mla.used_slot_ends at 128-slot
    steps) on this problem's top-k list: the one-pass kernel, and the torch form it replaced (session 21)."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    n_keys = p.kv.shape[0]
    add("used_slot_ends (one-pass kernel)", timed(lambda: tsm.used_slot_ends(p.indices, n_keys, 128), p.refill, reps))
    add("used_slot_ends (torch form, 8 kernels)", timed(lambda: tsm.slot_ends_torch(p.indices, n_keys, 128),
                                                        p.refill, reps))


def _dense_bwd_rows(p, out, lse, reps, add, match=None):
    """Our TileLang scores kernel + cuBLAS (``--attn tilelang``'s backward), each mode, with and without the KL
    target's head sums; rows where the dense formulation does not apply say that the Triton backward ran.
    match: a regular expression; only the variants whose row suffix it finds are timed (the four default rows
    always)."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
    from megatron_glm5.ops import triton_sparse_mla as tsm

    hs = torch.empty(p.indices.shape, dtype=torch.float32, device="cuda")
    variants = [(False, "", None, None), (False, ", head sums", hs, None), (True, "", None, None),
                (True, ", head sums", hs, None)]
    # the next chunk's memset in stream order instead of on a side stream (DensePlan's ZERO_AHEAD: before / after)
    variants += [(det, ", head sums, memsets in stream order", hs, dict(ZERO_AHEAD=False, ZEROS="memset"))
                 for det in (False, True)]
    # DensePlan's ZEROS (the default "auto" picks by n_keys / top-k): memsets (on a side stream), or no memsets --
    # one buffer kept zero, the written entries zeroed again after each chunk
    variants += [(det, f", head sums, ZEROS {z}", hs, dict(ZEROS=z)) for det in (False, True)
                 for z in ("memset", "restore")]
    # the scores kernel gathering each kv block whole (split_ready False; the default: two halves); its L2 hints
    variants += [(det, ", head sums, whole blocks", hs, dict(split_ready=False)) for det in (False, True)]
    variants += [(False, ", head sums, L2 hints", hs, dict(kv_hint="evict_last", q_evict_first=True,
                                                           split_ready=False))]
    # the scores kernel's q k^T and dO v^T as asynchronous wgmma, one wait per step (build_sparse_pds_ws)
    variants += [(det, ", head sums, async wgmma", hs, dict(async_wgmma=True)) for det in (False, True)]
    # the scores kernel's thread blocks persistent (one per SM, token after token: build_sparse_pds_ws)
    variants += [(det, ", head sums, persistent", hs, dict(persistent=True)) for det in (False, True)]
    # dkv's fp32 sums as before mm_fp32_add_: each product into an fp32 matrix of its own, then added
    variants += [(det, ", head sums, fp32 products added after", hs, dict(adds_after=True)) for det in (False, True)]
    if p.seq > 4096:  # the dense formulation where "auto" takes the Triton backward in atomic mode (DENSE_KEY_RATIO)
        variants += [(False, ", head sums, DK dense", hs, dict(DK="dense"))]
        # the dense formulation for the leading rows only, "slots" for the rest (BWD_CONFIG DENSE_PREFIX: the default
        # "atomic" splits in atomic mode past DENSE_KEY_RATIO; True in both modes; False never)
        variants += [(det, ", head sums, dense prefix", hs, dict(DENSE_PREFIX=True)) for det in (False, True)]
        variants += [(False, ", head sums, no dense prefix", hs, dict(DENSE_PREFIX=False))]
    if p.seq <= 8192:  # each chunk's products and memsets in pieces over their rows' keys (BWD_CONFIG DENSE_PIECE_ROWS)
        variants += [(False, f", head sums, {r}-row pieces", hs, dict(DENSE_PIECE_ROWS=r)) for r in (512, 256, 128)]
        variants += [(True, ", head sums, 256-row pieces", hs, dict(DENSE_PIECE_ROWS=256)),
                     (False, ", head sums, 256-row pieces, ZEROS restore", hs, dict(DENSE_PIECE_ROWS=256,
                                                                                   ZEROS="restore"))]
        # only the entries the kernel will not write zeroed (ZEROS "complement"), with and without pieces
        variants += [(det, f", head sums, {name}ZEROS complement", hs, dict(ZEROS="complement", **over))
                     for det in (False, True) for name, over in (("", {}), ("256-row pieces, ", dict(
                         DENSE_PIECE_ROWS=256)))]
    if p.seq <= 8192:  # query chunks of the dense formulation; the scattered stores' cost (a diagnostic)
        variants += [(False, f", head sums, {r}-row chunks", hs, dict(DENSE_ROWS=r)) for r in (512, 256)]
        variants += [(False, ", head sums, every step (causal padding computed)", hs, dict(bounded=False)),
                     (False, ", head sums, stores from the register tiles", hs, dict(staged=False))]
        variants += [(False, ", head sums, no dS / P stores (wrong dq / dkv: the stores' cost)", hs,
                      dict(write_pds=False))]
    if match:
        variants = variants[:4] + [v for v in variants[4:] if re.search(match, v[1])]
    fused_add = tsm.mm_fp32_add_
    for det, suffix, head_sums, cfg in variants:
        cfg = dict(cfg) if cfg else None
        adds_after = bool(cfg and cfg.pop("adds_after", False))
        plan_cfg = {k: v for k, v in (cfg or {}).items() if k.isupper()}
        which = ("scores + cuBLAS, then Triton slots" if tsm.dense_prefix_split(p.q, p.kv, p.indices, det, plan_cfg)
                 else "scores + cuBLAS" if tsm.dense_plan(p.q, p.kv, p.indices, det, plan_cfg) is not None
                 else "Triton fallback")
        run = functools.partial(tlbws.tilelang_sparse_bwd_dense, p.q, p.kv, p.indices, out, lse, p.d_out, None,
                                p.scale, DV, deterministic=det, head_sums=head_sums, config=cfg)
        tsm.mm_fp32_add_ = (lambda acc, a, b: acc.add_(tsm._mm_fp32(a, b))) if adds_after else fused_add
        try:
            run()  # compiled outside the timing
            add(f"sparse_mla bwd (our TileLang {which}, {'deterministic' if det else 'atomic'}{suffix})",
                timed(run, p.refill, reps), 2.5 * p.fwd_flop)
        finally:
            tsm.mm_fp32_add_ = fused_add
    print(f"dkv sums in cuBLAS's epilogue (torch.addmm into fp32): {tsm._addmm_into_fp32(torch.bfloat16)}")


def profile_dense_bwd(seq, log, config=None, host_top=0):
    """GPU time per kernel of one ``--attn tilelang`` backward (our scores kernel + cuBLAS) at ``seq``, from the
    torch profiler over 3 calls after a warm-up: where its time goes; then its wall time from an idle GPU (as the
    benchmark rows time it) and with the host ahead (cuda_timing.queued_ms: the GPU's own time, gaps included), and
    the host's issue time -- the difference of the two walls is what waiting for the host costs.  ``host_top``: also
    the host's cProfile, its top functions (benchmarks/host_profile.py)."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
    from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws

    p = Problem(seq)
    out, lse = tlws.tilelang_sparse_fwd_ws(p.q, p.kv, p.indices, p.scale, DV)
    hs = torch.empty(p.indices.shape, dtype=torch.float32, device="cuda")

    def run():
        tlbws.tilelang_sparse_bwd_dense(p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
                                        deterministic=False, head_sums=hs, config=config)

    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time / 1e3 / 3
    log(f"S={seq} backward by kernel (ms per call, config {config}):")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        log(f"  {ms:8.3f}  {name[:110]}")
    log(f"  {sum(per.values()):8.3f}  total")
    # the GPU idle wherever the host has not issued the next kernel yet (the wall minus the total)
    wall, host = idle_ms(run, 5, warmup=0)
    log(f"  {wall:8.3f}  wall (CUDA events, median of 5); the host took {host:.3f} ms to issue it")
    busy = _busy_gpu(2 * host + 5.0)
    gpu, issue, late = queued_ms(run, busy, 5, warmup=1)
    log(f"  {gpu:8.3f}  wall with the host ahead (issued behind {busy.ms:.1f} ms of queued matmuls, median of 5; the "
        f"host took {issue:.3f} ms){f'; {late} of 5 runs not queued' if late else ''}")
    if host_top:
        from host_profile import host_profile

        host_profile(run, 5, host_top, log, busy)


def _busy_gpu(ms: float):
    """A callable that queues about ``ms`` milliseconds of bf16 matmuls (its ``ms``: the time measured for them): the
    work the host issues a call behind in cuda_timing.queued_ms."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = median_ms(lambda: a @ a, 5)
    n = max(1, int(ms / max(one, 1e-3)) + 1)

    def busy():
        for _ in range(n):
            a @ a
    busy.ms = n * one
    return busy


def load_baseline(path):
    """Another copy of ops/triton_sparse_mla.py (e.g. ``git show REV:megatron_glm5/ops/triton_sparse_mla.py >
    FILE``) imported as a module of megatron_glm5.ops, so that its relative imports resolve."""
    import importlib.util
    import os

    name = "megatron_glm5.ops." + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def fwd_round_configs():
    """(row suffix, config) of our warp-specialised forward timed in interleaved rounds: the default (lockstep
    consumers, each kv block gathered in two halves), whole blocks, the L2 hints (KV_HINTS), the products as
    asynchronous wgmma (WS_ASYNC_CONFIG), persistent thread blocks (one per SM, token after token; also with async
    wgmma, and bounded), bounded (each query stops after its last used slot: the causal padding of early tokens not
    computed; 10 % slower in session 20; its loop bounds' cost cut in session 21) and the staggered consumers
    (tilelang_sparse_mla_staggered), last."""
    from megatron_glm5.ops import tilelang_sparse_mla_staggered as stg
    from megatron_glm5.ops import tilelang_sparse_mla_ws as ws

    return ((", warp-specialised", ws.WS_CONFIG), (", warp-specialised, whole blocks", ws.WS_WHOLE_BLOCKS_CONFIG),
            (", warp-specialised, L2 hints", ws.WS_L2_HINTS_CONFIG),
            (", warp-specialised, async wgmma", ws.WS_ASYNC_CONFIG),
            (", warp-specialised, persistent", ws.WS_PERSISTENT_CONFIG),
            (", warp-specialised, persistent async", ws.WS_PERSISTENT_ASYNC_CONFIG),
            (", warp-specialised, persistent bounded", ws.WS_PERSISTENT_BOUNDED_CONFIG),
            (", warp-specialised, bounded", ws.WS_BOUNDED_CONFIG),
            (", warp-specialised, staggered", stg.WS_STAGGERED_CONFIG))


def _flashmla_row(p, reps, add):
    """FlashMLA's sparse prefill forward (the peer), when FlashMLA is built on this machine."""
    from megatron_glm5.ops import flashmla_sparse_mla

    if flashmla_sparse_mla.probe_flash_mla():
        add("sparse_mla fwd (FlashMLA flash_mla_sparse_fwd)", timed(
            lambda: flashmla_sparse_mla.flash_mla_sparse_forward(p.q, p.kv, p.indices, p.scale, DV), p.refill, reps),
            p.fwd_flop)


def bench(seq, reps, with_reference, log, peak=PEAK_TFLOPS, tilelang_examples=None, bwd_only=False,
          bwd_variants=None, baseline=None, dense_match=None, rounds=3, fwd_only=False, fwd_match=None):
    from megatron_glm5.ops import reference, triton_indexer, triton_kl
    from megatron_glm5.ops import triton_sparse_mla as tsm

    p = Problem(seq)
    rows = []

    def add(kernel, ms, flop=None, spread=None):
        row = dict(seq=seq, kernel=kernel, ms=round(ms, 3))
        if spread:  # the rounds' medians (interleaved_ms), when there were several
            row["ms_rounds"] = [round(x, 3) for x in spread]
        if flop:
            row["tflops"] = round(flop / ms / 1e9, 1)
            row["pct_of_peak"] = round(100 * row["tflops"] / peak, 1)
        rows.append(row)
        log(f"S={seq:6d} {kernel:38s} {ms:9.2f} ms" + (
            f" {row['tflops']:7.1f} TFLOP/s ({row['pct_of_peak']:.0f}% of {peak:.0f})" if flop else "") + (
            f"  rounds {min(spread):.2f}-{max(spread):.2f} ms" if spread else ""))

    from megatron_glm5.ops import tilelang_sparse_mla

    has_tilelang = tilelang_sparse_mla.probe_tilelang()

    def tilelang_rows(label, fn, configs, n_reps, flop=None, n_rounds=1):
        """One row per (label suffix, config) of one of our TileLang kernels (compiled outside the timing); with
        n_rounds > 1 the configurations are timed in interleaved rounds and each row is the median of its rounds."""
        runs = {}
        for suffix, cfg in configs:
            run = functools.partial(fn, config=cfg)
            try:
                run()
            except Exception as e:  # one configuration that fails to build or run does not end the benchmark
                log(f"S={seq:6d} {label.format(suffix)}: FAILED {type(e).__name__}: {str(e)[-300:]}")
                continue
            runs[label.format(suffix)] = run
        for name, ms in interleaved_ms(runs, p.refill, n_reps, n_rounds).items():
            add(name, median(ms), flop, ms if n_rounds > 1 else None)

    def ws_forward_rows(unused_too=False):
        """Our warp-specialised forward's configurations (fwd_round_configs) in interleaved rounds (rows of one
        configuration drift by up to 4.5 % over a run: session 17); unused_too: each also with every slot unused
        (-1: nothing gathered after the first block pair, every product and the softmax still run -- what the
        gathers cost; the TFLOP/s column counts the same work)."""
        configs = [c for i, c in enumerate(fwd_round_configs())
                   if i == 0 or fwd_match is None or re.search(fwd_match, c[0])]
        tilelang_rows("sparse_mla fwd (our TileLang{})", functools.partial(
            tilelang_sparse_mla.tilelang_sparse_fwd, p.q, p.kv, p.indices, p.scale, DV), configs, reps,
            p.fwd_flop, rounds)
        if unused_too:  # not bounded: with no slot used it has no step to run
            tilelang_rows("sparse_mla fwd (our TileLang{}, every slot unused)", functools.partial(
                tilelang_sparse_mla.tilelang_sparse_fwd, p.q, p.kv, torch.full_like(p.indices, -1), p.scale, DV),
                [c for c in configs if not c[1].get("bounded")], reps, p.fwd_flop, rounds)

    if fwd_only:  # our TileLang forward's configurations alone (FlashMLA's in the same run when it is built here)
        _slot_ends_rows(p, reps, add)
        if has_tilelang:
            ws_forward_rows(unused_too=True)
        _flashmla_row(p, reps, add)
        torch.cuda.empty_cache()
        return rows
    if bwd_only:  # the sparse MLA rows alone: the forward, then every backward variant (ours in TileLang too)
        out, lse = _fwd_bwd_rows(p, reps, add, tsm, bwd_variants, baseline)
        _slot_ends_rows(p, reps, add)
        if has_tilelang:
            ws_forward_rows()
            _dense_bwd_rows(p, out, lse, reps, add, dense_match)
        torch.cuda.empty_cache()
        return rows
    add("indexer_topk (triton)", timed(lambda: triton_indexer.indexer_topk(
        p.qi, p.ki, p.w, TOPK, p.key_start, p.query_end, DI ** -0.5), p.refill, max(5, reps // 4)))
    add("indexer_topk (torch.topk + driver, no scores)", timed(lambda: triton_indexer.chunked_topk(
        p.qi, p.ki, p.w, TOPK, p.key_start, p.query_end, lambda *a: None), p.refill, max(5, reps // 4)))
    if has_tilelang:  # our TileLang indexer scores + the same top-k
        from megatron_glm5.ops import tilelang_indexer

        tilelang_rows("indexer_topk (our TileLang{})", functools.partial(
            tilelang_indexer.tilelang_indexer_topk, p.qi, p.ki, p.w, TOPK, p.key_start, p.query_end, DI ** -0.5),
            (("", tilelang_indexer.INDEXER_CONFIG), (", pipelined", tilelang_indexer.PIPELINED_INDEXER_CONFIG)),
            max(5, reps // 4))
    out, lse = _fwd_bwd_rows(p, reps, add, tsm, bwd_variants, baseline)
    add("indexer KL target (head probs, 2 passes)", timed(
        lambda: triton_kl.head_summed_probs(p.q, p.kv, p.indices, p.scale, DV), p.refill, max(5, reps // 4)))
    add("indexer KL target (head probs, fwd lse)", timed(
        lambda: triton_kl.head_summed_probs(p.q, p.kv, p.indices, p.scale, DV, attn_lse=lse), p.refill,
        max(5, reps // 4)))
    if has_tilelang:  # our TileLang one-pass head sums
        from megatron_glm5.ops import tilelang_kl

        tilelang_rows("indexer KL target (head probs, fwd lse, our TileLang{})", functools.partial(
            tilelang_kl.tilelang_head_summed_probs, p.q, p.kv, p.indices, p.scale, DV, lse),
            (("", tilelang_kl.PROB_CONFIG), (", plain loop", tilelang_kl.PLAIN_PROB_CONFIG)), max(5, reps // 4))
    qi, ki, w = (x.detach().requires_grad_() for x in (p.qi, p.ki, p.w))
    for det in (False, True):
        add(f"indexer KL loss fwd+grad ({'deterministic' if det else 'atomic'})", timed(
            lambda: triton_kl.indexer_kl_loss_sparse(qi, ki, w, DI ** -0.5, p.q, p.kv, p.scale, p.indices, DV,
                                                     attn_lse=lse, deterministic=det)[0].backward(),
            p.refill, max(5, reps // 4)))
    _flashmla_row(p, reps, add)
    if has_tilelang:  # our TileLang forward and backward
        from megatron_glm5.ops import tilelang_sparse_mla_bwd, tilelang_sparse_mla_ws

        tilelang_rows("sparse_mla fwd (our TileLang{})", functools.partial(
            tilelang_sparse_mla.tilelang_sparse_fwd, p.q, p.kv, p.indices, p.scale, DV),
            ((", warp-specialised", tilelang_sparse_mla_ws.WS_CONFIG),
             (", warp-specialised, whole blocks", tilelang_sparse_mla_ws.WS_WHOLE_BLOCKS_CONFIG),
             *fwd_round_configs()[3:],  # async wgmma, persistent, bounded (stops after the last used slot), staggered
             (", plain loop", tilelang_sparse_mla.FWD_CONFIG),
             (", pipelined", tilelang_sparse_mla.PIPELINED_CONFIG),
             (", pipelined, 64 rows", tilelang_sparse_mla.PIPELINED64_CONFIG)), reps,
            p.fwd_flop)
        tilelang_rows("sparse_mla bwd (our TileLang, atomic{})", functools.partial(
            tilelang_sparse_mla_bwd.tilelang_sparse_bwd, p.q, p.kv, p.indices, out, lse, p.d_out, None, p.scale, DV,
            deterministic=False), (("", tilelang_sparse_mla_bwd.BWD_CONFIG),
                                   (", narrow", tilelang_sparse_mla_bwd.NARROW_BWD_CONFIG)), reps, 2.5 * p.fwd_flop)
        _dense_bwd_rows(p, out, lse, reps, add, dense_match)
    from megatron_glm5.ops import cudnn_backend

    # peer kernels, when the cuDNN frontend's DSA ops load here (the backend's probe loads each op's CuTe-DSL module)
    cudnn = cudnn_backend.CudnnBackend()
    has_cudnn = cudnn.has_dsa()
    if not has_cudnn:
        log(f"(cuDNN DSA not timed: {cudnn.unavailable_reason()[:200]})")
    if has_cudnn:
        add("sparse_mla bwd (cuDNN DSA)", timed(
            lambda: cudnn_backend.cudnn_sparse_backward(p.q, p.kv, p.indices, out, lse, p.d_out, p.scale),
            p.refill, reps), 2.5 * p.fwd_flop)
        add("indexer_topk (cuDNN DSA)", timed(lambda: cudnn_backend.CudnnBackend().indexer_topk(
            p.qi, p.ki, p.w, TOPK, p.key_start, p.query_end, DI ** -0.5), p.refill, max(5, reps // 4)))
    if tilelang_examples:  # peer kernels: TileLang's public deepseek_v32 examples, same inputs and timer
        import peer_tilelang

        peer_tilelang.add_rows(p, tilelang_examples, add, timed, reps, DV)
    if with_reference:
        add("sparse_mla fwd (torch reference)", timed(
            lambda: reference.sparse_mla(p.q, p.kv, p.indices, p.scale, DV), p.refill, max(3, reps // 8)),
            p.fwd_flop)
        q, kv = p.q.detach().requires_grad_(), p.kv.detach().requires_grad_()

        def ref_fwd_bwd():
            o, _ = reference.sparse_mla(q, kv, p.indices, p.scale, DV)
            o.backward(p.d_out)

        add("sparse_mla fwd+bwd (torch reference)", timed(ref_fwd_bwd, p.refill, max(3, reps // 8)),
            3.5 * p.fwd_flop)
        add("indexer_topk (torch reference)", timed(lambda: reference.indexer_topk(
            p.qi, p.ki, p.w, TOPK, p.key_start, p.query_end, DI ** -0.5), p.refill, 3))
    torch.cuda.empty_cache()
    return rows


MOE_HIDDEN, MOE_EXPERTS, MOE_TOPK = 6144, 256, 8


def bench_moe_permute(tokens, reps, log):
    """MoE token permute + unpermute at GLM-5 sizes (hidden 6144, 256 experts, top-8, bf16 tokens, fp32 probs):
    our fused Triton kernels (--moe-permute-fusion, row map included) against megatron-core's unfused ops.
    GB/s counts the minimal traffic of the hidden rows: each of permute / unpermute, forward and backward, reads
    or writes T rows once and T * top-k rows once (4 * T * (1 + topk) * hidden * 2 bytes for fwd+bwd)."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_glm5.ops import triton_moe_permute

    dev = "cuda"
    x = torch.empty(tokens, MOE_HIDDEN, device=dev, dtype=torch.bfloat16)
    grad = torch.empty_like(x)
    scores = torch.empty(tokens, MOE_EXPERTS, device=dev)
    state = {}

    def refill():
        x.normal_()
        grad.normal_()
        scores.uniform_()
        idx = scores.topk(MOE_TOPK, dim=-1).indices
        state["map"] = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
        state["probs"] = (scores * state["map"]).requires_grad_()

    def run(impl, backward):
        xs = x.detach().requires_grad_(backward)
        rows, pprobs, mapping, _, _ = impl.permute(xs, state["map"], probs=state["probs"],
                                                   num_out_tokens=tokens * MOE_TOPK)
        out = impl.unpermute(rows, mapping, xs.shape)
        if backward:
            torch.autograd.backward((out, pprobs), (grad, torch.ones_like(pprobs)))

    rows = []
    row_bytes = tokens * (1 + MOE_TOPK) * MOE_HIDDEN * 2
    for name, impl in (("fused triton", triton_moe_permute), ("megatron unfused", moe_utils)):
        for backward in (False, True):
            ms = timed(lambda: run(impl, backward), refill, reps)
            gbs = (4 if backward else 2) * row_bytes / ms / 1e6
            label = f"moe permute+unpermute {'fwd+bwd' if backward else 'fwd'} ({name})"
            rows.append(dict(seq=tokens, kernel=label, ms=round(ms, 3), gbps=round(gbs, 1)))
            log(f"T={tokens:6d} {label:52s} {ms:9.3f} ms {gbs:8.1f} GB/s")
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seq", type=int, default=8192)
    ap.add_argument("--reference-max-seq", type=int, default=4096,
                    help="time the torch reference only up to this sequence length (it is slow)")
    ap.add_argument("--moe-tokens", type=int, nargs="*", default=[4096, 16384],
                    help="token counts for the MoE permute/unpermute rows (none: skip them)")
    ap.add_argument("--tilelang-examples", default=None, metavar="DIR",
                    help="also time TileLang's example kernels: the examples/deepseek_v32 folder of a tile-ai/tilelang "
                         "checkout (benchmarks/peer_tilelang.py)")
    ap.add_argument("--bwd-only", action="store_true",
                    help="only the sparse MLA forward and backward rows, Triton's and (with tilelang) our TileLang "
                         "dense backward's (and only the backward's sweep)")
    ap.add_argument("--fwd-only", action="store_true",
                    help="only our TileLang forward's configurations, in interleaved rounds (--rounds), each also "
                         "with every slot unused (nothing gathered after the first block pair: what the gathers "
                         "cost), and FlashMLA's forward when it is built here")
    ap.add_argument("--profile-bwd", action="store_true",
                    help="also print where our TileLang backward's GPU time goes, kernel by kernel (torch profiler), "
                         "its wall time from an idle GPU and with the host ahead, and the host's issue time")
    ap.add_argument("--profile-bwd-host", type=int, default=0, metavar="N",
                    help="with --profile-bwd: also the host's cProfile of the default backward, its top N functions")
    ap.add_argument("--bwd-variants", default=None,
                    help="comma-separated names of BWD_VARIANTS to time (default: all)")
    ap.add_argument("--dense-match", default=None, metavar="REGEX",
                    help="time only the variants of our TileLang dense backward whose row text this regular "
                         "expression finds (the four default rows always; default: every variant)")
    ap.add_argument("--fwd-match", default=None, metavar="REGEX",
                    help="with --fwd-only / --bwd-only: time only the forward configurations whose row suffix this "
                         "regular expression finds (the default configuration always; default: every one)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --bwd-only / --fwd-only: time our TileLang forward's configurations in this many "
                         "interleaved rounds and report each one's median round (default 3)")
    ap.add_argument("--bwd-baseline", default=None, metavar="FILE",
                    help="also time the default backward of this copy of ops/triton_sparse_mla.py in the same run "
                         "(e.g. git show REV:megatron_glm5/ops/triton_sparse_mla.py > FILE)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                    help="the GPU's measured bf16 matmul TFLOP/s, for the %% of peak column (default: the H200's)")
    args = ap.parse_args(argv)
    if args.profile_bwd_host and not args.profile_bwd or args.profile_bwd_host < 0:
        ap.error(f"--profile-bwd-host {args.profile_bwd_host}: a positive number of functions, with --profile-bwd")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_kernels.py needs a CUDA GPU")

    def log(msg):
        print(msg, flush=True)

    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    t0 = time.time()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps,
                  flop_convention="fwd = 2*T*h*topk*(576+512); bwd = 2.5 x fwd; fwd+bwd = 3.5 x fwd")
    if args.sweep:
        result["sweep"] = sweep(args.sweep_seq, max(5, args.reps // 2), log,
                                only=("bwd", "bwd_dense") if args.bwd_only else None)
    from megatron_glm5.ops import triton_sparse_mla as tsm

    result["fwd_config"], result["bwd_config"] = dict(tsm.FWD_CONFIG), dict(tsm.BWD_CONFIG)
    result["rows"] = []
    variants = args.bwd_variants.split(",") if args.bwd_variants else None
    baseline = load_baseline(args.bwd_baseline) if args.bwd_baseline else None
    for seq in args.seqs:
        result["rows"] += bench(seq, args.reps, seq <= args.reference_max_seq, log, args.peak_tflops,
                                args.tilelang_examples, args.bwd_only, variants, baseline, args.dense_match,
                                args.rounds, args.fwd_only, args.fwd_match)
        if args.profile_bwd:
            profile_dense_bwd(seq, log, host_top=args.profile_bwd_host)
            if seq <= 8192:
                profile_dense_bwd(seq, log, dict(DENSE_PIECE_ROWS=256))
                profile_dense_bwd(seq, log, dict(DENSE_PIECE_ROWS=256, ZEROS="complement"))
    for tokens in args.moe_tokens:
        result["rows"] += bench_moe_permute(tokens, args.reps, log)
    log(f"total {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
