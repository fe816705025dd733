"""The warp-specialised TileLang forward (megatron_glm5/ops/tilelang_sparse_mla_ws.py) as lowered for sm_90a: each
of its three roles keeps its whole part in the CUDA source TileLang generates -- no GPU needed.

Two ways TileLang 0.1.15 silently breaks a warp-specialised kernel, both seen on this one (2026-12-01): register
tiles (fragments) shared by the two consumer branches lose the second branch's element-wise work (consumer 1 had
no score mask, no softmax, no acc init, no Out / m1_sh / l1_sh stores: rel. L2 1.04 on the H200), and roles written
as separate ``if`` blocks get a block-wide ``__syncthreads()`` between them (the producer would wait there while the
consumers wait for its data). The GPU tests of its results are in tests/test_ops_tilelang.py.
"""

import importlib.util
import re

import pytest

from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")


def role_sources(src):
    """The consumer 0, consumer 1 and producer parts of the lowered kernel: each starts at its setmaxnreg."""
    starts = [m.start() for m in re.finditer(r"tl::warpgroup_reg_(alloc|dealloc)<", src)]
    assert len(starts) == 3, starts
    return [src[a:b] for a, b in zip(starts, starts[1:] + [len(src)])]


def stores(part, buf):
    return re.findall(rf"\(\(float\*\){buf}\)\[[^;]*\] = ", part)


def test_each_role_keeps_its_whole_part_after_lowering():
    src = tlm.lower_to_cuda(tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5))
    *consumers, producer = role_sources(src)
    assert "__syncthreads" not in src[src.index("tl::warpgroup_reg_alloc<"):]  # the roles never meet block-wide
    assert "warpgroup_reg_dealloc<40>" in producer and producer.count("mbarrier_cp_async_arrive_noinc") == 2
    for c, part in enumerate(consumers):
        assert "warpgroup_reg_alloc<232>" in part
        assert "make_float4(" in part  # acc (and row sums, max) initialised
        assert f"bar_ready[{c}].wait" in part and "Idx[" in part  # its own buffer, its own slots masked
        assert part.count("exp2f(") >= 2  # rescale factor and p
        assert part.count("AllReduce<tl::MaxOp") == 1 and part.count("AllReduce<tl::SumOp") == 1
        assert stores(part, f"m{c}_sh") and stores(part, f"l{c}_sh")  # publishes its max / its row sums
        assert not stores(part, f"m{1 - c}_sh") and not stores(part, f"l{1 - c}_sh")
        assert f"bar_p[{c}].arrive" in part and f"bar_p[{1 - c}].wait" in part
        assert part.count("wgmma_ss<") == 4  # q k^T (latent, rope), own p V, the other consumer's p V
        assert re.search(r"\*\(uint1\*\)\(Out \+", part)  # writes its half of the output columns
    assert "Lse[" in consumers[0] and "Lse[" not in consumers[1]


