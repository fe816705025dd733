"""Our warp-specialised TileLang scores kernel of the sparse MLA backward + cuBLAS products
(megatron_glm5/ops/tilelang_sparse_mla_bwd_ws.py, ``--attn tilelang``'s default backward).

CPU with tilelang installed: the kernel lowers for sm_90a with each role's whole part (and, with nvcc, no spills);
the host wrapper (head padding, top-k padding, per-pair loop ends, query chunks, the cuBLAS products, head sums,
fallbacks) runs around a stand-in kernel that implements the kernel's contract in torch.
GPU (@pytest.mark.gpu): the real kernel at GLM-5 shapes against the fp32 reference.
"""

import importlib.util
import logging
import re

import pytest
import torch

from megatron_glm5.ops import host_windows, reference
from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
from megatron_glm5.ops import triton_sparse_mla as tsm
from test_ops_tilelang import _inputs, _reference_grads, nvcc_cubin
from test_ops_tilelang_ws import role_sources
from test_ops_triton import rel_l2

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
DQK, DV = 576, 512
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")


def _remember_bounds(idx):
    """The host row bounds the indexer leaves for its top-k lists (here read back from the test's lists)."""
    host_windows.remember_row_ends(idx, idx.max(1).values.long().cpu())


def _reference_head_sums(q, kv, idx, scale, lse):
    """sum over heads of exp(scale q.kv - lse) per (query, slot), 0 on unused slots and heads without keys."""
    ok = (idx >= 0) & (idx < kv.shape[0])
    k = kv.float()[idx.long().clamp(0, kv.shape[0] - 1)]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), k) * scale
    lse = lse.float().masked_fill(torch.isneginf(lse), float("inf"))
    p = torch.exp(s - lse[:, :, None]) * ok[:, None, :]
    return p.sum(1)


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the lowered kernel
# ----------------------------------------------------------------------------------------------------------------------


@needs_tilelang
@pytest.mark.parametrize("head_sums", [True, False])
def test_scores_kernel_lowers_with_each_roles_part(tmp_path, head_sums):
    art = tlm.lower_artifact(tlbws.build_sparse_pds_ws(64, DV, 64, 2048, DQK ** -0.5, 64, 2048,
                                                       head_sums=head_sums))
    src = art.kernel_source
    assert tlm.dynamic_shared_bytes(art) <= 227 * 1024
    *consumers, producer = role_sources(src)
    assert "__syncthreads" not in src[src.index("tl::warpgroup_reg_alloc<"):]  # the roles never meet block-wide
    # no reduction through the named barriers 1 / 2 that TileLang's cross-warp AllReduce uses for BOTH consumers
    assert "NamedBarrier" not in src
    assert "warpgroup_reg_dealloc<24>" in producer and producer.count("mbarrier_cp_async_arrive_noinc") == 2
    for c, part in enumerate(consumers):
        assert "warpgroup_reg_alloc<240>" in part
        assert f"bar_ready[{c}].wait" in part and f"bar_free[{c}].arrive" in part
        assert f"bar_ready[{1 - c}]" not in part and f"bar_free[{1 - c}]" not in part
        assert part.count("wgmma_ss<") == (3 if head_sums else 2) and part.count("wgmma_rs<") == 1  # dO from registers
        assert "exp2f(" in part
        # each slot's 64 heads to P and DS as 16-byte vectors from the staged tiles
        assert re.search(r"\*\(uint4\*\)\(DS \+", part) and re.search(r"\*\(uint4\*\)\(P \+", part)
        assert ("HS[" in part) == head_sums
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert "0 bytes spill stores" in report, report


@needs_tilelang
def test_scores_builder_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match=r"topk \(2000\) of 128"):
        tlbws.build_sparse_pds_ws(64, DV, 64, 2000, 0.1, 64, 2000)
    with pytest.raises(ValueError, match="d_rope == 64"):
        tlbws.build_sparse_pds_ws(64, 256, 32, 2048, 0.1, 64, 2048)
    with pytest.raises(ValueError, match="must be at most 504"):
        tlbws.build_sparse_pds_ws(64, DV, 64, 2048, 0.1, 64, 2048, consumer_regs=248, producer_regs=24)
    with pytest.raises(ValueError, match="head sums need all heads in one block"):
        tlbws.build_sparse_pds_ws(128, DV, 64, 2048, 0.1, 128, 2048, head_sums=True)


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the host wrapper around a stand-in kernel
# ----------------------------------------------------------------------------------------------------------------------


