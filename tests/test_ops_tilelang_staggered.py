"""The staggered warp-specialised TileLang forward (megatron_glm5/ops/tilelang_sparse_mla_staggered.py) as lowered
for sm_90a -- each role's schedule in the CUDA source, no GPU needed -- and its results on a GPU (marked gpu)."""

import importlib.util
import re

import pytest
import torch

from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops import tilelang_sparse_mla_staggered as tls

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may opt into on sm_90
DV = 512


def lowered(**kw):
    return tlm.lower_artifact(tls.build_sparse_fwd_staggered(64, DV, 64, 2048, 576 ** -0.5, **kw))


def in_order(part, *needles):
    """The positions of needles in part, each found after the previous one (AssertionError naming the missing one)."""
    at, out = 0, []
    for n in needles:
        i = part.find(n, at)
        assert i >= 0, f"{n!r} not found after position {at}"
        out.append(i)
        at = i + len(n)
    return out


@needs_tilelang
def test_each_role_keeps_its_staggered_schedule_after_lowering(tmp_path):
    """Consumer 0: its max published before its softmax, its own p V from registers (wgmma_rs) right after, its
    buffer's first half freed, then the pair's max waited for, its p stored for consumer 1 (buffer 0's rope part,
    fenced), consumer 1's p V, the next block's q k^T issued before that product is waited for (wait_wgmma<1>).
    Consumer 1: q k^T on buffer 1's second half first, consumer 0's max folded in before its softmax, its p V from
    registers, its p stored (p1_sh) for consumer 0, consumer 0's p V, both second halves freed.  Producer: the four
    half-buffers in the order they are freed.  With nvcc (the device): no more than the known 432 bytes of spills."""
    from test_ops_tilelang import nvcc_cubin
    from test_ops_tilelang_ws import role_sources

    art = lowered()
    src = art.kernel_source
    assert tlm.dynamic_shared_bytes(art) <= H100_SHARED_BYTES
    assert "__syncthreads" not in src[src.index("tl::warpgroup_reg_alloc<"):]  # the roles never meet block-wide
    c0, c1, producer = role_sources(src)
    assert "warpgroup_reg_alloc<232>" in c0 and "warpgroup_reg_alloc<232>" in c1
    assert "warpgroup_reg_dealloc<40>" in producer
    for part in (c0, c1):
        assert part.count("wgmma_rs<") == 1  # own p from registers
        assert part.count("AllReduce<tl::MaxOp") == 1 and part.count("AllReduce<tl::SumOp") == 1
        assert "Idx[" in part and re.search(r"\*\(uint1\*\)\(Out \+", part)
    assert c0.count("wgmma_ss<") == 7  # q k^T (3 pieces) before the loop and for the next block, consumer 1's p V
    assert c1.count("wgmma_ss<") == 4  # q k^T (3 pieces), consumer 0's p V
    loop0 = c0[c0.index("for (int it = 0"):]
    in_order(loop0, "bar_m0[0].arrive", "exp2f", "wgmma_rs<", "wait_wgmma<0>", "bar_free_lo[0].arrive",
             "bar_m1[0].wait", "k0_rope)", "fence_proxy_async", "bar_p0[0].arrive", "bar_p1[0].wait",
             "p1_sh)[0]", "bar_lo[0].wait", "q_lat)[0]", "wait_wgmma<1>", "bar_free_lo[1].arrive",
             "bar_ready[0].wait", "wait_wgmma<0>")
    in_order(c1, "bar_ready[1].wait", "q_lat)[0])) + 32768", "k1_rope", "bar_lo[1].wait", "wait_wgmma<0>",
             "bar_m0[0].wait", "bar_m1[0].arrive", "exp2f", "wgmma_rs<", "p1_sh)[", "fence_proxy_async",
             "bar_p1[0].arrive", "bar_p0[0].wait", "k0_rope)[0]", "wait_wgmma<1>", "bar_free_hi[1].arrive",
             "wait_wgmma<0>", "bar_free_hi[0].arrive")
    assert "Lse[" in c0 and "Lse[" not in c1
    waits = re.findall(r"(bar_free_(?:lo|hi))\[(\d)\]\.wait", producer)
    assert waits == [("bar_free_lo", "0"), ("bar_free_hi", "1"), ("bar_free_hi", "0"), ("bar_free_lo", "1")]
    done = re.findall(r"mbarrier_cp_async_arrive_noinc\((bar_\w+)\[(\d)\]", producer)
    assert done == [("bar_lo", "0"), ("bar_ready", "1"), ("bar_ready", "0"), ("bar_lo", "1")]
    report = nvcc_cubin(tmp_path, src)
    if report is not None:  # consumer 1 keeps its q k^T's wgmma descriptors on the stack (session 18: 432 bytes on
        # the H200's nvcc and CUDA 13.0's ptxas alike); more would mean a new spill
        spilled = re.search(r"(\d+) bytes spill stores", report)
        assert spilled is None or int(spilled.group(1)) <= 432, report


