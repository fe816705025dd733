"""Tests of ``--attn tilelang`` (megatron_glm5/ops/tilelang_sparse_mla.py and tilelang_sparse_mla_bwd.py: our
TileLang sparse MLA forward and backward).

CPU, without tilelang: the registry's messages, the fallback to the Triton backend for shapes the kernels do not
take (and, for the backward, deterministic mode), and the host-side wrappers (head / top-k padding, unpadding, out /
lse / dq buffers, d_lse) around stand-in kernels that implement the kernels' contracts in plain torch.
CPU, with tilelang installed: both kernels lower to CUDA source for sm_90a (and compile with nvcc when one is on
PATH; the backward's shared memory is checked against the H200's 227 KB) -- no GPU needed.
GPU (@pytest.mark.gpu): the real kernels at GLM-5 shapes against the fp32 reference, outputs poisoned with NaN first.
"""

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_glm5.ops import base, reference, registry
from megatron_glm5.ops import tilelang_sparse_mla as tlm
from megatron_glm5.ops import tilelang_sparse_mla_bwd as tlb
from megatron_glm5.ops import tilelang_sparse_mla_bwd_ws as tlbws
from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws
from megatron_glm5.ops import tilelang_sparse_mla_staggered as tls
from megatron_glm5.ops.tilelang_backend import TilelangBackend
from megatron_glm5.ops.tilelang_sparse_mla import TILELANG_INSTALL
from megatron_glm5.ops.triton_backend import TritonBackend
from test_ops_triton import rel_l2

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
    monkeypatch.setitem(registry.BACKENDS, "tilelang", TilelangBackend())
    assert not registry.BACKENDS["tilelang"].available()
    with pytest.raises(base.BackendUnavailable) as e:
        registry.get_backend("tilelang")
    assert str(e.value) == f"--attn tilelang needs the tilelang package: {TILELANG_INSTALL}"
    assert TILELANG_INSTALL == "pip install 'megatron-glm5[tilelang]'"
    assert registry.get_backend("auto").name != "tilelang"


def test_auto_prefers_tilelang_after_cudnn(monkeypatch):
    """--attn auto's order is the measured one (proxy step on the H200): cudnn, tilelang, flashmla, triton."""
    avail = {"cudnn": False, "tilelang": True, "flashmla": True, "triton": True}
    for name, ok in avail.items():
        monkeypatch.setattr(registry.BACKENDS[name], "available", lambda ok=ok: ok)
    assert registry.get_backend("auto").name == "tilelang"
    monkeypatch.setattr(registry.BACKENDS["tilelang"], "available", lambda: False)
    assert registry.get_backend("auto").name == "flashmla"
    monkeypatch.setattr(registry.BACKENDS["cudnn"], "available", lambda: True)
    assert registry.get_backend("auto").name == "cudnn"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_installed_tilelang_needs_cuda_then_is_chosen(monkeypatch):
    monkeypatch.setitem(sys.modules, "tilelang", type(sys)("tilelang"))  # an importable stand-in
    monkeypatch.setitem(registry.BACKENDS, "tilelang", TilelangBackend())
    monkeypatch.setattr(base, "cuda_available", lambda: False)
    with pytest.raises(base.BackendUnavailable, match="--attn tilelang needs a CUDA GPU"):
        registry.get_backend("tilelang")
    monkeypatch.setattr(base, "cuda_available", lambda: True)
    assert registry.get_backend("tilelang") is registry.BACKENDS["tilelang"]


