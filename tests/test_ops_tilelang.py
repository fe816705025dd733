"""Tests of ``--attn tilelang`` (megatron_glm5/ops/tilelang_sparse_mla.py: our TileLang sparse MLA forward with the
Triton backward).

CPU, without tilelang: the registry's messages, the fallback to the Triton backend for shapes the kernel does not
take, and the host-side wrapper (head / top-k padding, unpadding, out / lse buffers) around a stand-in kernel that
implements the kernel's contract with the torch reference.
CPU, with tilelang installed: the kernel lowers to CUDA source for sm_90a (and compiles with nvcc when one is on
PATH) -- no GPU needed.
GPU (@pytest.mark.gpu): the real kernel at GLM-5 shapes against the fp32 reference, outputs poisoned with NaN first,
and dq / dkv through the Triton backward.
"""

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_glm5.ops import backends, flashmla_backend, reference
from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops.tilelang_sparse_mla import TILELANG_INSTALL, TilelangBackend

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
H, DQK, DV = 64, 576, 512


def _inputs(n_q, n_k, heads, topk, seed, dtype=torch.bfloat16, empty_rows=()):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, DQK, generator=gen).to(dtype)
    kv = torch.randn(n_k, DQK, generator=gen).to(dtype)
    perm = torch.argsort(torch.rand(n_q, n_k, generator=gen), dim=1)[:, :topk].int()  # distinct keys per row
    idx = torch.full((n_q, topk), -1, dtype=torch.int32)
    idx[:, :perm.shape[1]] = perm  # top-k above the key count: the rest stays -1
    idx[torch.rand(n_q, topk, generator=gen) < 0.3] = -1  # holes
    for r in empty_rows:
        idx[r] = -1
    return q, kv, idx


# ----------------------------------------------------------------------------------------------------------------------
# CPU: registry, messages, fallback
# ----------------------------------------------------------------------------------------------------------------------


def test_missing_tilelang_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tilelang", None)  # import tilelang -> ImportError
    monkeypatch.setitem(backends.BACKENDS, "tilelang", TilelangBackend())
    assert not backends.BACKENDS["tilelang"].available()
    with pytest.raises(backends.BackendUnavailable) as e:
        backends.get_backend("tilelang")
    assert str(e.value) == f"--attn tilelang needs the tilelang package: {TILELANG_INSTALL}"
    assert TILELANG_INSTALL == "pip install 'megatron-glm5[tilelang]'"
    assert backends.get_backend("auto").name != "tilelang"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_installed_tilelang_needs_cuda_then_is_chosen(monkeypatch):
    monkeypatch.setitem(sys.modules, "tilelang", type(sys)("tilelang"))  # an importable stand-in
    monkeypatch.setitem(backends.BACKENDS, "tilelang", TilelangBackend())
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    with pytest.raises(backends.BackendUnavailable, match="--attn tilelang needs a CUDA GPU"):
        backends.get_backend("tilelang")
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    assert backends.get_backend("tilelang") is backends.BACKENDS["tilelang"]