class StandInScores:
    """The kernel's contract in torch, checking what the wrapper passes (64 heads, top-k a multiple of 128, int32,
    Ends = block pairs up to the last used slot)."""

    def __init__(self, heads, d_v, d_rope, topk, scale, heads_real, topk_real, head_sums, **cfg):
        assert heads == 64 and topk % 128 == 0
        self.scale, self.h, self.topk_real, self.head_sums = scale, heads_real, topk_real, head_sums
        self.calls = []

    def __call__(self, q, kv, idx, d_o, lse, delta, ends, ds_mat, p_mat, hs):
        assert idx.dtype == torch.int32 and ends.dtype == torch.int32 and q.shape[1] == 64
        assert all(t.is_contiguous() for t in (q, kv, idx, d_o, lse, delta, ends, ds_mat, p_mat))
        n, kc = q.shape[0], ds_mat.shape[0]
        assert ds_mat.shape == p_mat.shape == (kc, n, self.h)
        used = (idx >= 0) & (idx < kv.shape[0])
        last = torch.where(used.any(1), idx.shape[1] - used.flip(1).int().argmax(1), 0)
        assert torch.equal(ends.long(), (last + 127) // 128)
        self.calls.append((n, kc))
        k = kv.float()[idx.long().clamp(0, kv.shape[0] - 1)]
        s = torch.einsum("thd,tkd->thk", q.float(), k) * self.scale
        dp = torch.einsum("thv,tkv->thk", d_o.float(), k[..., :d_o.shape[-1]])
        lse_ = lse.masked_fill(torch.isneginf(lse), float("inf"))
        p = torch.exp(s - lse_[:, :, None]) * used[:, None, :]
        ds = p * (dp - delta[:, :, None]) * self.scale
        for t in range(n):
            for j in torch.nonzero(used[t]).flatten().tolist():
                key = int(idx[t, j])
                assert (ds_mat[key, t] == 0).all() and (p_mat[key, t] == 0).all()  # zeroed where it writes
                ds_mat[key, t] = ds[t, :self.h, j].to(ds_mat.dtype)
                p_mat[key, t] = p[t, :self.h, j].to(p_mat.dtype)
        if self.head_sums:
            hs.copy_(p.sum(1)[:, :self.topk_real])


def _stand_in(monkeypatch, chunk_bytes=None):
    made = []

    def compiled(builder, *sizes, pass_configs=None, **cfg):
        assert builder is tlbws.build_sparse_pds_ws
        made.append(StandInScores(*sizes, **cfg))
        return made[-1]

    monkeypatch.setattr(tlbws, "compiled_kernel", compiled)
    # the plan's chunk buffers start as NaN: a product reading an entry that nothing zeroed or wrote shows
    monkeypatch.setattr(tsm, "_chunk_buffer", lambda size, dtype, device: torch.full(
        (size,), float("nan"), dtype=dtype, device=device))
    # Delta = rowsum(out * d_out) - d_lse in torch (the Triton kernel's contract; no GPU here)
    monkeypatch.setattr(tsm, "bwd_delta", lambda out, d_out, d_lse: (out.float() * d_out.float()).sum(-1) - (
        0 if d_lse is None else d_lse.float()))
    if chunk_bytes is not None:
        monkeypatch.setattr(tsm, "PDS_BUFFER_BYTES", chunk_bytes)
    return made


@pytest.mark.parametrize("heads,topk,with_dlse,chunked", [(64, 200, False, False), (16, 96, True, True),
                                                          (48, 130, False, True)])
def test_wrapper_matches_the_reference_with_head_sums(monkeypatch, heads, topk, with_dlse, chunked):
    """Against the fp32 reference: dq, dkv (through the cuBLAS products of the stand-in's dS / P matrices) and the
    head sums, over one or several query chunks, heads padded to 64, top-k padded to 128, rows without keys."""
    n_q, n_k, scale = 9, 300, 0.05
    # a chunk's buffer per query row is 2 * n_k * heads * 2 bytes: 3 rows per chunk when chunked
    made = _stand_in(monkeypatch, chunk_bytes=3 * 4 * n_k * heads if chunked else None)
    q, kv, idx = _inputs(n_q, n_k, heads, topk, seed=heads, empty_rows=(2,))
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(n_q, heads, DV, generator=gen).bfloat16()
    d_lse = torch.randn(n_q, heads, generator=gen) if with_dlse else None
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, scale, d_out, d_lse)
    _remember_bounds(idx)
    dq = torch.full_like(q, float("nan"))
    hs = torch.full(idx.shape, float("nan"))
    got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, d_lse, scale, DV,
                                                      deterministic=False, dq=dq, head_sums=hs)
    assert len(made) == 1 and len(made[0].calls) == (3 if chunked else 1)
    assert got_dq.data_ptr() == dq.data_ptr() and got_dkv.dtype == kv.dtype
    assert not got_dq.isnan().any() and not hs.isnan().any()
    assert (got_dq[2] == 0).all() and (hs[2] == 0).all()  # the row without keys
    assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2
    assert rel_l2(hs, _reference_head_sums(q, kv, idx, scale, lse)) <= 1e-3


