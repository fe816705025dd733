"""Issue 16's fusions measured on one GPU, in one process (prints one JSON document):

    python benchmarks/fusions.py [--seqs 4096 32768] [--proxy-seq 4096] [--json out.json]

* ``kl_target``: per layer at S tokens (GLM-5 shapes: 64 heads, d_qk 576, d_v 512, top-k 2048, indexer 32 x 128,
  bf16; top-k from our Triton indexer on random inputs): the Triton sparse forward alone, the forward writing the KL
  target's head sums (``head_probs``), the separate head-sum kernel given the forward's lse, and the whole sparse KL
  (head sums + the fused indexer KL kernel, forward-side gradients) either way.
* ``indexer_kl`` (``--parts indexer_kl``, not in the default list): the fused indexer KL kernel alone at each of
  --seqs, without gradients and with them by each d_k_idx path (atomic / dense, both modes), after our indexer's
  top-k with the log-sum-exp it leaves and with the kernel's own first pass, and the opt-in tile form
  (ops/triton_kl_tiles.py) with its block shapes, against the slot form (values, bitwise repeat).
* ``cross_entropy``: the output layer + LM cross entropy at --ce-tokens tokens x 6144 hidden x 154,880 vocabulary,
  forward + backward: megatron-core's unfused path against ``--cross-entropy-fusion chunked`` and ``--fusions
  auto``'s compiled cross entropy (model/fused_cross_entropy.py) after the same output GEMM; time and the peak
  memory above the inputs.
* ``proxy``: benchmarks/proxy_step.py's model (GLM-5 width, 4 layers, 256 experts, indexer KL on, --attn triton)
  built once, one training step (forward + backward) with the cross entropy unfused and chunked; median ms and peak
  memory.
* ``regions`` (``--parts regions``, not in the default list): --fusions op by op at --proxy-seq tokens, GLM-5
  widths, bf16: each compiled region of model/fusions.py and megatron-core's two SwiGLU fusions against the eager
  path, forward + backward (the sum of the output as the loss), ms.
* ``autotune``: ops/autotune.py's benchmark (the one ``--attn auto`` runs) of the Triton backend, atomic and
  deterministic, and its own wall time; ranked through ``autotune.rank`` with the cache in --cache-dir.
Timing: CUDA events, --warmup then the median of --reps; fresh random inputs (never zeros) outside the timed region.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import median_ms  # noqa: E402

H, DQK, DV, TOPK, HI, DI = 64, 576, 512, 2048, 32, 128


def timed(fn, refill, warmup, reps):
    return median_ms(fn, reps, warmup, refill)


def bench_kl_target(seq, warmup, reps):
    from megatron_glm5.ops import triton_indexer, triton_kl, triton_sparse_mla

    dev = torch.device("cuda")
    bf = torch.bfloat16
    q = torch.empty(seq, H, DQK, device=dev, dtype=bf)
    kv = torch.empty(seq, DQK, device=dev, dtype=bf)
    qi = torch.empty(seq, HI, DI, device=dev, dtype=bf)
    ki = torch.empty(seq, DI, device=dev, dtype=bf)
    w = torch.empty(seq, HI, device=dev, dtype=torch.float32)

    def refill():
        for t in (q, kv, qi, ki):
            t.normal_()
        w.uniform_(0.1, 1.0)

    refill()
    ks = torch.zeros(seq, device=dev, dtype=torch.int64)
    qe = torch.arange(seq, device=dev, dtype=torch.int64)
    idx = triton_indexer.indexer_topk(qi, ki, w, TOPK, ks, qe, DI ** -0.5)
    scale = DQK ** -0.5
    probs = torch.empty(idx.shape, device=dev, dtype=torch.float32)
    lse = triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, DV)[1]
    res = {"seq": seq}
    res["fwd_ms"] = timed(lambda: triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, DV), refill, warmup, reps)
    res["fwd_with_head_probs_ms"] = timed(
        lambda: triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, DV, head_probs=probs), refill, warmup, reps)
    res["separate_head_probs_ms"] = timed(
        lambda: triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=lse), refill, warmup, reps)
    # agreement of the two head-sum paths on the last inputs
    triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, DV, head_probs=probs)
    lse = triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, DV)[1]
    sep = triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=lse)
    res["head_probs_max_abs_diff"] = float((probs - sep).abs().max())

    qi_g, ki_g, w_g = (t.clone().requires_grad_() for t in (qi, ki, w))

    def kl(head_sums):
        return lambda: triton_kl.indexer_kl_loss_sparse(qi_g, ki_g, w_g, DI ** -0.5, q, kv, scale, idx, DV,
                                                        attn_lse=lse, attn_head_probs=head_sums)

    res["kl_separate_ms"] = timed(kl(None), refill, warmup, reps)
    res["kl_given_head_probs_ms"] = timed(kl(probs), refill, warmup, reps)
    res["saving_per_layer_ms"] = (res["fwd_ms"] + res["kl_separate_ms"]
                                  - res["fwd_with_head_probs_ms"] - res["kl_given_head_probs_ms"])
    del q, kv, qi, ki, w, idx, probs
    torch.cuda.empty_cache()
    return res


# the tile form's block shapes / chunk rows timed beside its default (triton_kl_tiles.TILE_CONFIG)
TILE_VARIANTS = {"t2_n64_w4": dict(BLOCK_T=2, BLOCK_N=64, num_warps=4), "t4_n32": dict(BLOCK_N=32),
                 "t4_n128": dict(BLOCK_N=128, num_stages=1), "t4_n64_w4": dict(num_warps=4),
                 "t4_n64_s3": dict(num_stages=3), "rows2048": dict(ROWS=2048), "rows512": dict(ROWS=512)}


def bench_indexer_kl(seq, warmup, reps):
    """The fused indexer KL kernel alone (``triton_kl.indexer_kl_grads``, GLM-5's indexer: 32 heads x 128, top-k
    2048 causal from our indexer, head sums given): without gradients, and with them by each d_k_idx path (fp32
    atomics / deterministic rows, "dense": scattered into a zeroed matrix + cuBLAS) in both modes; the paths'
    d_k_idx against the atomic one's on the same inputs."""
    from megatron_glm5.ops import host_windows, triton_indexer, triton_kl

    dev = torch.device("cuda")
    qi = torch.empty(seq, HI, DI, device=dev, dtype=torch.bfloat16)
    ki = torch.empty(seq, DI, device=dev, dtype=torch.bfloat16)
    w = torch.empty(seq, HI, device=dev, dtype=torch.float32)
    hs = torch.empty(seq, TOPK, device=dev, dtype=torch.float32)

    unused = torch.zeros(seq, TOPK, device=dev, dtype=torch.bool)  # set below: the top-k's -1 slots

    def refill():
        qi.normal_()
        ki.normal_()
        w.uniform_(0.1, 1.0)
        hs.uniform_(0.0, 1.0).masked_fill_(unused, 0.0)  # head sums are 0 on unused slots (their contract)

    refill()
    ks = torch.zeros(seq, device=dev, dtype=torch.int64)
    qe = torch.arange(seq, device=dev, dtype=torch.int64)
    idx = triton_indexer.indexer_topk(qi, ki, w * HI ** -0.5, TOPK, ks, qe, DI ** -0.5)
    unused.copy_(idx < 0)
    refill()
    if host_windows.row_ends(idx) is None:  # causal windows: row t selects no key above t
        host_windows.remember_row_ends(idx, torch.arange(seq, dtype=torch.int64))
    res = {"seq": seq}

    def run(need_grad, det=False, dk="atomic", skip=True, form="slots", tiles=None):
        return triton_kl.indexer_kl_grads(qi, ki, w, idx, hs, DI ** -0.5, deterministic=det, need_grad=need_grad,
                                          config=dict(DK=dk, SKIP_PAD=skip, FORM=form, TILES=tiles))

    # the tile form (triton_kl_tiles, opt-in): its default configuration, without gradients, block shapes / chunk rows
    res["tiles_ms"] = timed(lambda: run(True, form="tiles"), refill, warmup, reps)
    res["tiles_no_grad_ms"] = timed(lambda: run(False, form="tiles"), refill, warmup, reps)
    from megatron_glm5.ops import base

    for name, tiles in TILE_VARIANTS.items():
        said = set(base._warned)
        try:
            res[f"tiles_{name}_ms"] = timed(lambda: run(True, form="tiles", tiles=tiles), refill, warmup, reps)
        except Exception as e:  # a shape that does not compile: say so, keep the others
            res[f"tiles_{name}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
        fell_back = [w for w in set(base._warned) - said if "tile form" in w]
        if fell_back:  # the kernel did not fit and the slot form ran: not a tile-form time
            res[f"tiles_{name}_ms"] = f"fell back to the slot form: {fell_back[0][:120]}"
    res["no_grad_ms"] = timed(lambda: run(False), refill, warmup, reps)
    for det in (False, True):
        for dk in ("atomic", "dense"):
            name = f"{dk}_{'deterministic' if det else 'atomic_mode'}"
            res[f"{name}_ms"] = timed(lambda: run(True, det, dk), refill, warmup, reps)
    # after our indexer's top-k of the same inputs (a fresh one per run, outside the timing): the KL given the
    # log-sum-exp the indexer left (one pass over the slots) against its own first pass (INDEXER_LSE off)
    state = {}

    def refill_topk():
        refill()
        state["idx"] = triton_indexer.indexer_topk(qi, ki, w, TOPK, ks, qe, DI ** -0.5)

    for det in (False, True):
        for lse in (True, False):
            name = f"after_topk_{'indexer_lse' if lse else 'two_passes'}_{'deterministic' if det else 'atomic_mode'}"
            res[f"{name}_ms"] = timed(lambda: triton_kl.indexer_kl_grads(
                qi, ki, w, state["idx"], hs, DI ** -0.5, deterministic=det, config=dict(INDEXER_LSE=lse)),
                refill_topk, warmup, reps)
    refill_topk()
    one, two = (triton_kl.indexer_kl_grads(qi, ki, w, state["idx"], hs, DI ** -0.5, config=dict(INDEXER_LSE=lse))
                for lse in (True, False))
    for i, name in ((0, "kl"), (2, "dq"), (3, "dk"), (4, "dw")):
        res[f"indexer_lse_{name}_rel_diff"] = float((one[i] - two[i]).norm() / two[i].norm())
    # the passes over every slot, the causal padding included (before SKIP_PAD)
    res["atomic_atomic_mode_every_slot_ms"] = timed(lambda: run(True, False, "atomic", False), refill, warmup, reps)
    res["dense_deterministic_every_slot_ms"] = timed(lambda: run(True, True, "dense", False), refill, warmup, reps)
    refill()
    dk_ref = run(True)[3]
    for det, dk in ((True, "atomic"), (False, "dense"), (True, "dense")):
        got = run(True, det, dk)[3]
        res[f"{dk}_{'det' if det else 'atomic_mode'}_dk_rel_diff"] = float((got - dk_ref).norm() / dk_ref.norm())
    again = run(True, True, "dense")[3]
    res["dense_bitwise_repeat"] = bool(torch.equal(again, run(True, True, "dense")[3]))
    tiles = run(True, form="tiles")
    slots = run(True)
    for i, name in ((0, "kl"), (2, "dq"), (3, "dk"), (4, "dw")):
        res[f"tiles_{name}_rel_diff"] = float((tiles[i] - slots[i]).norm() / slots[i].norm())
    res["tiles_bitwise_repeat"] = bool(torch.equal(tiles[3], run(True, form="tiles")[3]))
    del qi, ki, w, hs, idx
    torch.cuda.empty_cache()
    return res


def bench_cross_entropy(tokens, hidden, vocab, warmup, reps):
    from megatron.core import tensor_parallel

    from megatron_glm5.model import fused_cross_entropy
    from megatron_glm5.model.linear_cross_entropy import chunked_linear_cross_entropy

    dev = torch.device("cuda")
    h = torch.empty(tokens, 1, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    wt = torch.empty(vocab, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens, 1), device=dev)

    def refill():
        with torch.no_grad():
            h.normal_()
            wt.normal_(std=0.02)
        h.grad = wt.grad = None

    def unfused():
        logits = torch.nn.functional.linear(h, wt)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        loss.sum().backward()
        return loss

    def chunked():
        loss = chunked_linear_cross_entropy(h, wt, labels)
        loss.sum().backward()
        return loss

    def regions():  # --fusions auto's cross entropy (compiled regions) after the same output GEMM
        logits = torch.nn.functional.linear(h, wt)
        loss = fused_cross_entropy.vocab_parallel_cross_entropy(logits, labels, fuse=True)
        loss.sum().backward()
        return loss

    impls = [("unfused", unfused), ("chunked", chunked), ("fused_regions", regions)]
    try:  # the peer, when installed: Liger's fused linear + cross entropy (token slices, bf16 / fp32 accumulators)
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        LigerFusedLinearCrossEntropyLoss = None
    for accum in ((None, torch.float32) if LigerFusedLinearCrossEntropyLoss is not None else ()):
        liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=accum)

        def liger(liger_loss=liger_loss):
            loss = liger_loss(wt, h.view(tokens, hidden), labels.view(tokens))
            loss.backward()
            return loss.reshape(1) / tokens
        impls.append((f"liger_{'fp32' if accum else 'bf16'}_accum", liger))
    res = {"tokens": tokens, "hidden": hidden, "vocab": vocab}
    for name, fn in impls:
        refill()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn()
        torch.cuda.synchronize()
        res[f"{name}_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        res[f"{name}_loss_mean"] = float(loss.float().mean())
        res[f"{name}_ms"] = timed(fn, refill, warmup, reps)
    # each one's gradients against the unfused path's, on the same inputs
    refill()
    inputs = h.detach().clone(), wt.detach().clone()
    unfused()
    g_ref = h.grad.float(), wt.grad.float()
    for name, fn in impls[1:]:
        with torch.no_grad():
            h.copy_(inputs[0])
            wt.copy_(inputs[1])
        h.grad = wt.grad = None
        fn()
        res[f"{name}_grad_rel_diff"] = [float((a - b.grad.float()).norm() / a.norm()) for a, b in zip(g_ref, (h, wt))]
    res["grad_rel_diff"] = res["chunked_grad_rel_diff"]
    del h, wt, labels
    torch.cuda.empty_cache()
    return res


def bench_proxy(seq, warmup, reps):
    import proxy_step

    cfg = proxy_step.proxy_config("glm5", 4, 3)
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    model = proxy_step.build_ours(cfg, torch.bfloat16, dev, "triton", 1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    res = {"seq": seq, "variants": []}
    for ce in ("none", "chunked"):
        model.config.cross_entropy_fusion = ce
        times, losses = [], []
        torch.cuda.reset_peak_memory_stats()
        for i in range(warmup + reps):
            ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen).to(dev)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = proxy_step.step_ours(model, ids)
            b.record()
            torch.cuda.synchronize()
            losses.append(float(loss))
            if i >= warmup:
                times.append(a.elapsed_time(b))
            for p in model.parameters():
                p.grad = None
        res["variants"].append(dict(cross_entropy_fusion=ce, ms=statistics.median(times),
                                    peak_gib=torch.cuda.max_memory_allocated() / 2**30, losses=losses))
    del model
    torch.cuda.empty_cache()
    return res


def bench_autotune(cache_dir):
    from megatron_glm5.ops import autotune
    from megatron_glm5.ops.triton_backend import TritonBackend

    class Named(TritonBackend):
        def __init__(self, name, deterministic):
            super().__init__(deterministic=deterministic)
            self.name = name

    shape = autotune.AttnShape(heads=H, d_qk=DQK, d_v=DV, topk=TOPK, index_heads=HI, index_dim=DI)
    cache = Path(cache_dir) / "attn_auto.json"
    cands = [Named("triton-deterministic", True), Named("triton", False)]
    t0 = time.perf_counter()
    order, ms = autotune.rank(cands, shape, cache_path=cache)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    order2, _ = autotune.rank(cands, shape, cache_path=cache)
    cached_s = time.perf_counter() - t0
    return {"shape": shape.bucket(), "ms": ms, "order": [b.name for b in order],
            "order_from_cache": [b.name for b in order2], "benchmark_wall_s": first_s, "cached_wall_s": cached_s,
            "cache_key": autotune.cache_key(shape)}


def bench_regions(tokens, warmup, reps, match=None):
    """--fusions op by op: each fused region (model/fusions.py), megatron-core's SwiGLU fusions and ours
    (model/swiglu.py), forward + backward at GLM-5 widths, eager against fused (a compilation in the warm-up)."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl

    from megatron_glm5.model import fusions
    from megatron_glm5.model.absorbed_mla import absorbed_query, expanded_output
    from megatron_glm5.model.mla import latent_key
    from megatron_glm5.model.moe import glm5_topk_routing
    from megatron_glm5.model.norm import rms_norm
    from megatron_glm5.model.rope import apply_interleaved_rope, rope_prefix
    from megatron_glm5.model.swiglu import swiglu

    dev, bf = torch.device("cuda"), torch.bfloat16
    ang = torch.rand(tokens, 1, 32, device=dev) * tokens
    cos, sin = ang.cos(), ang.sin()
    q = torch.randn(tokens, 1, H, 256, device=dev, dtype=bf)
    rows = tokens * 8  # routed experts: each token at its 8 experts
    router = lambda *a, fuse: glm5_topk_routing(*a, fuse=fuse)[0]
    dense_glu = lambda y: F.silu(y[:, :y.shape[1] // 2]) * y[:, y.shape[1] // 2:]

    def expert_glu(h, w):
        act = F.silu(h[:, :2048]) * h[:, 2048:]
        return (act.float() * w.float().unsqueeze(-1)).to(act.dtype)

    # the path before model/absorbed_mla.py: einsum, then its region (RoPE + cat), then the token-order view
    cat_region = fusions.Region(lambda ql, qr, c, s: torch.cat([ql, apply_interleaved_rope(qr, c, s)], dim=-1))

    def query_einsum(q_, w_uk, fuse):
        q_lat = torch.einsum("sbhn,hnc->sbhc", q_[..., :192], w_uk)
        return cat_region(q_lat, q_[..., 192:], cos, sin, fuse=fuse).transpose(0, 1).reshape(tokens, H, 576)

    def output_einsum(o, w_uv, fuse):  # likewise: einsum, then the sequence-first copy
        return torch.einsum("thc,hvc->thv", o, w_uv).reshape(1, tokens, H * 256).transpose(0, 1).contiguous()

    cases = {  # name: (eager fn, fused fn, tensors with gradients, other arguments)
        "rms_norm hidden": (rms_norm, None, [torch.randn(tokens, 1, 6144, device=dev, dtype=bf),
                                             torch.ones(6144, device=dev, dtype=bf)], [1e-5]),
        "rms_norm q latent": (rms_norm, None, [torch.randn(tokens, 1, 2048, device=dev, dtype=bf),
                                               torch.ones(2048, device=dev, dtype=bf)], [1e-6]),
        "latent_key (norm+rope+cat)": (latent_key, None, [torch.randn(tokens, 1, 576, device=dev, dtype=bf),
                                                          torch.ones(512, device=dev, dtype=bf)],
                                       [1e-6, cos, sin, 512]),
        "query absorption, einsum + cat (before)": (query_einsum, None, [q, torch.randn(H, 192, 512, device=dev,
                                                                                     dtype=bf)], []),
        "query absorption, absorbed_mla": (lambda q_, w, fuse: absorbed_query(q_, w, cos, sin, fuse=fuse), None,
                                           [q, torch.randn(H, 192, 512, device=dev, dtype=bf)], []),
        "output expansion, einsum + copy (before)": (output_einsum, None, [
            torch.randn(tokens, H, 512, device=dev, dtype=bf), torch.randn(H, 256, 512, device=dev, dtype=bf)], []),
        "output expansion, absorbed_mla": (lambda o, w, fuse: expanded_output(o, w, tokens, 1), None, [
            torch.randn(tokens, H, 512, device=dev, dtype=bf), torch.randn(H, 256, 512, device=dev, dtype=bf)], []),
        "indexer rope_prefix q": (rope_prefix, None, [torch.randn(tokens, 1, HI, DI, device=dev, dtype=bf)],
                                  [cos, sin, 64]),
        "router top-k": (router, None, [torch.randn(tokens, 256, device=dev)],
                         [torch.zeros(256, device=dev), 8, 1, 1, True, 2.5]),
        "swiglu dense (mcore)": (lambda y, fuse: dense_glu(y), lambda y: bias_swiglu_impl(y, None),
                                 [torch.randn(tokens, 2 * 12288, device=dev, dtype=bf)], []),
        "swiglu experts weighted (mcore)": (
            lambda h, w, fuse: expert_glu(h, w), lambda h, w: weighted_bias_swiglu_impl(h, None, w.unsqueeze(-1)),
            [torch.randn(rows, 2 * 2048, device=dev, dtype=bf), torch.rand(rows, device=dev)], []),
        # ours (model/swiglu.py -> ops/triton_swiglu.py: --fusions auto's SwiGLU since session 13)
        "swiglu dense (ours)": (lambda y, fuse: swiglu(y, fuse=fuse), None,
                                [torch.randn(tokens, 2 * 12288, device=dev, dtype=bf)], []),
        "swiglu experts weighted (ours)": (lambda h, w, fuse: swiglu(h, w, fuse=fuse), None,
                                           [torch.randn(rows, 2 * 2048, device=dev, dtype=bf),
                                            torch.rand(rows, device=dev)], []),
    }
    res = {}
    for name, (eager, fused, grads, rest) in cases.items():
        if match and match not in name:
            continue
        leaves = [t.detach().requires_grad_() for t in grads]

        def refill():
            with torch.no_grad():
                for t in leaves:
                    t.normal_() if t.dtype == bf else t.uniform_(0.1, 1.0)
            for t in leaves:
                t.grad = None

        def step(fuse):
            out = fused(*leaves, *rest) if (fuse and fused is not None) else eager(*leaves, *rest, fuse=fuse)
            out.float().sum().backward()

        res[name] = {"eager_ms": timed(lambda: step(False), refill, warmup, reps),
                     "fused_ms": timed(lambda: step(True), refill, warmup + 1, reps)}
        print(f"{name:34s} eager {res[name]['eager_ms']:7.3f} ms  fused {res[name]['fused_ms']:7.3f} ms", flush=True)
    return {"tokens": tokens, "fwd_bwd": res}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="*", default=[4096, 32768])
    p.add_argument("--proxy-seq", type=int, default=4096, help="0: no proxy step")
    p.add_argument("--ce-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--parts", default="kl_target,cross_entropy,autotune,proxy")
    p.add_argument("--cache-dir", default="/tmp/megatron_glm5_attn_auto")
    p.add_argument("--regions-match", default=None, metavar="TEXT",
                   help="--parts regions: only the ops whose name contains TEXT (e.g. swiglu)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from megatron_glm5 import platform

    platform.initialize_model_parallel()
    parts = args.parts.split(",")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%d")}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    if "kl_target" in parts:
        out["kl_target"] = [bench_kl_target(s, args.warmup, args.reps) for s in args.seqs]
        print(json.dumps(out["kl_target"]), flush=True)
    if "indexer_kl" in parts:
        out["indexer_kl"] = [bench_indexer_kl(s, args.warmup, args.reps) for s in args.seqs]
        print(json.dumps(out["indexer_kl"]), flush=True)
    if "cross_entropy" in parts:
        out["cross_entropy"] = bench_cross_entropy(args.ce_tokens, 6144, 154880, args.warmup, args.reps)
        print(json.dumps(out["cross_entropy"]), flush=True)
    if "autotune" in parts:
        out["autotune"] = bench_autotune(args.cache_dir)
        print(json.dumps(out["autotune"]), flush=True)
    if "regions" in parts:
        out["regions"] = bench_regions(args.proxy_seq or 4096, args.warmup, args.reps, args.regions_match)
    if "proxy" in parts and args.proxy_seq:
        out["proxy"] = bench_proxy(args.proxy_seq, args.warmup, args.reps)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