def test_unsupported_shapes_use_the_triton_backend_with_one_warning(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(backends.TritonBackend, "sparse_mla", lambda self, *a, **k: calls.append(a[0].dtype))
    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", lambda *a, **k: pytest.fail("the TileLang kernel was called"))
    monkeypatch.setattr(flashmla_backend, "_warned", set())
    q, kv, idx = _inputs(3, 5, 16, 4, seed=0)
    b = TilelangBackend()
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        b.sparse_mla(q.float(), kv.float(), idx, 0.1, DV)  # fp32: the kernel is bf16 only
        b.sparse_mla(q.float(), kv.float(), idx, 0.1, DV)  # same reason: not logged again
        b.sparse_mla(q[..., :DV + 48], kv[:, :DV + 48], idx, 0.1, DV)  # d_rope 48: not a power of two
        b.sparse_mla(q, kv, None, 0.1, DV)  # dense mode: the Triton backend's (the reference)
    assert calls == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    text = caplog.text
    assert text.count("--attn tilelang: the TileLang forward is bf16 only (got torch.float32 / torch.float32); "
                      "using the Triton backend for this op") == 1
    assert "--attn tilelang: the TileLang forward needs power-of-two d_v and d_rope >= 16, got 512 / 48" in text


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the host-side wrapper around a stand-in kernel (the kernel's contract written with the torch reference)
# ----------------------------------------------------------------------------------------------------------------------


class StandInKernel:
    """Checks what the wrapper passes (padded heads / top-k, int32, contiguous) and writes out / lse in place."""

    def __init__(self, heads, d_v, d_rope, topk, scale, cfg):
        assert heads % tlm.HEAD_BLOCK == 0 and topk % cfg["block_n"] == 0
        self.heads, self.d_v, self.topk, self.scale = heads, d_v, topk, scale
        self.calls = 0

    def __call__(self, q, kv, idx, out, lse):
        assert q.shape[1] == self.heads and idx.shape[1] == self.topk and idx.dtype == torch.int32
        assert all(t.is_contiguous() for t in (q, kv, idx, out, lse))
        o, l_ = reference.sparse_mla(q.float(), kv.float(), idx.long(), self.scale, self.d_v)
        out.copy_(o)
        lse.copy_(l_)
        self.calls += 1


@pytest.mark.parametrize("heads,topk", [(16, 40), (64, 64), (80, 130)])
def test_wrapper_pads_heads_and_topk_and_matches_reference(monkeypatch, heads, topk):
    made = {}

    def compiled(h_pad, d_v, d_rope, k_pad, scale, cfg):
        made[h_pad, k_pad] = made.get((h_pad, k_pad)) or StandInKernel(h_pad, d_v, d_rope, k_pad, scale, cfg)
        return made[h_pad, k_pad]

    monkeypatch.setattr(tlm, "_compiled", compiled)
    q, kv, idx = _inputs(6, 9, heads, topk, seed=heads, empty_rows=(2,))
    out = torch.full((6, heads, DV), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((6, heads), float("nan"))
    got_o, got_l = tlm.tilelang_sparse_fwd(q, kv, idx, 0.05, DV, out=out, lse=lse)
    want_o, want_l = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.05, DV)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    assert got_o.shape == (6, heads, DV) and got_l.shape == (6, heads)
    torch.testing.assert_close(got_o.float(), want_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_l, want_l)
    assert torch.isneginf(got_l[2]).all() and (got_o[2] == 0).all()  # row without keys
    h_pad = -(-heads // 64) * 64
    assert list(made) == [(h_pad, -(-topk // 64) * 64)]
    tlm.tilelang_sparse_fwd(q, kv, idx, 0.05, DV)  # no buffers given: allocated
    assert made[h_pad, -(-topk // 64) * 64].calls == 2


def test_supported_shapes_take_the_tilelang_forward(monkeypatch):
    seen = []

    def fake_fwd(q, kv, indices, scale, d_v):
        seen.append((tuple(q.shape), scale, d_v))
        o, l_ = reference.sparse_mla(q.float(), kv.float(), indices.long(), scale, d_v)
        return o.to(q.dtype), l_

    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", fake_fwd)
    monkeypatch.setattr(backends.TritonBackend, "sparse_mla", lambda *a, **k: pytest.fail("fell back to Triton"))
    q, kv, idx = _inputs(4, 7, 8, 5, seed=3)
    out, lse = TilelangBackend().sparse_mla(q, kv, idx, 0.2, DV)
    assert seen == [((4, 8, DQK), 0.2, DV)] and out.dtype == torch.bfloat16 and lse.shape == (4, 8)


# ----------------------------------------------------------------------------------------------------------------------
# CPU with tilelang installed: lower to CUDA source (no GPU needed), nvcc when present
# ----------------------------------------------------------------------------------------------------------------------


CONFIGS = {"default": tlm.FWD_CONFIG, "pipelined": tlm.PIPELINED_CONFIG}


@pytest.mark.skipif(not HAS_TILELANG, reason="tilelang is not installed (pip install 'megatron-glm5[tilelang]')")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_kernel_lowers_to_cuda_for_sm90a(tmp_path, config):
    src = tlm.lower_to_cuda(tlm.build_sparse_fwd(64, DV, 64, 2048, DQK ** -0.5, **CONFIGS[config]))
    assert "sparse_mla_fwd_kernel" in src and "wgmma" in src  # Hopper tensor-core MMA for both products
    assert ("cp_async" in src) == (config == "pipelined")  # the pipelined gather is asynchronous
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    import tilelang.env as tl_env

    (tmp_path / "k.cu").write_text(src)
    cmd = [nvcc, "-std=c++20", "-O3", "-w", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a",
           f"-I{tl_env.TILELANG_TEMPLATE_PATH}", f"-I{tl_env.CUTLASS_INCLUDE_DIR}", "-DENABLE_BF16",
           "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.getsize(tmp_path / "k.cubin") > 0


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real kernel at GLM-5 shapes
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu_tilelang = pytest.mark.skipif(
    not (HAS_TILELANG and HAS_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU, tilelang and triton (run on the device machine)")
S_GPU, TOPK = 4096, 2048


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_tilelang_sparse_mla_real_shapes(layout):
    from test_ops_triton import gpu_sparse_problem, rel_l2

    pr = gpu_sparse_problem(layout, seed=21)
    q, kv, idx, d_out, scale, out, lse = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale, pr.nan_out, pr.nan_lse
    ro, rl = pr.out, pr.lse
    tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV, out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_l2(out, ro) <= 1e-2 and rel_l2(lse, rl) <= 1e-2, (rel_l2(out, ro), rel_l2(lse, rl))
    o_p = torch.full_like(out, float("nan"))
    l_p = torch.full_like(lse, float("nan"))
    tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV, config=tlm.PIPELINED_CONFIG, out=o_p, lse=l_p)
    assert not o_p.isnan().any() and not l_p.isnan().any()
    assert rel_l2(o_p, ro) <= 1e-2 and rel_l2(l_p, rl) <= 1e-2, ("pipelined", rel_l2(o_p, ro), rel_l2(l_p, rl))
    # through the backend: TileLang forward, Triton backward
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o2, l2 = TilelangBackend().sparse_mla(qg, kvg, idx, scale, DV)
    (o2 * d_out).sum().backward()
    assert torch.equal(o2, out) and torch.equal(l2, lse)  # same kernel, same inputs
    for key, got, want in (("dq", qg.grad, pr.dq), ("dkv", kvg.grad, pr.dkv)):
        assert not got.isnan().any(), key
        assert rel_l2(got, want) <= 1e-2, (key, rel_l2(got, want))


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_tilelang_padded_heads_and_rows_without_keys(config):
    from test_ops_triton import rel_l2

    q, kv, idx = _inputs(300, 500, 16, 200, seed=5, empty_rows=(0, 7, 299))
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    out = torch.full((300, 16, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((300, 16), float("nan"), device="cuda")
    tlm.tilelang_sparse_fwd(q, kv, idx, 0.04, DV, config=CONFIGS[config], out=out, lse=lse)
    ro, rl = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.04, DV)
    empty = torch.zeros(300, dtype=torch.bool, device="cuda")
    empty[[0, 7, 299]] = True
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    assert not out.isnan().any() and not lse[~empty].isinf().any()
    assert rel_l2(out, ro) <= 1e-2 and rel_l2(lse[~empty], rl[~empty]) <= 1e-2