@pytest.mark.parametrize("piece_rows,chunked", [(1, True), (2, True), (4, False), (5, False)])
def test_wrapper_in_pieces_matches_the_reference(monkeypatch, piece_rows, chunked):
    """BWD_CONFIG DENSE_PIECE_ROWS: each chunk's products and memsets piece by piece over the keys its rows may
    select (rows rising as in a causal sequence, two rows without keys): dq, dkv and the head sums still the
    reference's, with NaN where nothing is zeroed or written (so nothing unzeroed is read)."""
    n_q, n_k, topk, scale = 9, 110, 16, 0.05  # 6.9 keys per slot: the dense formulation in both modes
    made = _stand_in(monkeypatch, chunk_bytes=3 * 4 * n_k * 64 if chunked else None)
    q, kv, idx = _low_then_high_inputs(n_q, n_k, topk, seed=piece_rows, step=12)
    idx[[0, 6]] = -1
    gen = torch.Generator().manual_seed(3)
    d_out = torch.randn(n_q, 64, DV, generator=gen).bfloat16()
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, scale, d_out, None)
    _remember_bounds(idx)
    hs = torch.full(idx.shape, float("nan"))
    for det in (False, True):
        got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, None, scale, DV,
                                                          deterministic=det, head_sums=hs,
                                                          config=dict(DENSE_PIECE_ROWS=piece_rows))
        assert not got_dq.isnan().any() and not got_dkv.isnan().any() and (got_dq[[0, 6]] == 0).all()
        assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2
        assert rel_l2(hs, _reference_head_sums(q, kv, idx, scale, lse)) <= 1e-3
    assert len(made[-1].calls) == (3 if chunked else 1)