def test_unsupported_shapes_use_the_triton_backend_with_one_warning(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(TritonBackend, "sparse_mla", lambda self, *a, **k: calls.append(a[0].dtype))
    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", lambda *a, **k: pytest.fail("the TileLang kernel was called"))
    monkeypatch.setattr(base, "_warned", set())
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


def test_l2_hint_settings_give_their_pass_configs_and_reject_unknown_hints():
    """The kv gathers' L2 hints are opt-in (no gain measured: docs/performance.md, session 17); a hinted kernel
    turns TileLang's buffer-init check off (its copies are extern calls the check cannot see), fast_math its
    fast-math pass; an unknown hint is refused before any lowering."""
    assert tlws.WS_CONFIG.get("kv_hint") is None and tlbws.PDS_WS_CONFIG.get("kv_hint") is None
    assert tlws.WS_CONFIG["split_ready"] and tlbws.PDS_WS_CONFIG["split_ready"]  # measured: session 17
    cfg = dict(tlws.WS_L2_HINTS_CONFIG)
    assert tlm.pop_pass_configs(cfg) == {"tl.enable_fast_math": True, "tl.disable_buffer_init_check": True}
    assert "fast_math" not in cfg and cfg["kv_hint"] == "evict_last"  # fast_math popped, the hint left to the builder
    assert tlm.pop_pass_configs(dict(tlws.WS_CONFIG)) == {"tl.enable_fast_math": True}
    assert tlm.pop_pass_configs({}) is None
    assert tlws.kernel_prelude(None) is None and "createpolicy" in tlws.kernel_prelude("evict_last_256b")
    with pytest.raises(ValueError, match="kv_hint must be one of"):
        tlws.kernel_prelude("evict_first")
    assert not tlws.WS_L2_HINTS_CONFIG["split_ready"] and not tlws.WS_L2_256B_CONFIG["split_ready"]
    with pytest.raises(ValueError, match="needs split_ready=False"):  # illegal instruction on the H100 together
        tlws.check_kv_hint("evict_last", split_ready=True)


def test_kernel_settings_pick_the_forward_and_backward_and_reject_bad_values(monkeypatch):
    from megatron_glm5.errors import UserError
    from megatron_glm5.ops import tilelang_backend, triton_sparse_mla

    monkeypatch.delenv("GLM5_TILELANG_FWD", raising=False)
    monkeypatch.delenv("GLM5_TILELANG_BWD", raising=False)
    assert tilelang_backend.forward_kernel() is tlws.tilelang_sparse_fwd_ws  # the default
    assert tilelang_backend.backward_kernel() is tlbws.tilelang_sparse_bwd_dense  # the default
    monkeypatch.setenv("GLM5_TILELANG_BWD", "Triton")
    assert tilelang_backend.backward_kernel() is triton_sparse_mla.sparse_mla_bwd
    monkeypatch.setenv("GLM5_TILELANG_FWD", " Plain ")
    assert tilelang_backend.forward_kernel() is tlm.tilelang_sparse_fwd
    monkeypatch.setenv("GLM5_TILELANG_FWD", "ws")
    assert tilelang_backend.forward_kernel() is tlws.tilelang_sparse_fwd_ws
    monkeypatch.setenv("GLM5_TILELANG_BWD", "tilelang")
    assert tilelang_backend.backward_kernel() is tlb.tilelang_sparse_bwd
    monkeypatch.setenv("GLM5_TILELANG_FWD", "fast")
    with pytest.raises(UserError, match=r"^GLM5_TILELANG_FWD='fast': must be one of ws, plain \(our TileLang"):
        tilelang_backend.forward_kernel()
    monkeypatch.setenv("GLM5_TILELANG_BWD", "cudnn")
    with pytest.raises(UserError, match=r"^GLM5_TILELANG_BWD='cudnn': must be one of dense, triton, tilelang \("):
        tilelang_backend.backward_kernel()
    # the backend asks at each call: the default forward reaches the wrapper with the warp-specialised config
    seen = []
    monkeypatch.delenv("GLM5_TILELANG_FWD")
    monkeypatch.delenv("GLM5_TILELANG_BWD")
    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", lambda *a, config=None, **k: seen.append(config) or
                        reference.sparse_mla(a[0].float(), a[1].float(), a[2].long(), a[3], a[4]))
    q, kv, idx = _inputs(3, 5, 64, 4, seed=0)
    out, _ = TilelangBackend().sparse_mla(q, kv, idx, 0.1, DV)
    assert len(seen) == 1 and seen[0]["builder"] is tlws.build_sparse_fwd_ws and out.shape == (3, 64, DV)


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


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_supported_shapes_take_the_tilelang_forward(monkeypatch):
    seen = []

    def fake_fwd(q, kv, indices, scale, d_v, config=None, out=None, lse=None):
        seen.append((tuple(q.shape), scale, d_v, (config or {}).get("builder")))
        o, l_ = reference.sparse_mla(q.float(), kv.float(), indices.long(), scale, d_v)
        return o.to(q.dtype), l_

    monkeypatch.delenv("GLM5_TILELANG_FWD", raising=False)
    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", fake_fwd)
    monkeypatch.setattr(TritonBackend, "sparse_mla", lambda *a, **k: pytest.fail("fell back to Triton"))
    q, kv, idx = _inputs(4, 7, 8, 5, seed=3)
    out, lse = TilelangBackend().sparse_mla(q, kv, idx, 0.2, DV)
    assert seen == [((4, 8, DQK), 0.2, DV, tlws.build_sparse_fwd_ws)]  # the default: the warp-specialised kernel
    assert out.dtype == torch.bfloat16 and lse.shape == (4, 8)