def test_wrapper_bounds_each_querys_loop_by_its_last_used_slot(monkeypatch):
    """The bounded kernel (WS_BOUNDED_CONFIG) gets Ends = the 128-slot steps up to each query's last used slot; a stand-in
    that reads only those steps must give the reference's out / lse (rows without keys: 0 steps)."""
    import torch

    from megatron_glm5.ops import reference
    from test_ops_tilelang import _inputs
    from test_ops_triton import rel_l2

    seen = []

    class StandIn:
        def __call__(self, q, kv, idx, ends, out, lse):
            assert ends.dtype == torch.int32 and ends.shape == (q.shape[0],)
            seen.append(ends.clone())
            cut = idx.clone()
            cut[torch.arange(idx.shape[1])[None, :] >= 128 * ends.long()[:, None]] = -1  # what the kernel reads
            o, l_ = reference.sparse_mla(q.float(), kv.float(), cut.long(), 0.1, 512)
            out.copy_(o)
            lse.copy_(l_)

    monkeypatch.setattr(tlm, "compiled_kernel", lambda *a, **k: StandIn())
    q, kv, idx = _inputs(6, 400, 64, 300, seed=8, empty_rows=(4,))
    idx[1, 100:] = -1  # a causal-like tail: one step
    idx[2, 129:] = -1  # slot 128 used: two steps
    out, lse = tlws.tilelang_sparse_fwd_ws(q, kv, idx, 0.1, 512, config=tlws.WS_BOUNDED_CONFIG)
    ro, rl = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.1, 512)
    used = (idx >= 0).int()
    last = torch.where(used.any(1), idx.shape[1] - used.flip(1).argmax(1), 0)
    assert torch.equal(seen[0].long(), (last + 127) // 128) and seen[0][1] == 1 and seen[0][2] == 2
    assert seen[0][4] == 0
    assert rel_l2(out, ro) <= 1e-2 and torch.equal(torch.isneginf(lse), torch.isneginf(rl))


@pytest.mark.parametrize("kernel", ["forward", "backward scores"])
def test_l2_hints_reach_the_gathers_and_q_loads(tmp_path, kernel):
    """kv_hint / q_evict_first in the lowered source: every kv copy of the producer through the hinted function
    (none through TileLang's own cp.async), no barrier among the producer's threads between rows, q's TMA loads
    with the evict-first hint; without hints the source is TileLang's plain gather.  With nvcc (the device), the
    hinted copies' inline PTX assembles for sm_90a."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
    from test_ops_tilelang import nvcc_cubin

    def lower(**kw):
        if kernel == "forward":
            return tlm.lower_to_cuda(tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, early_release=True,
                                                              **kw))
        return tlm.lower_to_cuda(tlbws.build_sparse_pds_ws(64, 512, 64, 2048, 576 ** -0.5, 64, 2048, **kw))

    plain = lower(kv_hint=None, q_evict_first=False)
    assert "glm5_cp_async16" not in plain and "EVICT_FIRST" not in plain
    assert plain.count("cp_async_gs") >= 4  # latent and rope copies of both buffers
    for hint, fn in (("evict_last", "glm5_cp_async16_evict_last("),
                     ("evict_last_256b", "glm5_cp_async16_evict_last_256b(")):
        src = lower(kv_hint=hint, q_evict_first=True)
        producer = role_sources(src)[2]
        assert producer.count(fn) == 4 and "cp_async_gs" not in producer  # latent + rope, both buffers
        assert "__sync_thread_partial" not in producer
        assert producer.count("mbarrier_cp_async_arrive_noinc") == 2  # the copies still complete the ready barriers
        assert src.count("tma_load<tl::CacheHintSm90::EVICT_FIRST>") == 2
        assert "createpolicy.fractional.L2::evict_last" in src
        report = nvcc_cubin(tmp_path, src)
        if report is not None:
            assert " 0 bytes spill stores" in report, report
    with pytest.raises(ValueError, match="kv_hint must be one of"):
        lower(kv_hint="evict_first")


@pytest.mark.parametrize("kernel", ["forward", "backward scores"])
def test_split_ready_gathers_each_block_in_two_halves(tmp_path, kernel):
    """split_ready in the lowered source: the producer completes a "lo" barrier after the first latent half of each
    block and the "ready" barrier after the rest; each consumer waits for lo, multiplies q's first latent half,
    then waits for ready and multiplies the second (its descriptors 32,768 bytes on: 4 of the 8 swizzled 64-column
    atoms of [64, 512] bf16); without it the source has no lo barrier."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
    from test_ops_tilelang import nvcc_cubin

    def lower(**kw):
        if kernel == "forward":
            return tlm.lower_to_cuda(tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, early_release=True,
                                                              **kw))
        return tlm.lower_to_cuda(tlbws.build_sparse_pds_ws(64, 512, 64, 2048, 576 ** -0.5, 64, 2048, **kw))

    assert "bar_lo" not in lower()
    src = lower(split_ready=True)
    *consumers, producer = role_sources(src)
    assert [m.group(1) for m in re.finditer(r"mbarrier_cp_async_arrive_noinc\((bar_\w+)\[", producer)] == [
        "bar_lo", "bar_ready", "bar_lo", "bar_ready"]
    for c, part in enumerate(consumers):
        lo, ready = part.index(f"bar_lo[{c}].wait"), part.index(f"bar_ready[{c}].wait")
        first = part.index("initialize_wgmma_descriptor", lo)
        second = part.index("initialize_wgmma_descriptor", ready)
        assert lo < first < ready < second
        assert "q_lat)[0]" in part[first:ready] and "+ 32768" in part[second:second + 200]
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert " 0 bytes spill stores" in report, report