def test_pieces_multiply_only_the_keys_their_rows_may_select(monkeypatch):
    """The products of one 8-row chunk, causal bounds (row t's last key t), in pieces of 3 rows (ends 3, 6, 8;
    counted by hand): dkv over keys [0, 3) x all 8 rows' columns, [3, 6) x rows 3-7, [6, 8) x rows 6-7; dq of rows
    0-2 over keys [0, 3), 3-5 over [0, 6), 6-7 over [0, 8) -- 43 (key, row) blocks of dkv against the 64 of one
    piece; and the memsets zero exactly dkv's blocks."""
    h, d = 2, 8
    row_hi = torch.arange(8)
    pieces = tsm._host_pieces(row_hi, 8, 8, 3)
    assert pieces == [[(0, 3, 3), (3, 6, 6), (6, 8, 8)]]
    assert tsm._host_pieces(row_hi, 8, 8, 8) == [[(0, 8, 8)]]
    plan = tsm.DensePlan(8, h, 8, pieces, torch.float32, "cpu")
    plan.buffers[0].fill_(float("nan"))
    _, n, kc, ds, p = plan.views(0)
    assert (n, kc) == (8, 8) and ds.shape == (8, 8 * h)
    zeroed = [[not bool(ds[k, r * h:(r + 1) * h].isnan().any()) for r in range(8)] for k in range(8)]
    want = [[r >= (0 if k < 3 else 3 if k < 6 else 6) for r in range(8)] for k in range(8)]
    assert zeroed == want
    assert all(bool(p[k, r * h].isnan()) != w for k, row in enumerate(want) for r, w in enumerate(row))
    seen = []
    monkeypatch.setattr(tsm, "mm_fp32_add_", lambda acc, a, b: seen.append(("dkv", acc.shape[0], a.shape[1] // h)))
    monkeypatch.setattr(tsm, "dense_dq_mm", lambda rows, ds_, kv_: seen.append(("dq", ds_.shape[0],
                                                                                 ds_.shape[1] // h)))
    q, d_out, kv = torch.zeros(8, h, d), torch.zeros(8, h, d // 2), torch.zeros(8, d)
    plan.products(torch.zeros(8, d), torch.zeros(8, h, d), kc, n, 0, q, d_out, kv, d // 2)
    assert seen == [("dkv", 3, 8), ("dkv", 3, 8), ("dq", 3, 3), ("dkv", 3, 5), ("dkv", 3, 5), ("dq", 6, 3),
                    ("dkv", 2, 2), ("dkv", 2, 2), ("dq", 8, 2)]
    assert sum(k * r for what, k, r in seen[::3]) == 43  # one of each dkv pair


def test_pieces_take_a_running_maximum_and_the_setting_is_checked():
    """Bounds that fall inside a chunk (packed documents, rows without keys: -1) give non-decreasing piece ends;
    the last piece's end is the chunk's key end; a bad DENSE_PIECE_ROWS is refused by name."""
    row_hi = torch.tensor([5, 0, -1, 2, 9, 1, -1, -1])
    assert tsm._host_pieces(row_hi, 4, 10, 2) == [[(0, 2, 6), (2, 4, 6)], [(0, 2, 10), (2, 4, 10)]]
    assert tsm._host_pieces(row_hi, 6, 10, 3) == [[(0, 3, 6), (3, 6, 10)], [(0, 2, 0)]]
    assert tsm._host_chunk_key_ends(row_hi, 3, 10) == [6, 10, 0]
    idx = torch.zeros(4, 2, dtype=torch.int32)
    host_windows.remember_row_ends(idx, torch.zeros(4, dtype=torch.int64))
    for bad in (0, -3, 2.5, True, "256"):
        with pytest.raises(ValueError, match=f"DENSE_PIECE_ROWS must be a positive int or None, got {bad!r}"):
            tsm.dense_plan(torch.zeros(4, 2, 8), torch.zeros(4, 8), idx, None, dict(DK="dense", DENSE_PIECE_ROWS=bad))
    plan = tsm.dense_plan(torch.zeros(4, 2, 8), torch.zeros(4, 8), idx, None, dict(DK="dense", DENSE_PIECE_ROWS=64))
    assert plan.pieces == [[(0, 4, 1)]]  # at most the chunk
    for zeros in ("restore", "complement", "sometimes"):  # the plan's zeroing: a mode, with the list where it needs one
        with pytest.raises(ValueError, match=f"DensePlan: zeros '{zeros}'"):
            tsm.DensePlan(4, 2, 4, plan.pieces, torch.float32, "cpu", zeros=zeros)


def test_wrapper_without_head_sums_passes_a_placeholder(monkeypatch):
    made = _stand_in(monkeypatch)
    q, kv, idx = _inputs(4, 50, 64, 128, seed=3)
    d_out = torch.randn(4, 64, DV, generator=torch.Generator().manual_seed(3)).bfloat16()
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.05, d_out, None)
    _remember_bounds(idx)
    got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, None, 0.05, DV)
    assert not made[0].head_sums and len(made[0].calls) == 1
    assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2


def test_wrapper_rejects_head_sums_it_cannot_fill():
    q, kv, idx = _inputs(4, 50, 64, 128, seed=9)
    lse, d_out = torch.zeros(4, 64), torch.zeros(4, 64, DV, dtype=torch.bfloat16)
    for bad in (torch.empty(4, 127), torch.empty(4, 128, dtype=torch.float64), torch.empty(128, 4).t()):
        with pytest.raises(ValueError, match=r"head_sums must be a contiguous fp32 \[T, topk\] = \(4, 128\)"):
            tlbws.tilelang_sparse_bwd_dense(q, kv, idx, d_out, lse, d_out, None, 0.1, DV, head_sums=bad)


def test_wrapper_falls_back_to_triton_once_per_reason(monkeypatch, caplog):
    """No host row bounds (top-k lists from elsewhere), too many heads for one block, fp32: the Triton backward,
    said once per reason."""
    from megatron_glm5.ops import base

    monkeypatch.setattr(base, "_warned", set())
    made = _stand_in(monkeypatch)
    calls = []
    monkeypatch.setattr(tsm, "sparse_mla_bwd", lambda *a, dq=None, head_sums=None, **k: calls.append(
        (a[0].shape[1], a[0].dtype, head_sums is not None)) or (a[0], a[1]))
    caplog.set_level(logging.WARNING)
    cases = [_inputs(4, 50, 64, 128, seed=4), _inputs(4, 50, 128, 128, seed=5),
             _inputs(4, 50, 64, 128, seed=6, dtype=torch.float32)]
    for q, kv, idx in cases[1:]:
        _remember_bounds(idx)
    for _ in range(2):
        for q, kv, idx in cases:
            lse = torch.zeros(q.shape[:2])
            d_out = torch.zeros(q.shape[0], q.shape[1], DV, dtype=q.dtype)
            tlbws.tilelang_sparse_bwd_dense(q, kv, idx, d_out, lse, d_out, None, 0.1, DV,
                                            head_sums=torch.empty(idx.shape))
    assert not made and calls == [(64, torch.bfloat16, True), (128, torch.bfloat16, True),
                                  (64, torch.float32, True)] * 2
    text = caplog.text
    assert text.count("the dense formulation does not apply here (top-k lists without the indexer's host row "
                      "bounds") == 1
    assert text.count("the TileLang dense backward takes at most 64 heads per rank, got 128; using the Triton "
                      "backend") == 1
    assert text.count("the TileLang dense backward is bf16 only") == 1


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real kernel at GLM-5 shapes
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu_tilelang = pytest.mark.skipif(
    not (HAS_TILELANG and HAS_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU, tilelang and triton")


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_dense_backward_real_shapes(layout, monkeypatch):
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem(layout, seed=23)
    q, kv, idx, d_out, scale = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale
    _remember_bounds(idx)
    out, lse = tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV)
    want_hs = torch.empty(idx.shape, dtype=torch.float32, device="cuda")
    tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=False, head_sums=want_hs)

    def no_fallback(*a, **k):
        raise AssertionError("the Triton backward ran")

    monkeypatch.setattr(tsm, "sparse_mla_bwd", no_fallback)
    runs = []
    for det in (False, True, True):
        dq = torch.full_like(q, float("nan"))
        hs = torch.full(idx.shape, float("nan"), device="cuda")
        got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, None, scale, DV,
                                                          deterministic=det, dq=dq, head_sums=hs)
        assert got_dq.data_ptr() == dq.data_ptr()
        for key, got, want in (("dq", got_dq, pr.dq), ("dkv", got_dkv, pr.dkv)):
            assert not got.isnan().any(), key
            assert rel_l2(got, want) <= 1e-2, (key, det, rel_l2(got, want))
        assert not hs.isnan().any() and rel_l2(hs, want_hs) <= 1e-3, rel_l2(hs, want_hs)
        runs.append((got_dq, got_dkv, hs))
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2]))  # bitwise reproducible


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_dense_backward_in_pieces_matches_the_reference(layout, monkeypatch):
    """BWD_CONFIG DENSE_PIECE_ROWS at GLM-5 shapes: the products and memsets (on the side stream: ZERO_AHEAD, and
    with the kept buffer: ZEROS "restore"; and ZEROS "complement", with and without pieces: only the unselected
    entries zeroed) piece by piece over each piece's keys, chunk buffers NaN to start with
    (a product reading an entry nothing zeroed or wrote shows): dq, dkv, head sums against the fp32 reference and
    within a bf16 rounding of one piece per chunk, deterministic bitwise repeatable."""
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem(layout, seed=29)
    q, kv, idx, d_out, scale = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale
    _remember_bounds(idx)
    out, lse = tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV)
    monkeypatch.setattr(tsm, "_chunk_buffer", lambda size, dtype, device: torch.full(
        (size,), float("nan"), dtype=dtype, device=device))

    def run(det, **cfg):
        hs = torch.full(idx.shape, float("nan"), device="cuda")
        dq, dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=det,
                                                  head_sums=hs, config=cfg)
        return dq, dkv, hs

    for det in (False, True):
        whole = run(det)
        for cfg in (dict(DENSE_PIECE_ROWS=256), dict(DENSE_PIECE_ROWS=128, ZEROS="restore"),
                    dict(DENSE_PIECE_ROWS=300, DENSE_ROWS=512), dict(ZEROS="complement"),
                    dict(DENSE_PIECE_ROWS=256, ZEROS="complement")):
            got = run(det, **cfg)
            for key, g, want in (("dq", got[0], pr.dq), ("dkv", got[1], pr.dkv)):
                assert not g.isnan().any(), (key, cfg)
                assert rel_l2(g, want) <= 1e-2, (key, det, cfg, rel_l2(g, want))
            for key, g, w in zip(("dq", "dkv", "head sums"), got, whole):
                assert rel_l2(g, w) <= 4e-3, (key, det, cfg, rel_l2(g, w))  # a bf16 ulp at most
            if det:
                assert all(torch.equal(a, b) for a, b in zip(got, run(det, **cfg))), cfg


