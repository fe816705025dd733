"""Tests of our TileLang KL target (megatron_glm5/ops/tilelang_kl.py: the one-pass head sums with the forward's lse)
and of ``TilelangBackend.indexer_kl_loss``, which uses it.

CPU, without tilelang: the host-side wrapper (head / top-k padding, head-block sums, out buffer) around a stand-in
kernel written in plain torch from the kernel's contract, compared with head sums computed from explicit softmaxes;
the backend's routing (our head sums with attn_lse, the Triton backend with one warning otherwise).
CPU, with tilelang installed: the kernel lowers to CUDA for sm_90a and compiles with nvcc when one is on PATH (the
ptxas report and the shared memory are printed; shared memory checked against the H200's 227 KB).
GPU (@pytest.mark.gpu): the real kernel at GLM-5 shapes against the Triton head sums and an fp32 reference, outputs
poisoned with NaN first; and the whole loss through the backend against the Triton backend.
"""

import importlib.util
import logging

import pytest
import torch

from megatron_glm5.ops import base, reference
from megatron_glm5.ops import tilelang_kl as tlk
from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops.tilelang_backend import TilelangBackend
from test_ops_tilelang import DQK, DV, H200_SHARED_BYTES, _inputs, needs_tilelang, nvcc_cubin
from test_ops_triton import rel_l2

HAS_TRITON = importlib.util.find_spec("triton") is not None


def explicit_head_sums(q, kv, idx, scale, d_v):
    """[T, K] fp64: sum over heads of the softmax over each row's valid selected keys (0 elsewhere), written directly
    (no log-sum-exp input): the oracle of both the kernel contract and its wrapper."""
    q, kv, idx = q.double(), kv.double(), idx.long()
    ok = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[idx.clamp(0, kv.shape[0] - 1)]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q, rows) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows without keys: all -inf -> nan -> 0
    return p.sum(dim=1)


