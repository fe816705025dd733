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