@gpu
@needs_gpu_tilelang
def test_gpu_gather_variants_are_bitwise_the_default_backward():
    """The scores kernel gathering each kv block whole (split_ready False) or in two halves (the default), with
    the L2 hints, with its products as asynchronous wgmma, or with persistent thread blocks (the SM count, and 7: 586
    tokens each; bounded, the default, and every step): dq, dkv and the head sums equal the default's bit for bit
    (the same products in the same order)."""
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem("causal", seed=24)
    _remember_bounds(pr.idx)
    out, lse = tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV)
    runs = {}
    for name, cfg in (("default", None), ("whole", dict(split_ready=False)),
                      ("hints", dict(kv_hint="evict_last", q_evict_first=True, split_ready=False)),
                      ("async", dict(async_wgmma=True)), ("persistent", dict(persistent=True)),
                      ("persistent7", dict(persistent=7)), ("persistent_unbounded", dict(persistent=7, bounded=False))):
        hs = torch.full(pr.idx.shape, float("nan"), device="cuda")
        dq, dkv = tlbws.tilelang_sparse_bwd_dense(pr.q, pr.kv, pr.idx, out, lse, pr.d_out, None, pr.scale, DV,
                                                  deterministic=True, head_sums=hs, config=cfg)
        runs[name] = (dq, dkv, hs)
    for name in ("whole", "hints", "async", "persistent", "persistent7", "persistent_unbounded"):
        assert all(torch.equal(a, b) for a, b in zip(runs[name], runs["default"])), name