class StandInBwdKernel:
    """The backward kernel's contract in plain torch, computed from what it is given (p from the given lse, -inf =
    no keys; Delta = rowsum(out * d_out) - d_lse; unused slots add nothing); checks what the wrapper passes, writes
    dq and adds into the fp32 dkv buffer."""

    def __init__(self, heads, d_v, d_rope, topk, scale, cfg):
        assert heads % tlm.HEAD_BLOCK == 0 and topk % cfg["block_n"] == 0 and d_v % cfg["dkv_cols"] == 0
        self.heads, self.d_v, self.topk, self.scale = heads, d_v, topk, scale
        self.calls = 0

    def __call__(self, q, kv, idx, out, d_out, lse, d_lse, dq, dkv):
        n_q, n_kv = q.shape[0], kv.shape[0]
        assert q.shape[1] == out.shape[1] == d_out.shape[1] == lse.shape[1] == d_lse.shape[1] == self.heads
        assert idx.shape == (n_q, self.topk) and idx.dtype == torch.int32
        assert lse.dtype == d_lse.dtype == dkv.dtype == torch.float32 and dq.dtype == q.dtype == out.dtype
        assert all(t.is_contiguous() for t in (q, kv, idx, out, d_out, lse, d_lse, dq, dkv))
        assert dq.shape == q.shape and dkv.shape == kv.shape and not dkv.any()
        ok = (idx >= 0) & (idx < n_kv)
        rows = idx.long().clamp(0, n_kv - 1)
        k = kv.float()[rows]  # [T, K, D]
        lse_c = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
        s_ = torch.einsum("thd,tkd->thk", q.float(), k) * self.scale
        p = torch.where(ok[:, None, :], torch.exp(s_ - lse_c[..., None]), torch.zeros_like(s_))
        dp = torch.einsum("thv,tkv->thk", d_out.float(), k[..., :self.d_v])
        delta = (out.float() * d_out.float()).sum(-1) - d_lse
        ds = p * (dp - delta[..., None]) * self.scale
        dq.copy_(torch.einsum("thk,tkd->thd", ds, k))
        dk = torch.einsum("thk,thd->tkd", ds, q.float())
        dk[..., :self.d_v] += torch.einsum("thk,thv->tkv", p, d_out.float())
        dkv.index_add_(0, rows[ok], dk[ok])
        self.calls += 1


def _reference_grads(q, kv, idx, scale, d_out, d_lse):
    """(out bf16, lse, dq, dkv) of the fp32 reference for the loss sum(out * d_out) + sum(lse * d_lse) (lse of
    rows without keys excluded)."""
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    o, l_ = reference.sparse_mla(qr, kvr, idx.long(), scale, DV)
    loss = (o * d_out.float()).sum()
    if d_lse is not None:
        loss = loss + (l_.masked_fill(torch.isneginf(l_), 0.0) * d_lse).sum()
    loss.backward()
    return o.detach().to(q.dtype), l_.detach(), qr.grad, kvr.grad


@pytest.mark.parametrize("heads,topk,with_dlse,give_dq", [(16, 40, False, True), (64, 64, True, False),
                                                          (80, 130, True, True)])
