"""Tests of ``--attn tilelang``'s indexer top-k (megatron_glm5/ops/tilelang_indexer.py: our TileLang scoring kernel
with the shared chunked top-k of triton_indexer).

CPU, without tilelang: the host side (chunk slicing, relative windows, the shared driver, the tie rule of the key
encoding) around a stand-in kernel that writes the kernel's contract with torch; the backend's choice and fallback.
CPU, with tilelang installed: both configurations lower to CUDA for sm_90a and nvcc compiles them (ptxas: no spills).
GPU (@pytest.mark.gpu): the real kernel at GLM-5 shapes -- identical top-k lists at exact inputs, scores decoded
from its keys against the fp32 reference.
"""

import importlib.util
import logging
import re

import pytest
import torch

from megatron_glm5.ops import base, reference
from megatron_glm5.ops import tilelang_indexer as tli
from megatron_glm5.ops.tilelang_backend import TilelangBackend
from test_ops_reference import LAYOUTS, batch_layout, int_inputs, packed_layout

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the "
                                                           "shared top-k driver is triton_indexer's")


def decode_scores(keys):
    """fp32 scores and relative positions from int64 sortable keys (the inverse of the documented encoding)."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.view(torch.float32), 4294967295 - (keys & 4294967295)


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the host side around a stand-in kernel
# ----------------------------------------------------------------------------------------------------------------------


class StandInKernel:
    """The kernel's contract in torch: Out[r, j] = sortable key of the score of query r against K row j, -inf
    outside KS[r] <= j <= QE[r] (relative to K's first row), -0.0 as +0.0."""

    def __init__(self, heads, dim, scale):
        self.heads, self.scale, self.calls = heads, scale, []

    def __call__(self, q2, k, w, ks, qe, out):
        rows, width = out.shape
        assert q2.shape == (rows * self.heads, k.shape[1]) and k.shape[0] == width and w.shape == (rows, self.heads)
        assert ks.dtype == qe.dtype == torch.int32 and w.dtype == torch.float32 and out.dtype == torch.int64
        self.calls.append((rows, width))
        a = torch.einsum("rhd,jd->rhj", q2.float().view(rows, self.heads, -1), k.float()) * self.scale
        z = (w[:, :, None] * torch.relu(a)).sum(1)
        j = torch.arange(width)
        inside = (j[None, :] >= ks[:, None].long()) & (j[None, :] <= qe[:, None].long())
        z = torch.where(inside, z, float("-inf"))
        bits = z.view(torch.int32)
        flipped = bits ^ 0x7FFFFFFF
        ordered = torch.where(bits >= 0, bits, torch.where(flipped == -1, 0, flipped)).long()
        out.copy_(ordered * 4294967296 + (4294967295 - j[None, :]))


def _stand_in(monkeypatch):
    made = {}

    def compiled(heads, dim, scale, cfg):  # cached per shape, like the real one
        return made.setdefault((heads, dim, scale), StandInKernel(heads, dim, scale))

    monkeypatch.setattr(tli, "_compiled", compiled)
    return made


def _tie_counts(s, want, ks, qe):
    """(rows with equal scores inside their list, rows whose k-th score also occurs outside it)."""
    inner = boundary = 0
    for t in range(ks.numel()):
        sel = want[t][want[t] >= 0].long()
        if sel.numel():
            vals, win = s[t, sel], s[t, int(ks[t]):int(qe[t]) + 1]
            inner += int(len(set(vals.tolist())) < sel.numel())
            boundary += int((win == vals.min()).sum() > (vals == vals.min()).sum())
    return inner, boundary


# (layout, top-k, rows per chunk): small top-k -> ties at the top-k boundary; 64 -> whole windows
@needs_triton
@pytest.mark.parametrize("name,topk,rows_cap", [("packed", 64, 7), ("packed", 8, 7), ("batch2", 5, 4096),
                                                ("empty_rows", 4, 3), ("cp", 5, 5)])
def test_wrapper_and_driver_match_reference_exactly_with_ties(monkeypatch, name, topk, rows_cap):
    from megatron_glm5.ops import triton_indexer

    made = _stand_in(monkeypatch)
    monkeypatch.setattr(triton_indexer, "MAX_ROWS", rows_cap)  # several chunks with different key ranges
    ks, qe, n_k = LAYOUTS[name]()
    q, k, w = int_inputs(ks.numel(), n_k, 8, 32, torch.Generator().manual_seed(topk + rows_cap))
    want = reference.indexer_topk(q, k, w, topk, ks, qe, 0.25)
    inner, boundary = _tie_counts(reference.indexer_scores_naive(q, k, w, 0.25), want, ks, qe)
    assert inner >= 5 and (boundary >= 3 or topk == 64)  # the test is about ties
    got = tli.tilelang_indexer_topk(q, k, w, topk, ks, qe, 0.25)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    (kernel,) = made.values()
    assert sum(r for r, _ in kernel.calls) <= ks.numel() and max(r for r, _ in kernel.calls) <= rows_cap
    assert len(kernel.calls) > 1 or rows_cap >= ks.numel()  # several chunks, each with its own key range


@needs_triton
def test_backend_uses_the_tilelang_indexer_and_falls_back_with_one_warning(monkeypatch, caplog):
    from megatron_glm5.ops import triton_indexer

    seen = []
    monkeypatch.setattr(tli, "tilelang_indexer_topk", lambda q, *a, **k: seen.append(tuple(q.shape)) or "tl")
    monkeypatch.setattr(triton_indexer, "indexer_topk", lambda q, *a, **k: seen.append(("triton", q.dtype)) or "tr")
    monkeypatch.setattr(base, "_warned", set())
    ks, qe, n_k = batch_layout([6])
    q, k, w = int_inputs(6, n_k, 32, 128, torch.Generator().manual_seed(0))
    b = TilelangBackend()
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        assert b.indexer_topk(q, k, w, 4, ks, qe, 0.1) == "tl"
        assert b.indexer_topk(q.float(), k.float(), w, 4, ks, qe, 0.1) == "tr"  # fp32: not the kernel's
        assert b.indexer_topk(q.float(), k.float(), w, 4, ks, qe, 0.1) == "tr"
        assert b.indexer_topk(q[:, :12], k, w[:, :12], 4, ks, qe, 0.1) == "tr"  # 12 heads
    assert seen == [(6, 32, 128), ("triton", torch.float32), ("triton", torch.float32), ("triton", torch.bfloat16)]
    assert caplog.text.count("--attn tilelang: the TileLang indexer is bf16 only (got torch.float32 / "
                             "torch.float32); using the Triton backend for this op") == 1
    assert "the TileLang indexer needs a power-of-two head count in [8, 128], got 12" in caplog.text


@needs_triton
def test_unsupported_inputs_are_refused_by_name():
    q = torch.zeros(2, 32, 96).bfloat16()
    with pytest.raises(ValueError, match="power-of-two index head dim in \\[32, 256\\], got 96"):
        tli.tilelang_indexer_topk(q, torch.zeros(3, 96).bfloat16(), torch.zeros(2, 32), 2, torch.zeros(2),
                                  torch.ones(2), 0.1)
    with pytest.raises(ValueError, match="expected q_idx \\[T, Hi, Di\\]"):
        tli.tilelang_indexer_topk(q[0], torch.zeros(3, 96).bfloat16(), torch.zeros(2, 32), 2, torch.zeros(2),
                                  torch.ones(2), 0.1)


# ----------------------------------------------------------------------------------------------------------------------
# CPU with tilelang installed: lower to CUDA (no GPU needed), nvcc when present
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TILELANG, reason="tilelang is not installed (pip install 'megatron-glm5[tilelang]')")
@pytest.mark.parametrize("config", ["default", "pipelined"])
def test_kernel_lowers_and_compiles_for_sm90a(tmp_path, config):
    from megatron_glm5.ops import tilelang_sparse_mla as tlm

    cfg = tli.INDEXER_CONFIG if config == "default" else tli.PIPELINED_INDEXER_CONFIG
    src = tlm.lower_to_cuda(tli.build_score_keys(32, 128, 128 ** -0.5, **cfg))
    assert "indexer_score_keys_kernel" in src and "wgmma" in src  # Hopper tensor-core MMA for q.k
    assert ("tma_load" in src) == (config == "pipelined")  # the pipelined key loads are TMA copies
    from test_ops_tilelang import nvcc_cubin

    report = nvcc_cubin(tmp_path, src)
    if report is None:  # no nvcc here
        return
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real kernel at GLM-5 shapes
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu_tilelang = pytest.mark.skipif(
    not (HAS_TILELANG and HAS_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU, tilelang and triton")
S_GPU, HI, DI, TOPK = 4096, 32, 128, 2048
CONFIGS = {"default": None, "pipelined": {"num_stages": 2}}


def _gpu_layout(layout):
    ks, qe, _ = batch_layout([S_GPU]) if layout == "causal" else packed_layout(S_GPU, [0, 1000, 1001, 3000])
    return ks.cuda(), qe.cuda()


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_topk_identical_to_reference_at_exact_inputs(layout, config):
    gen = torch.Generator(device="cuda").manual_seed(3)
    ks, qe = _gpu_layout(layout)
    qi, ki, w = int_inputs(S_GPU, S_GPU, HI, DI, gen, device="cuda")
    got = tli.tilelang_indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25, config=CONFIGS[config])
    assert torch.equal(got, reference.indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25))  # lists, order, -1 padding
    if config == "default":  # through the backend: the same kernel
        assert torch.equal(TilelangBackend().indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25), got)


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_other_shape_tails_and_empty_rows(monkeypatch, config):
    # 16 heads x 64 (8 queries per block), rows / widths not multiples of the tiles, several chunks, empty rows
    from megatron_glm5.ops import triton_indexer

    monkeypatch.setattr(triton_indexer, "MAX_ROWS", 333)
    gen = torch.Generator(device="cuda").manual_seed(4)
    ks, qe, _ = packed_layout(1001, [0, 1, 130, 131, 700])
    ks[[5, 600]] = 1000
    qe[[5, 600]] = 0  # empty windows
    ks, qe = ks.cuda(), qe.cuda()
    qi, ki, w = int_inputs(1001, 1001, 16, 64, gen, device="cuda")
    got = tli.tilelang_indexer_topk(qi, ki, w, 300, ks, qe, 0.5, config=CONFIGS[config])
    want = reference.indexer_topk(qi, ki, w, 300, ks, qe, 0.5)
    assert torch.equal(got, want) and (got[[5, 600]] == -1).all()


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_scores_and_positions_from_the_keys(config):
    from test_ops_triton import rel_l2

    gen = torch.Generator(device="cuda").manual_seed(5)
    n_q, n_k = 777, 1500
    ks = torch.randint(0, 600, (n_q,), device="cuda", generator=gen)
    qe = (ks + torch.randint(-5, 900, (n_q,), device="cuda", generator=gen)).clamp(max=n_k - 1)
    qi = torch.randn(n_q, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(n_k, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(n_q, HI, device="cuda", generator=gen) * HI ** -0.5
    # every 7th query: all heads -1 and all weights negative, so every key with a positive sum scores exactly -0.0
    qi[::7] = -1
    w[::7] = -w[::7].abs() - 0.01
    scale = DI ** -0.5
    keys = torch.full((n_q, n_k), 12345, dtype=torch.int64, device="cuda")  # poison: every entry must be written
    cfg = dict(tli.INDEXER_CONFIG, **(CONFIGS[config] or {}))
    tli._compiled(HI, DI, scale, cfg)(qi.view(n_q * HI, DI), ki, w, ks.int(), qe.int(), keys)
    score, pos = decode_scores(keys)
    assert torch.equal(pos, torch.arange(n_k, device="cuda").expand(n_q, n_k))
    want = reference.indexer_scores_naive(qi.float(), ki.float(), w, scale)
    j = torch.arange(n_k, device="cuda")
    inside = (j[None, :] >= ks[:, None]) & (j[None, :] <= qe[:, None])
    assert torch.isneginf(score[~inside]).all()
    assert rel_l2(score[inside], want[inside]) <= 1e-5, rel_l2(score[inside], want[inside])
    zeros = inside & (want == 0)
    assert int(zeros.sum()) > 1000 and (score[zeros] == 0).all()
    assert not torch.signbit(score[zeros]).any()  # -0.0 written as +0.0 (ties with +0.0)


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_random_data_same_sets_up_to_rounding(layout):
    gen = torch.Generator(device="cuda").manual_seed(6)
    ks, qe = _gpu_layout(layout)
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    scale = DI ** -0.5
    got = tli.tilelang_indexer_topk(qi, ki, w, TOPK, ks, qe, scale)
    want = reference.indexer_topk(qi, ki, w, TOPK, ks, qe, scale)
    from test_ops_triton import assert_same_sets_up_to_rounding

    assert_same_sets_up_to_rounding(got, want, qi, ki, w, scale)