@gpu
@needs_gpu_tilelang
def test_gpu_dense_backward_zero_ahead_is_bitwise_the_same():
    """Our scores kernel + cuBLAS with and without the side-stream zeroing of the next chunk (DensePlan), 16
    chunks, head sums on: bitwise the same (test_ops_triton.dense_zero_ahead_runs)."""
    from test_ops_triton import dense_zero_ahead_runs

    def backward(pr, idx, cfg):
        out, lse = tlm.tilelang_sparse_fwd(pr.q, pr.kv, idx, pr.scale, DV)
        hs = torch.full(idx.shape, float("nan"), device="cuda")
        dq, dkv = tlbws.tilelang_sparse_bwd_dense(pr.q, pr.kv, idx, out, lse, pr.d_out, None, pr.scale, DV,
                                                  config=cfg, head_sums=hs)
        assert not hs.isnan().any()
        return dq, dkv, hs

    dense_zero_ahead_runs(backward)


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", [None, dict(persistent=7)], ids=["default", "persistent"])
def test_gpu_dense_backward_padded_heads_rows_without_keys_and_lse_gradient(config):
    """Padded heads, rows without keys (persistent: tokens without a step, whose q is freed at once) and d_lse."""
    empty = (0, 7, 299)
    q, kv, idx = (t.cuda() for t in _inputs(300, 500, 16, 200, seed=7, empty_rows=empty))
    _remember_bounds(idx)
    gen = torch.Generator(device="cuda").manual_seed(7)
    d_out = torch.randn(300, 16, DV, device="cuda", generator=gen).bfloat16()
    d_lse = torch.randn(300, 16, device="cuda", generator=gen)
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.04, d_out, d_lse)
    dq = torch.full_like(q, float("nan"))
    hs = torch.full(idx.shape, float("nan"), device="cuda")
    got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, d_lse, 0.04, DV, dq=dq,
                                                      head_sums=hs, config=config)
    assert not got_dq.isnan().any() and not got_dkv.isnan().any() and not hs.isnan().any()
    assert (got_dq[list(empty)] == 0).all() and (hs[list(empty)] == 0).all()
    assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2, (
        rel_l2(got_dq, want_dq), rel_l2(got_dkv, want_dkv))
    assert rel_l2(hs, _reference_head_sums(q, kv, idx, 0.04, lse)) <= 1e-3