def test_backward_wrapper_pads_and_matches_reference(monkeypatch, heads, topk, with_dlse, give_dq):
    made = {}

    def compiled(h_pad, d_v, d_rope, k_pad, scale, cfg):
        made[h_pad, k_pad] = made.get((h_pad, k_pad)) or StandInBwdKernel(h_pad, d_v, d_rope, k_pad, scale, cfg)
        return made[h_pad, k_pad]

    monkeypatch.setattr(tlb, "_compiled", compiled)
    q, kv, idx = _inputs(6, 9, heads, topk, seed=10 + heads, empty_rows=(4,))
    gen = torch.Generator().manual_seed(heads)
    d_out = torch.randn(6, heads, DV, generator=gen).bfloat16()
    d_lse = torch.randn(6, heads, generator=gen) if with_dlse else None
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.05, d_out, d_lse)
    dq = torch.full_like(q, float("nan")) if give_dq else None
    got_dq, got_dkv = tlb.tilelang_sparse_bwd(q, kv, idx, out, lse, d_out, d_lse, 0.05, DV, deterministic=False,
                                              dq=dq)
    assert list(made) == [(-(-heads // 64) * 64, -(-topk // 32) * 32)] and made[list(made)[0]].calls == 1
    assert got_dq.shape == q.shape and got_dq.dtype == q.dtype and got_dkv.shape == kv.shape
    assert got_dkv.dtype == kv.dtype
    if give_dq:
        assert got_dq.data_ptr() == dq.data_ptr()
    assert not got_dq.isnan().any() and (got_dq[4] == 0).all()  # the row without keys: no gradient
    errs = rel_l2(got_dq, want_dq), rel_l2(got_dkv, want_dkv)
    assert max(errs) <= 1e-2, errs


def _fake_triton_module(monkeypatch, calls, deterministic_default=False):
    """A stand-in megatron_glm5.ops.triton_sparse_mla whose sparse_mla_bwd records its call (the Triton backward
    cannot run on a CPU-only machine without the interpreter)."""
    import megatron_glm5.ops as ops_pkg

    fake = type(sys)("megatron_glm5.ops.triton_sparse_mla")
    fake.deterministic_default = lambda: deterministic_default
    fake.sparse_mla_bwd = lambda q, kv, *a, **k: calls.append((q.dtype, a[-1] if len(a) > 7 else None)) or (
        torch.zeros_like(q), torch.zeros_like(kv))
    monkeypatch.setitem(sys.modules, "megatron_glm5.ops.triton_sparse_mla", fake)
    monkeypatch.setattr(ops_pkg, "triton_sparse_mla", fake, raising=False)


def test_backward_falls_back_to_triton_for_deterministic_mode_and_unsupported_shapes(monkeypatch, caplog):
    calls = []
    _fake_triton_module(monkeypatch, calls)
    monkeypatch.setattr(tlb, "_compiled", lambda *a: pytest.fail("the TileLang backward kernel was called"))
    monkeypatch.setattr(base, "_warned", set())
    q, kv, idx = _inputs(3, 5, 16, 4, seed=1)
    d_out = torch.ones(3, 16, DV, dtype=torch.bfloat16)
    out, lse = torch.zeros(3, 16, DV, dtype=torch.bfloat16), torch.zeros(3, 16)
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        for _ in range(2):  # logged once per reason
            tlb.tilelang_sparse_bwd(q, kv, idx, out, lse, d_out, None, 0.1, DV, True)
            tlb.tilelang_sparse_bwd(q.float(), kv.float(), idx, out, lse, d_out, None, 0.1, DV, False)
        _fake_triton_module(monkeypatch, calls, deterministic_default=True)  # GLM5_TRITON_DETERMINISTIC=1
        tlb.tilelang_sparse_bwd(q, kv, idx, out, lse, d_out, None, 0.1, DV, None)
    assert calls == [(torch.bfloat16, True), (torch.float32, False)] * 2 + [(torch.bfloat16, None)]
    text = caplog.text
    assert text.count("--attn tilelang: the TileLang backward has no deterministic dkv reduction (deterministic "
                      "mode); using the Triton backend for this op") == 1
    assert text.count("--attn tilelang: the TileLang backward is bf16 only (got torch.float32 / torch.float32); "
                      "using the Triton backend for this op") == 1


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("bwd", ["triton", "tilelang"])
def test_backend_autograd_uses_the_chosen_kernels(monkeypatch, bwd):
    """GLM5_TILELANG_BWD=tilelang: our TileLang backward (a stand-in kernel here); triton (the default): the Triton
    two-step backward (a stand-in with its signature: the reference's gradients)."""
    from megatron_glm5.ops import triton_sparse_mla

    def fake_fwd(q, kv, indices, scale, d_v, config=None, out=None, lse=None):
        o, l_ = reference.sparse_mla(q.float(), kv.float(), indices.long(), scale, d_v)
        return o.to(q.dtype), l_

    monkeypatch.setenv("GLM5_TILELANG_BWD", bwd)
    triton_calls = []

    def fake_triton_bwd(q, kv, indices, out, lse, d_out, d_lse, scale, d_v, deterministic, dq=None):
        triton_calls.append(deterministic)
        with torch.enable_grad():  # a backward runs without grad mode
            _, _, g_q, g_kv = _reference_grads(q.detach(), kv.detach(), indices, scale, d_out, d_lse)
        return g_q.to(q.dtype), g_kv.to(kv.dtype)

    monkeypatch.setattr(triton_sparse_mla, "sparse_mla_bwd", fake_triton_bwd)

    made = []

    def compiled(*args):
        made.append(StandInBwdKernel(*args))
        return made[-1]

    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", fake_fwd)
    monkeypatch.setattr(tlb, "_compiled", compiled)
    q, kv, idx = _inputs(5, 8, 64, 12, seed=4, empty_rows=(1,))
    d_out = torch.randn(5, 64, DV, generator=torch.Generator().manual_seed(4)).bfloat16()
    _, _, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.07, d_out, None)
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o, _ = TilelangBackend(deterministic=False).sparse_mla(qg, kvg, idx, 0.07, DV)
    (o.float() * d_out.float()).sum().backward()
    if bwd == "tilelang":
        assert len(made) == 1 and made[0].calls == 1 and not triton_calls
    else:
        assert not made and triton_calls == [False]
    assert rel_l2(qg.grad, want_dq) <= 1e-2 and rel_l2(kvg.grad, want_dkv) <= 1e-2


def test_deferred_kl_through_the_tilelang_backend(monkeypatch):
    """GLM5_TRITON_DEFER_KL auto (one process) or 1 with the Triton backward: the Triton backend's deferred job,
    our forward, and the head sums the Triton backward writes handed to the job's KL (stand-ins for the GPU kernels:
    the forward and backward from the reference, the KL kernel recording what it gets); 0, auto under several
    processes or our TileLang backward: no job (the forward-time KL)."""
    import torch.distributed as dist

    from megatron_glm5.ops import triton_kl, triton_sparse_mla

    q, kv, idx = _inputs(5, 8, 64, 12, seed=6, empty_rows=(1,))
    gen = torch.Generator().manual_seed(6)
    q_idx, k_idx = torch.randn(5, 4, 16, generator=gen), torch.randn(8, 16, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    q_idx, k_idx, w = (t.requires_grad_() for t in (q_idx, k_idx, w))
    b = TilelangBackend(deterministic=False)
    job_args = (q_idx, k_idx, w, 0.25, q, DV, idx)
    monkeypatch.delenv("GLM5_TILELANG_BWD", raising=False)
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "0")
    assert b.deferred_indexer_kl(*job_args) is None
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "auto")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert b.deferred_indexer_kl(*job_args) is None  # several processes: forward-time
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # one process (another test may have a group)
    assert b.deferred_indexer_kl(*job_args) is not None
    for env in ("auto", "1"):
        monkeypatch.setenv("GLM5_TRITON_DEFER_KL", env)
        monkeypatch.setenv("GLM5_TILELANG_BWD", "tilelang")
        assert b.deferred_indexer_kl(*job_args) is None
        monkeypatch.delenv("GLM5_TILELANG_BWD")

    calls, got = [], {}
    written = torch.rand(idx.shape, generator=gen)  # what the stand-in backward writes as head sums

    def fake_fwd(q, kv, indices, scale, d_v, config=None, out=None, lse=None):
        calls.append(("fwd", (config or {}).get("builder")))
        o, l_ = reference.sparse_mla(q.float(), kv.float(), indices.long(), scale, d_v)
        return o.to(q.dtype), l_

    def fake_bwd(q, kv, indices, out, lse, d_out, d_lse, scale, d_v, deterministic, dq=None, head_sums=None,
                 dkv_dtype=None):
        calls.append(("bwd", deterministic))
        head_sums.copy_(written)
        with torch.enable_grad():
            _, _, g_q, g_kv = _reference_grads(q.detach(), kv.detach(), indices, scale, d_out, d_lse)
        return g_q.to(q.dtype), g_kv.to(dkv_dtype or kv.dtype)

    def fake_kl_grads(q_idx, k_idx, weights, indices, head_sums, **kw):
        got["head_sums"] = head_sums.clone()
        calls.append(("kl", kw["idx_softmax_scale"]))
        return (torch.tensor(2.0), torch.tensor(4), torch.ones_like(q_idx, dtype=torch.float32),
                torch.ones_like(k_idx, dtype=torch.float32), torch.ones_like(weights, dtype=torch.float32))

    monkeypatch.setattr(tlm, "tilelang_sparse_fwd", fake_fwd)
    monkeypatch.setattr(triton_sparse_mla, "sparse_mla_bwd", fake_bwd)
    monkeypatch.setattr(triton_kl, "indexer_kl_grads", fake_kl_grads)
    job = b.deferred_indexer_kl(*job_args, on_value=lambda v: got.setdefault("kl", v))
    assert job is not None
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o, _ = b.sparse_mla(qg, kvg, idx, 0.07, DV, kl_job=job)
    ((o.float() * 0.01).sum() + 3.0 * job.token).backward()
    assert calls == [("fwd", tlws.build_sparse_fwd_ws), ("bwd", False), ("kl", 0.25)]  # in this order
    assert torch.equal(got["head_sums"], written) and got["kl"].item() == 0.5  # kl_sum / n_tokens
    assert torch.equal(w.grad, torch.full_like(w, 3.0 / 4))  # d_w x the token's gradient / n_tokens
    assert qg.grad is not None and kvg.grad is not None


# ----------------------------------------------------------------------------------------------------------------------
# CPU with tilelang installed: lower to CUDA source (no GPU needed), nvcc when present
# ----------------------------------------------------------------------------------------------------------------------


CONFIGS = {"default": tlm.FWD_CONFIG, "pipelined": tlm.PIPELINED_CONFIG, "pipelined64": tlm.PIPELINED64_CONFIG}
# the GPU tests' forward kernels; the warp-specialised forward first ran with wrong outputs (2026-12-01, session 8:
# rel. L2 1.04), then, fixed from its lowered source (tests/test_ops_tilelang_ws.py), passed these tests on the H200
GPU_CONFIGS = dict(CONFIGS, ws=tlws.WS_CONFIG, ws_bounded=tlws.WS_BOUNDED_CONFIG,
                   ws_exact=tlws.WS_EXACT_CONFIG, ws_gather_all=tlws.WS_GATHER_ALL_CONFIG, ws_late=tlws.WS_LATE_RELEASE_CONFIG, ws32=tlws.WS32_CONFIG,
                   ws32_early=tlws.WS32_EARLY_CONFIG, ws_l2_hints=tlws.WS_L2_HINTS_CONFIG,
                   ws_l2_256b=tlws.WS_L2_256B_CONFIG, ws_whole_blocks=tlws.WS_WHOLE_BLOCKS_CONFIG,
                   ws_async=tlws.WS_ASYNC_CONFIG, ws_persistent=tlws.WS_PERSISTENT_CONFIG,
                   ws_persistent_async=tlws.WS_PERSISTENT_ASYNC_CONFIG,
                   ws_persistent_bounded=tlws.WS_PERSISTENT_BOUNDED_CONFIG, ws_staggered=tls.WS_STAGGERED_CONFIG)


needs_tilelang = pytest.mark.skipif(not HAS_TILELANG,
                                    reason="tilelang is not installed (pip install 'megatron-glm5[tilelang]')")
H200_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may opt into on the H200 (sm_90)


def nvcc_cubin(tmp_path, src):
    """Compiles lowered CUDA source to an sm_90a cubin with nvcc; ptxas's -v report, or None without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    import tilelang.env as tl_env

    (tmp_path / "k.cu").write_text(src)
    cmd = [nvcc, "-std=c++20", "-O3", "-w", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           f"-I{tl_env.TILELANG_TEMPLATE_PATH}", f"-I{tl_env.CUTLASS_INCLUDE_DIR}", "-DENABLE_BF16",
           "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.getsize(tmp_path / "k.cubin") > 0
    return res.stdout + res.stderr


@needs_tilelang
@pytest.mark.parametrize("config", list(CONFIGS))
def test_kernel_lowers_to_cuda_for_sm90a(tmp_path, config):
    src = tlm.lower_to_cuda(tlm.build_sparse_fwd(64, DV, 64, 2048, DQK ** -0.5, **CONFIGS[config]))
    assert "sparse_mla_fwd_kernel" in src and "wgmma" in src  # Hopper tensor-core MMA for both products
    assert ("cp_async" in src) == config.startswith("pipelined")  # the pipelined gather is asynchronous
    nvcc_cubin(tmp_path, src)


@needs_tilelang
def test_warp_specialised_kernel_lowers_to_cuda_for_sm90a(tmp_path):
    """Producer / consumer roles (register reallocation, mbarriers, the cp.async gather), q and two kv buffers in the
    H200's shared memory, and with nvcc: no register spills in ptxas's report."""
    art = tlm.lower_artifact(tlws.build_sparse_fwd_ws(64, DV, 64, 2048, DQK ** -0.5))
    src = art.kernel_source
    assert "wgmma" in src and "cp_async" in src and src.count("warpgroup_reg_alloc<232>") == 2
    assert "warpgroup_reg_dealloc<40>" in src  # the producer hands its registers to the two consumers
    assert "mbarrier_cp_async_arrive_noinc" in src and "tma_load" in src
    assert (64 * DQK + 2 * 64 * DQK) * 2 <= tlm.dynamic_shared_bytes(art) <= H200_SHARED_BYTES
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        assert " 0 bytes spill stores" in report, report
    # the 32-row variant: four kv buffers and two p tiles still fit the H200's shared memory, without spills
    art32 = tlm.lower_artifact(tlws.build_sparse_fwd_ws(64, DV, 64, 2048, DQK ** -0.5, block_n=32))
    assert (64 * DQK + 4 * 32 * DQK + 2 * 64 * 32) * 2 <= tlm.dynamic_shared_bytes(art32) <= H200_SHARED_BYTES
    assert art32.kernel_source.count("mbarrier_cp_async_arrive_noinc") == 4  # one per kv buffer
    report32 = nvcc_cubin(tmp_path, art32.kernel_source)
    if report32 is not None:
        assert " 0 bytes spill stores" in report32, report32
    with pytest.raises(ValueError, match="block_n must be 32 or 64"):
        tlws.build_sparse_fwd_ws(64, DV, 64, 2048, 0.1, block_n=16)
    with pytest.raises(ValueError, match="d_rope == 64"):
        tlws.build_sparse_fwd_ws(64, DV, 32, 2048, 0.1)
    # 2 x 240 + 32 = 512 > 3 x 168 registers at launch: the consumers' setmaxnreg.inc would wait forever (it hung
    # the H200 on 2026-12-01)
    with pytest.raises(ValueError, match="must be at most 504"):
        tlws.build_sparse_fwd_ws(64, DV, 64, 2048, 0.1, consumer_regs=240, producer_regs=32)


BWD_CONFIGS = {"default": tlb.BWD_CONFIG, "narrow": tlb.NARROW_BWD_CONFIG}


@needs_tilelang
@pytest.mark.parametrize("config", list(BWD_CONFIGS))
def test_backward_kernel_lowers_to_cuda_for_sm90a(tmp_path, config):
    art = tlm.lower_artifact(tlb.build_sparse_bwd(64, DV, 64, 2048, DQK ** -0.5, **BWD_CONFIGS[config]))
    src = art.kernel_source
    assert "sparse_mla_bwd_kernel" in src and "wgmma" in src
    assert "AtomicAdd" in src  # dkv: fp32 atomic adds into the [Tk, D] buffer
    smem = tlm.dynamic_shared_bytes(art)
    # q, d_out (64 heads) and the gathered kv rows stay in shared memory: at least their bytes, at most the H200's
    assert 2 * (2 * 64 * DQK + BWD_CONFIGS[config]["block_n"] * DQK) <= smem <= H200_SHARED_BYTES, smem
    report = nvcc_cubin(tmp_path, src)
    if report is not None:
        print(f"{config}: {smem} bytes of shared memory; ptxas: "
              + " | ".join(line.split(":", 1)[-1].strip() for line in report.splitlines() if "Used" in line
                           or "spill" in line))


def test_backward_builder_rejects_sizes_it_cannot_tile():
    for kw in (dict(heads=48), dict(topk=100), dict(d_v=384, dkv_cols=256)):
        args = dict(dict(heads=64, d_v=DV, d_rope=64, topk=2048, softmax_scale=0.1), **kw)
        with pytest.raises(ValueError, match="must be a multiple of 64"):
            tlb.build_sparse_bwd(**args)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real kernel at GLM-5 shapes
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu_tilelang = pytest.mark.skipif(
    not (HAS_TILELANG and HAS_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU, tilelang and triton")
S_GPU, TOPK = 4096, 2048


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_tilelang_sparse_mla_real_shapes(layout):
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem(layout, seed=21)
    q, kv, idx, d_out, scale, out, lse = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale, pr.nan_out, pr.nan_lse
    ro, rl = pr.out, pr.lse
    from megatron_glm5.ops.tilelang_backend import forward_kernel

    forward_kernel()(q, kv, idx, scale, DV, out=out, lse=lse)  # the backend's forward (GLM5_TILELANG_FWD)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_l2(out, ro) <= 1e-2 and rel_l2(lse, rl) <= 1e-2, (rel_l2(out, ro), rel_l2(lse, rl))
    for name in GPU_CONFIGS:
        if name == "default":
            continue
        o_p = torch.full_like(out, float("nan"))
        l_p = torch.full_like(lse, float("nan"))
        tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV, config=GPU_CONFIGS[name], out=o_p, lse=l_p)
        assert not o_p.isnan().any() and not l_p.isnan().any()
        assert rel_l2(o_p, ro) <= 1e-2 and rel_l2(l_p, rl) <= 1e-2, (name, rel_l2(o_p, ro), rel_l2(l_p, rl))
    # through the backend: TileLang forward and backward
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o2, l2 = TilelangBackend(deterministic=False).sparse_mla(qg, kvg, idx, scale, DV)
    (o2 * d_out).sum().backward()
    assert torch.equal(o2, out) and torch.equal(l2, lse)  # same kernel, same inputs
    for key, got, want in (("dq", qg.grad, pr.dq), ("dkv", kvg.grad, pr.dkv)):
        assert not got.isnan().any(), key
        assert rel_l2(got, want) <= 1e-2, (key, rel_l2(got, want))


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_tilelang_bounded_forward_equals_every_step(layout):
    """The warp-specialised forward stopping after each query's last used slot (WS_BOUNDED_CONFIG) gives the reference's
    out / lse and exactly the kernel computing every step: a step of unused slots leaves the running max, sum and
    output unchanged (p = 0, rescale factor 1)."""
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem(layout, seed=24)
    got = {}
    for name in ("ws_bounded", "ws"):
        out, lse = torch.full_like(pr.nan_out, float("nan")), torch.full_like(pr.nan_lse, float("nan"))
        tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV, config=GPU_CONFIGS[name], out=out, lse=lse)
        assert not out.isnan().any() and not lse.isnan().any()
        assert rel_l2(out, pr.out) <= 1e-2 and rel_l2(lse, pr.lse) <= 1e-2, (name, rel_l2(out, pr.out))
        got[name] = out, lse
    assert torch.equal(got["ws"][0], got["ws_bounded"][0]) and torch.equal(got["ws"][1], got["ws_bounded"][1])


@gpu
@needs_gpu_tilelang
def test_gpu_gather_variants_are_bitwise_the_default_forward():
    """The kv block gathered whole (split_ready False) or in two halves (the default), the L2 hints, the products as
    asynchronous wgmma (waited for only where needed) and persistent thread blocks (also async, bounded) change when
    data arrives, how long it stays in L2, when the consumers wait and which block takes a token, not one product:
    out and lse equal the default's bit for bit at GLM-5 shapes."""
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem("causal", seed=31)
    want = tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV, config=tlws.WS_CONFIG)
    for name in ("ws_whole_blocks", "ws_l2_hints", "ws_l2_256b", "ws_async", "ws_persistent", "ws_persistent_async",
                 "ws_persistent_bounded"):
        got = tlm.tilelang_sparse_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV, config=GPU_CONFIGS[name])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("topk", [100, 300])