def test_builder_rejects_shapes_and_register_splits_it_cannot_take():
    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="d_rope == 64"):
        tls.build_sparse_fwd_staggered(64, 512, 32, 2048, 0.1)
    with pytest.raises(ValueError, match="d_v % 128"):
        tls.build_sparse_fwd_staggered(64, 448, 64, 2048, 0.1)
    with pytest.raises(ValueError, match="consumer_regs"):
        tls.build_sparse_fwd_staggered(64, 512, 64, 2048, 0.1, consumer_regs=240, producer_regs=32)


def test_wrapper_passes_the_kernel_q_kv_idx_out_lse(monkeypatch):
    """Through tilelang_sparse_fwd: top-k padded to 128 slots with -1, heads padded to 64, no Ends argument; a
    stand-in kernel computing the reference on what it is given reproduces the reference."""
    from megatron_glm5.ops import reference
    from test_ops_tilelang import _inputs
    from test_ops_triton import rel_l2

    seen = []

    def stand_in(q, kv, idx, out, lse):
        seen.append((q.shape, idx.shape))
        o, l_ = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.1, DV)
        out.copy_(o)
        lse.copy_(l_)

    monkeypatch.setattr(tlm, "compiled_kernel", lambda builder, *a, **k: (
        stand_in if builder is tls.build_sparse_fwd_staggered else pytest.fail(f"built {builder}")))
    q, kv, idx = _inputs(5, 300, 16, 200, seed=3, empty_rows=(2,))
    out, lse = tlm.tilelang_sparse_fwd(q, kv, idx, 0.1, DV, config=tls.WS_STAGGERED_CONFIG)
    assert seen == [((5, 64, 576), (5, 256))]
    ro, rl = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.1, DV)
    assert out.shape == (5, 16, DV) and rel_l2(out, ro) <= 1e-2
    assert torch.isneginf(lse[2]).all() and rel_l2(lse[[0, 1, 3, 4]], rl[[0, 1, 3, 4]]) <= 1e-2


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TILELANG and torch.cuda.is_available()), reason="needs a CUDA GPU and tilelang")
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_staggered_forward_real_shapes(layout):
    """GLM-5 shapes (64 heads, d_qk 576, top-k 2048, S 4096): out / lse within 1e-2 of the fp32 reference, every
    NaN-poisoned entry written, and close to the lockstep kernel (same maths, p rounded at another point)."""
    from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws
    from test_ops_triton import gpu_sparse_problem, rel_l2

    pr = gpu_sparse_problem(layout, seed=41)
    out, lse = pr.nan_out, pr.nan_lse
    tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV, config=tls.WS_STAGGERED_CONFIG, out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_l2(out, pr.out) <= 1e-2 and rel_l2(lse, pr.lse) <= 1e-2, (rel_l2(out, pr.out), rel_l2(lse, pr.lse))
    lo, ll = tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV, config=tlws.WS_CONFIG)
    assert rel_l2(out, lo) <= 5e-3 and rel_l2(lse, ll) <= 1e-5, (rel_l2(out, lo), rel_l2(lse, ll))