def _low_then_high_inputs(n_q, n_k, topk, seed, step=10):
    """Row t selects distinct keys of [0, step (t + 1)): the last keys rise with the row, as in a causal sequence."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, 64, DQK, generator=gen).bfloat16()
    kv = torch.randn(n_k, DQK, generator=gen).bfloat16()
    idx = torch.full((n_q, topk), -1, dtype=torch.int32)
    for t in range(n_q):
        keys = torch.randperm(min(n_k, step * (t + 1)), generator=gen)[:topk]
        idx[t, :keys.numel()] = keys.int()
    return q, kv, idx


@pytest.mark.parametrize("deterministic,with_dlse", [(False, True), (True, False)])
def test_dense_prefix_takes_the_low_rows_and_slots_the_rest(monkeypatch, deterministic, with_dlse):
    """DENSE_PREFIX: the leading rows whose last key is below PREFIX_KEY_RATIO x top-k (atomic 6 x 8 = 48,
    deterministic 10 x 8 = 80) go to the dense formulation (the stand-in scores kernel + cuBLAS products), the rest
    to the Triton "slots" backward (a float64 stand-in here), dq and the head sums in place, dkv summed: together the
    reference's gradients.  Without DENSE_PREFIX nothing is split."""
    made = _stand_in(monkeypatch)
    monkeypatch.setattr(tsm, "MIN_PREFIX_ROWS", 2)
    n_q, n_k, topk, scale = 14, 150, 8, 0.05
    q, kv, idx = _low_then_high_inputs(n_q, n_k, topk, seed=7)
    gen = torch.Generator().manual_seed(2)
    d_out = torch.randn(n_q, 64, DV, generator=gen).bfloat16()
    d_lse = torch.randn(n_q, 64, generator=gen) if with_dlse else None
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, scale, d_out, d_lse)
    _remember_bounds(idx)
    limit = (10 if deterministic else 6) * topk
    prefix = int((idx.max(1).values >= limit).int().argmax())  # the first row reaching the limit
    assert 2 <= prefix < n_q
    slots = []

    def slots_stand_in(q_, kv_, idx_, out_, lse_, d_out_, d_lse_, scale_, d_v, det, config=None, dq=None,
                       head_sums=None, dkv_dtype=None):
        assert det == deterministic
        slots.append((q_.shape[0], config, dkv_dtype))
        qr, kvr = q_.double().requires_grad_(), kv_.double().requires_grad_()
        o, l_ = reference.sparse_mla(qr, kvr, idx_.long(), scale_, d_v)
        loss = (o * d_out_.double()).sum()
        if d_lse_ is not None:
            loss = loss + (l_.masked_fill(torch.isneginf(l_), 0.0) * d_lse_.double()).sum()
        loss.backward()
        dq.copy_(qr.grad)
        head_sums.copy_(_reference_head_sums(q_, kv_, idx_, scale_, lse_))
        return dq, kvr.grad.to(dkv_dtype or kv_.dtype)

    monkeypatch.setattr(tsm, "sparse_mla_bwd", slots_stand_in)
    dq, hs = torch.full_like(q, float("nan")), torch.full(idx.shape, float("nan"))
    got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, d_lse, scale, DV,
                                                      deterministic=deterministic, dq=dq, head_sums=hs,
                                                      config=dict(DENSE_PREFIX=True))
    assert sum(n for n, _ in made[0].calls) == prefix and slots == [(n_q - prefix, dict(DK="slots"), torch.float32)]
    assert got_dq.data_ptr() == dq.data_ptr() and got_dkv.dtype == kv.dtype
    assert not got_dq.isnan().any() and not hs.isnan().any()
    assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2
    assert rel_l2(hs, _reference_head_sums(q, kv, idx, scale, lse)) <= 1e-3
    # the default, "atomic": 150 keys / top-k 8 = 18.75 keys per slot -- atomic mode's "auto" takes "slots" for the
    # whole (more than DENSE_KEY_RATIO 8), so the same split; deterministic mode (20): every row dense, no split
    made.clear()
    slots.clear()
    tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, d_lse, scale, DV, deterministic=deterministic,
                                    dq=dq, head_sums=hs)
    if deterministic:
        assert sum(n for n, _ in made[0].calls) == n_q and not slots
    else:
        assert sum(n for n, _ in made[0].calls) == prefix and slots == [(n_q - prefix, dict(DK="slots"),
                                                                            torch.float32)]
        # off: no split -- every row to the Triton backward
        made.clear()
        slots.clear()
        tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, d_lse, scale, DV, deterministic=False,
                                        dq=dq, head_sums=hs, config=dict(DENSE_PREFIX=False))
        assert not made and slots == [(n_q, None, None)]