class StandInKernel:
    """The kernel's contract in torch: Part[t, b, j] = sum over heads h of block b of exp(scale s - lse[t, h]), 0 on
    unused slots; checks what the wrapper passes (padded heads / top-k, int32, contiguous, +inf lse on pad heads)."""

    def __init__(self, heads, d_v, d_rope, topk, scale, cfg):
        assert heads % tlm.HEAD_BLOCK == 0 and topk % cfg["block_n"] == 0
        self.heads, self.topk, self.scale = heads, topk, scale
        self.calls = 0

    def __call__(self, q, kv, idx, lse, part):
        assert q.shape[1] == self.heads and idx.shape[1] == self.topk and idx.dtype == torch.int32
        assert lse.dtype == torch.float32 and part.shape == (q.shape[0], self.heads // 64, self.topk)
        assert all(t.is_contiguous() for t in (q, kv, idx, lse, part))
        ok = (idx >= 0) & (idx < kv.shape[0])
        rows = kv[idx.long().clamp(0, kv.shape[0] - 1)].float()
        s = torch.einsum("thd,tkd->thk", q.float(), rows) * self.scale
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        p = torch.exp(s - lse[:, :, None]).masked_fill(~ok[:, None, :], 0.0)
        part.copy_(p.view(q.shape[0], self.heads // 64, 64, self.topk).sum(dim=2))
        self.calls += 1


@pytest.mark.parametrize("heads,topk", [(16, 40), (64, 128), (80, 130)])
def test_wrapper_pads_and_sums_head_blocks_and_matches_explicit_softmax(monkeypatch, heads, topk):
    made = {}

    def compiled(h_pad, d_v, d_rope, k_pad, scale, cfg):
        made[h_pad, k_pad] = made.get((h_pad, k_pad)) or StandInKernel(h_pad, d_v, d_rope, k_pad, scale, cfg)
        return made[h_pad, k_pad]

    monkeypatch.setattr(tlk, "_compiled", compiled)
    q, kv, idx = _inputs(6, 150, heads, topk, seed=heads, empty_rows=(2,))
    _, lse = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.05, DV)
    assert torch.isneginf(lse[2]).all()  # row without keys: the kernel must give 0, not nan
    out = torch.full((6, topk), float("nan"))
    got = tlk.tilelang_head_summed_probs(q, kv, idx, 0.05, DV, lse, out=out)
    want = explicit_head_sums(q, kv, idx, 0.05, DV)
    assert got.data_ptr() == out.data_ptr() and got.shape == (6, topk) and got.dtype == torch.float32
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert (got[2] == 0).all() and (got[idx < 0] == 0).all()
    valid = (idx >= 0).any(dim=1)
    sums = got.sum(dim=1)[valid].double()  # each head's softmax sums to 1: a row with keys sums to `heads`
    torch.testing.assert_close(sums, torch.full_like(sums, float(heads)), atol=0, rtol=1e-5)
    h_pad = -(-heads // 64) * 64
    assert list(made) == [(h_pad, -(-topk // 64) * 64)]
    again = tlk.tilelang_head_summed_probs(q, kv, idx, 0.05, DV, lse)  # no buffer given: allocated
    assert torch.equal(again, got) and made[h_pad, -(-topk // 64) * 64].calls == 2


def test_wrapper_rejects_inputs_it_cannot_take():
    q, kv, idx = _inputs(3, 5, 16, 4, seed=0)
    lse = torch.zeros(3, 16)
    for args, msg in (((q, kv, idx, 0.1, DV, None), "needs the sparse forward's lse"),
                      ((q.float(), kv.float(), idx, 0.1, DV, lse), "the TileLang KL target is bf16 only"),
                      ((q, kv, idx, 0.1, DV, lse[:, :8]), r"attn_lse must be \[T=3, h=16\], got \(3, 8\)"),
                      ((q, kv, idx[:2], 0.1, DV, lse), r"indices must be \[T=3, topk\]")):
        with pytest.raises(ValueError, match=msg):
            tlk.tilelang_head_summed_probs(*args)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_backend_uses_our_head_sums_with_lse_and_triton_otherwise(monkeypatch, caplog):
    from megatron_glm5.ops import triton_kl

    calls = []

    def fake_loss(q_idx, k_idx, weights, idx_scale, q, kv, scale, indices, d_v, head_probs=None, attn_lse=None,
                  **kw):
        calls.append(head_probs)
        if head_probs is triton_kl.head_summed_probs:  # the Triton backend's own head sums
            return None, kw
        return head_probs(q, kv, indices, scale, d_v, attn_lse=attn_lse), kw

    monkeypatch.setattr(triton_kl, "indexer_kl_loss_sparse", fake_loss)
    monkeypatch.setattr(tlk, "_compiled", lambda *a: StandInKernel(*a))
    monkeypatch.setattr(base, "_warned", set())
    q, kv, idx = _inputs(5, 90, 64, 64, seed=3)
    _, lse = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.07, DV)
    qi, ki, w = torch.randn(5, 4, 16), torch.randn(90, 16), torch.randn(5, 4)
    b = TilelangBackend(deterministic=True)
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        probs, kw = b.indexer_kl_loss(qi, ki, w, 0.25, q, kv, 0.07, None, None, indices=idx, attn_lse=lse)
        assert calls == [tlk.tilelang_head_summed_probs] and kw["deterministic"] is True
        torch.testing.assert_close(probs.double(), explicit_head_sums(q, kv, idx, 0.07, DV), atol=1e-4, rtol=1e-4)
        for _ in range(2):  # without the forward's lse: the Triton head sums, logged once
            b.indexer_kl_loss(qi, ki, w, 0.25, q, kv, 0.07, None, None, indices=idx)
        b.indexer_kl_loss(qi, ki, w, 0.25, q.float(), kv.float(), 0.07, None, None, indices=idx, attn_lse=lse)
    assert calls[1:] == [triton_kl.head_summed_probs] * 3  # the Triton backend's own head sums
    assert caplog.text.count("--attn tilelang: the TileLang KL target needs the sparse forward's lse (attn_lse); "
                             "using the Triton backend for this op") == 1
    assert "--attn tilelang: the TileLang KL target is bf16 only (got torch.float32 / torch.float32)" in caplog.text
    # dense warm-up (no indices): the torch reference, as the Triton backend does, no TileLang kernel
    monkeypatch.setattr(tlk, "_compiled", lambda *a: pytest.fail("the TileLang kernel was called"))
    kl, n = b.indexer_kl_loss(qi, ki, w, 0.25, q.float(), kv.float(), 0.07, torch.zeros(5, dtype=torch.long),
                              torch.arange(1, 6), attn_lse=lse)
    assert n == 5 and torch.isfinite(kl)


# ----------------------------------------------------------------------------------------------------------------------
# CPU with tilelang: lowering and nvcc
# ----------------------------------------------------------------------------------------------------------------------

CONFIGS = {"default": tlk.PROB_CONFIG, "plain": tlk.PLAIN_PROB_CONFIG}


@needs_tilelang
@pytest.mark.parametrize("config", list(CONFIGS))
def test_head_probs_kernel_lowers_and_compiles_for_sm90a(tmp_path, config):
    art = tlm.lower_artifact(tlk.build_head_probs(64, DV, 64, 2048, DQK ** -0.5, **CONFIGS[config]))
    src = art.kernel_source
    assert "head_probs_kernel" in src and "wgmma" in src  # Hopper tensor-core MMA for the scores
    assert ("cp_async" in src) == (config == "default")  # the default's two-stage gather is asynchronous
    smem = tlm.dynamic_shared_bytes(art)
    # q (64 heads) and the gathered kv rows stay in shared memory: at least their bytes, at most the H200's
    cfg = CONFIGS[config]
    tile_sum = 4 * 64 * cfg["block_n"] if cfg["smem_sum"] else 0  # the fp32 copy of the [64, block_n] tile
    least = 2 * (64 * DQK + max(1, cfg["num_stages"]) * cfg["block_n"] * DQK) + tile_sum
    assert least <= smem <= H200_SHARED_BYTES, (least, smem)
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert "0 bytes spill stores" in report, report
        print(f"{config}: {smem} bytes of shared memory; ptxas: "
              + " | ".join(line.split(":", 1)[-1].strip() for line in report.splitlines() if "Used" in line
                           or "spill" in line))


def test_builder_rejects_sizes_it_cannot_tile():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install 'megatron-glm5[tilelang]')")
    for kw in (dict(heads=48), dict(topk=100)):
        args = dict(dict(heads=64, d_v=DV, d_rope=64, topk=2048, softmax_scale=0.1), **kw)
        with pytest.raises(ValueError, match="must be a multiple of"):
            tlk.build_head_probs(**args)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real kernel at GLM-5 shapes
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu_tilelang = pytest.mark.skipif(
    not (importlib.util.find_spec("tilelang") is not None and HAS_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU, tilelang and triton")


def chunked_head_sums(q, kv, idx, scale, lse, chunk=128):
    """fp32 reference [T, K] from a given lse (the kernels' formula, torch, chunked over queries)."""
    out = torch.empty(idx.shape, dtype=torch.float32, device=q.device)
    for t0 in range(0, q.shape[0], chunk):
        sl = slice(t0, t0 + chunk)
        ok = (idx[sl] >= 0) & (idx[sl] < kv.shape[0])
        rows = kv[idx[sl].long().clamp(0, kv.shape[0] - 1)].float()
        s = torch.einsum("thd,tkd->thk", q[sl].float(), rows) * scale
        p = torch.exp(s - lse[sl, :, None]).masked_fill(~ok[:, None, :], 0.0)
        out[sl] = p.nan_to_num(0.0).sum(dim=1)
    return out


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_head_probs_real_shapes(layout):
    from test_ops_triton import gpu_sparse_problem

    from megatron_glm5.ops import triton_kl

    pr = gpu_sparse_problem(layout, seed=31)
    q, kv, idx, scale = pr.q, pr.kv, pr.idx, pr.scale
    want = chunked_head_sums(q, kv, idx, scale, pr.lse)  # fp32 reference lse and scores
    _, lse = tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV)  # what training passes: our forward's lse
    tri = triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=lse)
    for name, cfg in CONFIGS.items():
        for given, label in ((pr.lse, "reference lse"), (lse, "forward lse")):
            p = torch.full(idx.shape, float("nan"), device="cuda")
            tlk.tilelang_head_summed_probs(q, kv, idx, scale, DV, given, config=cfg, out=p)
            assert not p.isnan().any(), (name, label)
            assert (p[idx < 0] == 0).all(), (name, label)
            ref = want if given is pr.lse else tri
            assert rel_l2(p, ref) <= 1e-3, (name, label, rel_l2(p, ref))
    # each head's softmax sums to 1 over its keys: a row with keys sums to 64
    rows = (idx >= 0).any(dim=1)
    assert (p.sum(dim=1)[rows] - 64).abs().max() <= 64 * 1e-2


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("heads", [16, 80])
def test_gpu_head_probs_padded_heads_and_rows_without_keys(heads):
    empty = (0, 7, 299)
    q, kv, idx = (t.cuda() for t in _inputs(300, 500, heads, 200, seed=heads, empty_rows=empty))
    _, lse = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.04, DV)
    for cfg in CONFIGS.values():
        p = torch.full((300, 200), float("nan"), device="cuda")
        tlk.tilelang_head_summed_probs(q, kv, idx, 0.04, DV, lse, config=cfg, out=p)
        assert not p.isnan().any() and (p[list(empty)] == 0).all()
        want = explicit_head_sums(q, kv, idx, 0.04, DV)
        assert rel_l2(p, want) <= 1e-3, (heads, cfg, rel_l2(p, want))


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_backend_indexer_kl_loss_matches_triton_backend(layout):
    from test_ops_triton import DI, HI, S_GPU, TOPK, gpu_causal_indices, gpu_layouts

    from megatron_glm5.ops.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(33)
    ks, qe = gpu_layouts()[layout]
    idx = gpu_causal_indices(ks, qe, TOPK, gen)
    q = torch.randn(S_GPU, 64, DQK, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S_GPU, DQK, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    token_mask = torch.rand(S_GPU, device="cuda", generator=gen) < 0.9
    lse = tlm.tilelang_sparse_fwd(q, kv, idx, DQK ** -0.5, DV)[1]
    res = {}
    for backend in (TritonBackend(deterministic=True), TilelangBackend(deterministic=True)):
        a = [x.clone().requires_grad_() for x in (qi, ki, w)]
        kl, n = backend.indexer_kl_loss(a[0], a[1], a[2], DI ** -0.5, q, kv, DQK ** -0.5, None, None, indices=idx,
                                        token_mask=token_mask, attn_lse=lse)
        kl.backward()
        res[backend.name] = (kl.detach(), int(n), [x.grad for x in a])
    (kl_t, n_t, g_t), (kl_l, n_l, g_l) = res["triton"], res["tilelang"]
    assert n_t == n_l and abs(float(kl_l - kl_t)) <= 1e-3 * abs(float(kl_t)), (float(kl_l), float(kl_t))
    for name, got, want in zip(("d_q_idx", "d_k_idx", "d_w"), g_l, g_t):
        assert not got.isnan().any() and rel_l2(got, want) <= 1e-3, (name, rel_l2(got, want))