def test_gpu_persistent_forward_any_grid_is_bitwise_the_default(topk):
    """The persistent forward (thread blocks taking token after token, every barrier's parity counted on across
    tokens) equals the default bit for bit for a grid smaller than the tokens (each block 42 or 43 tokens), one
    larger (an idle block), with asynchronous wgmma too, bounded (steps summed per block; a row without keys has no
    step and frees its q at once), and top-k lists of one and three 128-slot steps per token (odd step counts: the
    parities do not repeat from token to token; two steps and the SM-count grid: the padded heads test), with rows
    that select no key and padded heads."""
    q, kv, idx = _inputs(300, 500, 16, topk, seed=41, empty_rows=(0, 7, 299))
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    want = tlm.tilelang_sparse_fwd(q, kv, idx, 0.04, DV, config=tlws.WS_CONFIG)
    for grid, extra in ((7, {}), (301, {}), (7, dict(async_wgmma=True)), (7, dict(bounded=True))):
        cfg = dict(tlws.WS_CONFIG, persistent=grid, **extra)
        out = torch.full((300, 16, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((300, 16), float("nan"), device="cuda")
        tlm.tilelang_sparse_fwd(q, kv, idx, 0.04, DV, config=cfg, out=out, lse=lse)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), (grid, extra)


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_gpu_tilelang_padded_heads_and_rows_without_keys(config):
    q, kv, idx = _inputs(300, 500, 16, 200, seed=5, empty_rows=(0, 7, 299))
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    out = torch.full((300, 16, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((300, 16), float("nan"), device="cuda")
    tlm.tilelang_sparse_fwd(q, kv, idx, 0.04, DV, config=GPU_CONFIGS[config], out=out, lse=lse)
    ro, rl = reference.sparse_mla(q.float(), kv.float(), idx.long(), 0.04, DV)
    empty = torch.zeros(300, dtype=torch.bool, device="cuda")
    empty[[0, 7, 299]] = True
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    assert not out.isnan().any() and not lse[~empty].isinf().any()
    assert rel_l2(out, ro) <= 1e-2 and rel_l2(lse[~empty], rl[~empty]) <= 1e-2


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("layout,config", [("causal", "default"), ("packed", "default"), ("causal", "narrow")])
def test_gpu_tilelang_backward_real_shapes(layout, config):
    from test_ops_triton import gpu_sparse_problem

    pr = gpu_sparse_problem(layout, seed=22)
    q, kv, idx, d_out, scale = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale
    out, lse = tlm.tilelang_sparse_fwd(q, kv, idx, scale, DV)
    dq = torch.full_like(q, float("nan"))
    got_dq, got_dkv = tlb.tilelang_sparse_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=False,
                                              config=BWD_CONFIGS[config], dq=dq)
    assert got_dq.data_ptr() == dq.data_ptr() and got_dkv.dtype == kv.dtype
    for key, got, want in (("dq", got_dq, pr.dq), ("dkv", got_dkv, pr.dkv)):
        assert not got.isnan().any(), key
        assert rel_l2(got, want) <= 1e-2, (key, config, rel_l2(got, want))


@gpu
@needs_gpu_tilelang
@pytest.mark.parametrize("config", list(BWD_CONFIGS))
def test_gpu_tilelang_backward_padded_heads_rows_without_keys_and_lse_gradient(config):
    empty = (0, 7, 299)
    q, kv, idx = (t.cuda() for t in _inputs(300, 500, 16, 200, seed=6, empty_rows=empty))
    gen = torch.Generator(device="cuda").manual_seed(6)
    d_out = torch.randn(300, 16, DV, device="cuda", generator=gen).bfloat16()
    d_lse = torch.randn(300, 16, device="cuda", generator=gen)
    out, lse, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.04, d_out, d_lse)
    for dl, label in ((d_lse, "with d_lse"), (None, "without d_lse")):
        if dl is None:
            _, _, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.04, d_out, None)
        dq = torch.full_like(q, float("nan"))
        got_dq, got_dkv = tlb.tilelang_sparse_bwd(q, kv, idx, out, lse, d_out, dl, 0.04, DV, deterministic=False,
                                                  config=BWD_CONFIGS[config], dq=dq)
        assert not got_dq.isnan().any() and not got_dkv.isnan().any(), label
        assert (got_dq[list(empty)] == 0).all(), label  # rows without keys: no gradient
        assert rel_l2(got_dq, want_dq) <= 1e-2 and rel_l2(got_dkv, want_dkv) <= 1e-2, (
            label, rel_l2(got_dq, want_dq), rel_l2(got_dkv, want_dkv))