def test_async_wgmma_waits_only_where_a_result_or_a_buffer_is_needed(tmp_path):
    """WS_ASYNC_CONFIG in the lowered source: each consumer issues the same five products as the default
    (wgmma_ss: q k^T's two latent halves and rope part, p V of both blocks) but waits three times per step
    instead of five -- once after q k^T (before the mask reads the scores), then wait_wgmma<1> before freeing the
    even buffer and wait_wgmma<0> before freeing the odd one -- with no T.gemm wait left; the roles never meet
    block-wide; ptxas spills nothing. The builder refuses it without early_release."""
    from test_ops_tilelang import nvcc_cubin

    def lower(**kw):
        cfg = {k: v for k, v in dict(tlws.WS_CONFIG, **kw).items() if k not in ("builder", "topk_multiple",
                                                                              "fast_math")}
        return tlm.lower_to_cuda(tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, **cfg))

    default, src = lower(), lower(async_wgmma=True)
    assert "__syncthreads" not in src[src.index("tl::warpgroup_reg_alloc<"):]
    for c, (was, part) in enumerate(zip(role_sources(default)[:2], role_sources(src)[:2])):
        assert part.count("tl::wgmma_ss<") == was.count("tl::wgmma_ss<") == 5
        assert was.count("warpgroup_wait<0>") == 5 and "warpgroup_wait<" not in part
        assert re.findall(r"wait_wgmma<(\d)>", part) == ["0", "1", "0"]
        mask_reads = part.index("Idx[")
        assert part.index("wait_wgmma<0>") < mask_reads  # the scores complete before the mask reads them
        even, odd = part.index(f"bar_free[{2 * 0}].arrive"), part.index(f"bar_free[{2 * 0 + 1}].arrive")
        assert part.index("wait_wgmma<1>") < even < part.rindex("wait_wgmma<0>") < odd
    with pytest.raises(ValueError, match="async_wgmma needs early_release"):
        tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, async_wgmma=True, early_release=False)
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert " 0 bytes spill stores" in report, report