@pytest.mark.parametrize("setting,n_keys,det,want", [
    (False, 32768, False, False), (True, 4096, True, True),  # never / always
    ("atomic", 32768, False, True), ("atomic", 24576, False, True),  # 16, 12 keys per slot: "auto" takes slots
    ("atomic", 16384, False, False),  # 8 keys per slot: "auto" takes dense for the whole
    ("atomic", 32768, True, False),  # deterministic: not by default
])
def test_dense_prefix_applies_by_setting_mode_and_length(setting, n_keys, det, want):
    from megatron_glm5.ops.sparse_bwd_budget import prefix_applies

    assert prefix_applies(setting, n_keys, 2048, det) is want


def test_dense_prefix_setting_is_checked():
    with pytest.raises(ValueError, match="DENSE_PREFIX must be False, 'atomic' or True, got 'yes'"):
        tsm.dense_prefix_split(torch.zeros(4, 64, DQK), torch.zeros(300, DQK), torch.zeros(4, 8, dtype=torch.int32),
                               False, dict(DENSE_PREFIX="yes"))


def test_dense_prefix_rows_counts_the_leading_rows_below_the_limit():
    from megatron_glm5.ops.sparse_bwd_budget import dense_prefix_rows

    bounds = torch.tensor([-1, 5, 47, 30, 48, 2, 100])  # top-k 8, atomic: limit 48 -> rows 0-3
    assert dense_prefix_rows(bounds, 8, False) == 4
    assert dense_prefix_rows(bounds, 8, True) == 6  # limit 80: stops at 100
    assert dense_prefix_rows(bounds[:4], 8, False) == 4 and dense_prefix_rows(bounds[:0], 8, False) == 0


@gpu
@needs_gpu_tilelang
def test_gpu_dense_prefix_split_matches_the_reference():
    """DENSE_PREFIX on the GPU: 600 rows whose windows grow by 6 keys a row, top-k 256 (limits 1,536 / 2,560 keys:
    about the first 255 / 426 rows dense, the rest Triton "slots"), head sums NaN-poisoned: dq, dkv and the head sums
    against the fp32 reference in both modes, the deterministic one bitwise the same twice."""
    q, kv, idx = (t.cuda() for t in _low_then_high_inputs(600, 4000, 256, seed=11, step=6))
    _remember_bounds(idx)
    gen = torch.Generator(device="cuda").manual_seed(11)
    d_out = torch.randn(600, 64, DV, device="cuda", generator=gen).bfloat16()
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.04, d_out, None)
    want_hs = _reference_head_sums(q, kv, idx, 0.04, lse)
    assert 256 <= tsm.dense_prefix_split(q, kv, idx, False, dict(DENSE_PREFIX=True)) < 600
    runs = []
    for det in (False, True, True):
        hs = torch.full(idx.shape, float("nan"), device="cuda")
        got_dq, got_dkv = tlbws.tilelang_sparse_bwd_dense(q, kv, idx, out, lse, d_out, None, 0.04, DV,
                                                          deterministic=det, head_sums=hs,
                                                          config=dict(DENSE_PREFIX=True))
        for got, want, key in ((got_dq, want_dq, "dq"), (got_dkv, want_dkv, "dkv")):
            assert not got.isnan().any() and rel_l2(got, want) <= 1e-2, (key, det, rel_l2(got, want))
        assert not hs.isnan().any() and rel_l2(hs, want_hs) <= 1e-3
        runs.append((got_dq, got_dkv, hs))
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2]))


def test_a_narrow_block_is_zeroed_in_16_byte_elements_and_nothing_else():
    """triton_sparse_mla._zero_block_: a piece's block of a [keys, rows x heads] bf16 matrix (not contiguous) is
    zeroed exactly -- through a 16-byte view where its width, start and row stride allow, element by element where
    they do not -- and nothing outside it changes."""
    for h, r0 in ((8, 1), (8, 3), (3, 1), (64, 2)):
        mat = torch.full((5, 4 * h), 7.0, dtype=torch.bfloat16)
        tsm._zero_block_(mat[1:4, r0 * h:])  # h 8, 64: 16-byte elements; h 3: 2-byte ones
        want = torch.full((5, 4 * h), 7.0, dtype=torch.bfloat16)
        want[1:4, r0 * h:] = 0
        assert torch.equal(mat, want), (h, r0)