def test_async_wgmma_in_the_backward_scores_kernel_waits_once_per_step(tmp_path):
    """build_sparse_pds_ws(async_wgmma=True) in the lowered source: each consumer issues the same products as the
    default (q k^T's three parts, dO v^T, the head sums' p^T ones) but the four of a step before the mask wait once
    (wait_wgmma<0>, before the scores and dp are read) instead of four times; only the head sums' product keeps its
    own wait; no more ptxas spills than the default's."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
    from test_ops_tilelang import nvcc_cubin

    def lower(**kw):
        cfg = {k: v for k, v in dict(tlbws.PDS_WS_CONFIG, **kw).items() if k != "fast_math"}
        return tlm.lower_to_cuda(tlbws.build_sparse_pds_ws(64, 512, 64, 2048, 576 ** -0.5, 64, 2048, **cfg))

    default, src = lower(), lower(async_wgmma=True)
    for was, part in zip(role_sources(default)[:2], role_sources(src)[:2]):
        assert part.count("tl::wgmma_") == was.count("tl::wgmma_") == 5
        assert re.findall(r"warpgroup_wait<(\d)>", was) == ["0"] * 5
        assert re.findall(r"warpgroup_wait<(\d)>", part) == ["0"] and re.findall(r"wait_wgmma<(\d)>", part) == ["0"]
        assert part.index("wait_wgmma<0>") < part.index("Idx[")  # both products done before the mask reads them
    for name in ("default", "async"):
        (tmp_path / name).mkdir()
    spills = [nvcc_cubin(tmp_path / name, s) for name, s in (("default", default), ("async", src))]
    if spills[0] is not None:
        stores = [re.search(r"(\d+) bytes spill stores", r).group(1) for r in spills]
        assert int(stores[1]) <= int(stores[0]), spills


def test_persistent_forward_loads_the_next_q_once_both_consumers_are_done_with_the_current(tmp_path):
    """WS_PERSISTENT_CONFIG's kernel (persistent=132) in the lowered source: every role loops over its thread
    block's items (ceil((n_q - block) / 132) of them); q is TMA-loaded by the producer only, per item, after waiting
    for bar_qfree -- which each consumer arrives on once per item, right after its last q k^T and before the mask --
    with bar_q counting the producer's 128 threads; the parities of bar_q and bar_l follow the item count, those of
    the kv buffers the steps of all items so far; the per-token code is the default's (same products); ptxas
    spills nothing; with bounded each role sums its items' steps read from Ends and a token without a step frees its
    q at once. A grid that is not a positive int is refused."""
    from test_ops_tilelang import nvcc_cubin

    def lower(**kw):
        cfg = {k: v for k, v in dict(tlws.WS_CONFIG, **kw).items() if k not in ("builder", "topk_multiple",
                                                                              "fast_math")}
        return tlm.lower_to_cuda(tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, **cfg))

    default, src = lower(), lower(persistent=132)
    prologue = src[:src.index("tl::warpgroup_reg_alloc<")]
    assert "tma_load" not in prologue and "bar_q[0].init(128)" in prologue and "bar_qfree[0].init(256)" in prologue
    assert "__syncthreads" not in src[src.index("tl::warpgroup_reg_alloc<"):]
    *consumers, producer = role_sources(src)
    for part in (*consumers, producer):
        loop = re.search(r"for \(int (k\w*) = 0; \1 < \(\(\(\(n_q \+ 131\) - \(\(int\)blockIdx\.x\)\) / 132\)", part)
        assert loop, part[:400]
    k = re.search(r"for \(int (k\w*) = 0", producer).group(1)
    assert producer.count("tma_load(") == 2 and producer.count("bar_q[0].arrive()") == 1
    assert producer.index(f"bar_qfree[0].wait((({k} & 1) ^ 1))") < producer.index("tma_load(")
    assert f"bar_free[0].wait((((({k} * 16) +" in producer
    for was, part in zip(role_sources(default)[:2], consumers):
        k = re.search(r"for \(int (k\w*) = 0", part).group(1)
        assert part.count("tl::wgmma_ss<") == was.count("tl::wgmma_ss<") == 5 and "tma_load" not in part
        assert f"bar_q[0].wait(({k} & 1))" in part and f"bar_l[0].wait(({k} & 1))" in part
        free = re.findall(r"if \(\(?it\w* == 15\)?\) \{\s*bar_qfree\[0\]\.arrive\(\);", part)
        assert len(free) == 1 and part.count("bar_qfree") == 1
        assert part.index("tl::wgmma_ss<") < part.index("bar_qfree") < part.index("Idx[")
    for bad in (True, -4, 1.5):
        with pytest.raises(ValueError, match="persistent must be a positive int"):
            tlws.build_sparse_fwd_ws(64, 512, 64, 2048, 576 ** -0.5, persistent=bad)
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert " 0 bytes spill stores" in report, report
    # bounded too: each role reads the item's steps from Ends and sums them for the kv buffers' parities; a token
    # without a step frees its q at once
    src = lower(persistent=132, bounded=True)
    *consumers, producer = role_sources(src)
    for part, steps in ((consumers[0], "steps0"), (consumers[1], "steps1"), (producer, "steps_p")):
        k = re.search(r"for \(int (k\w*) = 0", part).group(1)
        assert f"{steps}[1] = 0;" in part and f"{steps}[1] = ({steps}[1] + {steps}[0]);" in part
        assert re.search(rf"{steps}\[0\] = min\(Ends\[\(\(\(\(int64_t\){k}\) \* \(int64_t\)132\) \+", part), part[:600]
    for part in consumers:
        assert part.count("bar_qfree[0].arrive()") == 2 and re.search(r"if \(\(?n_it\w* == 0\)?\) \{\s*bar_qfree", part)
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert " 0 bytes spill stores" in report, report


def test_persistent_scores_kernel_loads_the_next_q_once_both_consumers_are_done_with_the_current(tmp_path):
    """build_sparse_pds_ws(persistent=132) in the lowered source (bounded, the default): every role loops over its
    thread block's items; q is TMA-loaded by the producer only, per item, after waiting for bar_qfree, which each
    consumer arrives on after its last q k^T and dO v^T (or at once for a token without a step); each role reads an
    item's steps from Ends and sums them for the kv buffers' parities; the ones matrix is written before the roles
    split (a block-wide barrier between); the per-token products are the default's. Every step (bounded False):
    the parities count k x 16 steps. A grid that is not a positive int is refused."""
    from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws

    def lower(**kw):
        cfg = {k: v for k, v in dict(tlbws.PDS_WS_CONFIG, **kw).items() if k != "fast_math"}
        return tlm.lower_to_cuda(tlbws.build_sparse_pds_ws(64, 512, 64, 2048, 576 ** -0.5, 64, 2048, **cfg))

    default, src = lower(), lower(persistent=132)
    prologue = src[:src.index("tl::warpgroup_reg_alloc<")]
    assert "tma_load" not in prologue and "bar_q[0].init(128)" in prologue and "bar_qfree[0].init(256)" in prologue
    assert "__syncthreads();" in prologue[prologue.index("ones)["):]  # the ones written before any role reads them
    *consumers, producer = role_sources(src)
    for part, steps in ((consumers[0], "steps0"), (consumers[1], "steps1"), (producer, "steps_p")):
        loop = r"for \(int (k\w*) = 0; \1 < \(\(\(\(n_q \+ 131\) - \(\(int\)blockIdx\.x\)\) / 132\)"
        k = re.search(loop, part).group(1)
        assert f"{steps}[1] = ({steps}[1] + {steps}[0]);" in part
        assert re.search(rf"{steps}\[0\] = min\(Ends\[\(\(\(\(int64_t\){k}\) \* \(int64_t\)132\) \+", part)
    k = re.search(r"for \(int (k\w*) = 0", producer).group(1)
    assert producer.count("tma_load(") == 2 and producer.count("bar_q[0].arrive()") == 1
    assert producer.index(f"bar_qfree[0].wait((({k} & 1) ^ 1))") < producer.index("tma_load(")
    for was, part in zip(role_sources(default)[:2], consumers):
        k = re.search(r"for \(int (k\w*) = 0", part).group(1)
        assert part.count("tl::wgmma_") == was.count("tl::wgmma_") and "tma_load" not in part
        assert f"bar_q[0].wait(({k} & 1))" in part and part.count("bar_qfree[0].arrive()") == 2
        assert re.search(r"if \(\(?n_it\w* == 0\)?\) \{\s*bar_qfree", part)
        assert part.index("tl::wgmma_") < part.index("bar_qfree") < part.index("Idx[")
    every = lower(persistent=132, bounded=False)
    k = re.search(r"for \(int (k\w*) = 0", role_sources(every)[2]).group(1)
    assert f"bar_free[0].wait((((({k} * 16) +" in role_sources(every)[2] and "Ends[" not in every
    for bad in (True, -1):
        with pytest.raises(ValueError, match="persistent must be a positive int"):
            tlbws.build_sparse_pds_ws(64, 512, 64, 2048, 576 ** -0.5, 64, 2048, persistent=bad)
