"""Tests of ``--attn flashmla`` and ``--attn cudnn`` (megatron_glm5/ops/flashmla_backend.py, cudnn_backend.py,
flashmla_sparse_mla.py).

CPU: the real libraries cannot run here, so fake ``flash_mla`` and ``cudnn`` modules implementing the DOCUMENTED
contracts in plain torch (their layouts, dtypes, limits and lse conventions: FlashMLA's lse is +inf for a query
without keys, indices [s_q, h_kv, topk] with topk a multiple of 128; cuDNN's indexer applies its own causal mask,
its top-k returns local columns ...) are put in sys.modules, and our backends are compared with
megatron_glm5.ops.reference.  The flashmla backward is our Triton kernel, so that part runs in a child process under
TRITON_INTERPRET=1 (this file is the child's script: ``python test_ops_external_backends.py CASES RESULTS``).
GPU (@pytest.mark.gpu): the real libraries, when importable, at GLM-5 shapes against the fp32 reference.
"""

import importlib.util
import logging
import os
import sys
import types

import pytest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from megatron_glm5.ops import base, reference, registry  # noqa: E402
from megatron_glm5.ops.cudnn_backend import CudnnBackend  # noqa: E402
from megatron_glm5.ops.flashmla_backend import FlashMLABackend  # noqa: E402
from megatron_glm5.ops.flashmla_sparse_mla import FLASHMLA_INSTALL  # noqa: E402
from megatron_glm5.ops.triton_backend import TritonBackend  # noqa: E402
from test_ops_reference import LAYOUTS, int_inputs  # noqa: E402
from interp_harness import run_interpreted  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
F64 = torch.float64
H, DQK, DV = 64, 576, 512  # FlashMLA / cuDNN only take these head counts / dims, so the CPU tests use them too


# ----------------------------------------------------------------------------------------------------------------------
# fakes: the documented contracts, naive torch
# ----------------------------------------------------------------------------------------------------------------------


def fake_flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """flash_mla.flash_mla_sparse_fwd: q [s_q, h_q, d_qk], kv [s_kv, h_kv, d_qk] bf16, indices [s_q, h_kv, topk]
    int32 (-1 / >= s_kv unused) -> out bf16 [s_q, h_q, d_v], max_logits, lse (natural log of the scaled scores,
    +inf when a query has no valid key)."""
    assert attn_sink is None and topk_length is None
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, _ = kv.shape
    assert h_kv == 1 and kv.shape[2] == d_qk and tuple(indices.shape[:2]) == (s_q, h_kv)
    assert d_qk in (512, 576) and d_v == 512 and h_q in (64, 128) and indices.shape[2] % 128 == 0
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    k = kv[:, 0].float()[torch.where(valid, idx, 0)]  # [s_q, topk, d_qk]
    s = torch.einsum("qhd,qkd->qhk", q.float(), k) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lonely = torch.isneginf(lse)
    p = torch.exp(s - torch.where(lonely, float("inf"), lse)[..., None])
    out = torch.einsum("qhk,qkd->qhd", p, k[..., :d_v]).to(torch.bfloat16)
    return out, s.max(dim=-1).values, torch.where(lonely, float("inf"), lse)


def fake_sparse_attention_backward_wrapper(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None,
                                           topk_length=None, **unused):
    """cudnn.DSA.sparse_attention_backward_wrapper without a sink (attn_sink must be -inf, as we pass it)."""
    assert topk_length is None and not unused
    assert q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == out.dtype == dout.dtype == q.dtype
    s_q, h, d = q.shape
    d_v = 512 if d == 576 else d
    assert kv.dim() == 2 and kv.shape[1] == d and d in (512, 576) and h > 1
    assert tuple(out.shape) == tuple(dout.shape) == (s_q, h, d_v)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (s_q, h)
    assert attn_sink.dtype == torch.float32 and tuple(attn_sink.shape) == (h,) and torch.isneginf(attn_sink).all()
    assert topk_idxs.dtype == torch.int32 and topk_idxs.dim() == 2 and topk_idxs.shape[0] == s_q
    assert all(t.is_contiguous() for t in (q, kv, out, dout, lse, attn_sink, topk_idxs))
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    idx = topk_idxs.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    safe = torch.where(valid, idx, 0)
    k = kv.float()[safe]
    s = torch.einsum("qhd,qkd->qhk", q.float(), k) * scale
    p = torch.where(valid[:, None, :], torch.exp(s - lse[..., None]), 0.0)  # lse +inf: p = 0
    dp = torch.einsum("qhd,qkd->qhk", dout.float(), k[..., :d_v])
    delta = (dout.float() * out.float()).sum(-1)
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("qhk,qkd->qhd", ds, k)
    dk = torch.einsum("qhk,qhd->qkd", ds, q.float())
    dk[..., :d_v] += torch.einsum("qhk,qhd->qkd", p, dout.float())
    dkv = torch.zeros(kv.shape, dtype=torch.float32).index_add_(0, safe[valid], dk[valid])
    return {"dq": dq.to(q.dtype), "dkv": dkv.to(kv.dtype), "d_sink": torch.zeros(h)}


def fake_indexer_forward_wrapper(q, k, w, ratio=4, sm_scale=1.0, q_causal_offsets=None, **unused):
    """cudnn.DSA.indexer_forward_wrapper (BSHD): sm_scale * sum_h relu(q_h . k) * w_h, column c of row r masked
    unless c < (q_causal_offsets[b] + r + 1) // ratio (offsets default 0)."""
    assert not unused
    assert q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
    b, s_q, h, d = q.shape
    assert k.dim() == 4 and k.shape[0] == b and k.shape[2] == 1 and k.shape[3] == d == 128 and h in (16, 32, 64)
    assert tuple(w.shape) == (b, s_q, h)
    s_k = k.shape[1]
    logits = torch.einsum("bqhd,bkd->bqhk", q.float(), k[:, :, 0].float()).relu()
    scores = sm_scale * (logits * w.float()[..., None]).sum(2)
    offs = torch.zeros(b, dtype=torch.long) if q_causal_offsets is None else q_causal_offsets.long()
    assert q_causal_offsets is None or (q_causal_offsets.dtype == torch.int32 and tuple(offs.shape) == (b,))
    lim = (offs[:, None] + torch.arange(s_q)[None, :] + 1) // ratio  # [b, s_q]
    masked = torch.arange(s_k)[None, None, :] >= lim[..., None]
    return {"scores": scores.masked_fill(masked, float("-inf"))}


def fake_indexer_top_k_wrapper(input_values, seq_lens, top_k, next_n=1, return_val=True, deterministic=False,
                               tie_break=0, **unused):
    """cudnn.DSA.indexer_top_k_wrapper: top_k local columns of each row among its first seq_lens[r] columns.
    deterministic: ties -> smaller column, chosen columns in ascending order; otherwise ties -> larger column and a
    scrambled order (the kernel promises neither).  Short rows padded with -1 / -inf."""
    assert not unused and next_n == 1 and tie_break == 0 and 0 < top_k <= 2048
    n_rows, n_cols = input_values.shape
    assert seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (n_rows,)
    idx = torch.full((n_rows, top_k), -1, dtype=torch.int32)
    val = torch.full((n_rows, top_k), float("-inf"), dtype=input_values.dtype)
    for r in range(n_rows):
        n = int(seq_lens[r])
        v = input_values[r, :n]
        cols = torch.arange(n) if deterministic else torch.arange(n).flip(0)
        order = torch.sort(-v[cols], stable=True).indices[:top_k]
        chosen = cols[order]
        chosen = torch.sort(chosen).values if deterministic else chosen.roll(1)
        idx[r, :chosen.numel()] = chosen.int()
        val[r, :chosen.numel()] = v[chosen]
    return {"indices": idx, "values": val if return_val else None}


def fake_flash_mla_module():
    m = types.ModuleType("flash_mla")
    m.flash_mla_sparse_fwd = fake_flash_mla_sparse_fwd
    return m


def fake_cudnn_module(with_dsa=True):
    m = types.ModuleType("cudnn")
    m.__version__ = "1.32.0+fake"
    if with_dsa:
        m.DSA = types.SimpleNamespace(sparse_attention_backward_wrapper=fake_sparse_attention_backward_wrapper,
                                      indexer_forward_wrapper=fake_indexer_forward_wrapper,
                                      indexer_top_k_wrapper=fake_indexer_top_k_wrapper)
    return m


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla_module())
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module())


# ----------------------------------------------------------------------------------------------------------------------
# inputs and the reference
# ----------------------------------------------------------------------------------------------------------------------


def mla_case(layout, topk, seed):
    from test_ops_triton import random_indices

    g = torch.Generator().manual_seed(seed)
    ks, qe, n_k = LAYOUTS[layout]()
    n_q = ks.numel()
    return dict(q=(torch.randn(n_q, H, DQK, generator=g) * 0.5).bfloat16(),
                kv=(torch.randn(n_k, DQK, generator=g) * 0.5).bfloat16(),
                indices=random_indices(ks, qe, topk, g), scale=DQK ** -0.5,
                d_out=torch.randn(n_q, H, DV, generator=g).bfloat16(), d_lse=torch.randn(n_q, H, generator=g))


def run_sparse(backend, c, with_lse_grad):
    q = c["q"].clone().requires_grad_()
    kv = c["kv"].clone().requires_grad_()
    out, lse = backend.sparse_mla(q, kv, c["indices"], c["scale"], DV)
    loss = (out.float() * c["d_out"].float()).sum()
    if with_lse_grad:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * c["d_lse"]).sum()
    loss.backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dkv=kv.grad)


def rel_l2(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_matches_reference(got, c, with_lse_grad, grad_tol):
    q = c["q"].to(F64).requires_grad_()
    kv = c["kv"].to(F64).requires_grad_()
    out, lse = reference.sparse_mla(q, kv, c["indices"], c["scale"], DV)
    loss = (out * c["d_out"].to(F64)).sum()
    if with_lse_grad:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * c["d_lse"].to(F64)).sum()
    loss.backward()
    empty = torch.isinf(lse)
    assert torch.equal(torch.isneginf(got["lse"]), empty)  # our convention: -inf (FlashMLA writes +inf)
    torch.testing.assert_close(got["lse"][~empty].to(F64), lse[~empty].detach(), rtol=1e-5, atol=1e-5)
    assert got["out"].dtype == torch.bfloat16 and rel_l2(got["out"], out) <= 5e-3
    for key, want in (("dq", q.grad), ("dkv", kv.grad)):
        assert torch.isfinite(got[key]).all(), key
        assert rel_l2(got[key], want) <= grad_tol, (key, rel_l2(got[key], want))


# ----------------------------------------------------------------------------------------------------------------------
# CPU: registry and error messages
# ----------------------------------------------------------------------------------------------------------------------


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla -> ImportError
    monkeypatch.setitem(sys.modules, "cudnn", None)
    monkeypatch.setitem(registry.BACKENDS, "flashmla", FlashMLABackend())
    monkeypatch.setitem(registry.BACKENDS, "cudnn", CudnnBackend())
    for name, needle in (("flashmla", FLASHMLA_INSTALL), ("cudnn", "pip install 'megatron-glm5[cudnn]'")):
        assert not registry.BACKENDS[name].available()
        with pytest.raises(base.BackendUnavailable) as e:
            registry.get_backend(name)
        assert needle in str(e.value) and "\n" not in str(e.value)
    assert FLASHMLA_INSTALL.startswith("build FlashMLA from source: https://github.com/deepseek-ai/FlashMLA")
    # a cudnn frontend without the DSA ops (old release, or nvidia-cutlass-dsl missing)
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module(with_dsa=False))
    with pytest.raises(base.BackendUnavailable, match=r"cudnn frontend 1\.32\.0\+fake cannot load its DSA ops"):
        CudnnBackend().check()
    assert registry.get_backend("auto").name in ("triton", "torch")  # never a backend that cannot run


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_installed_packages_need_cuda_then_are_chosen(monkeypatch, fakes):
    monkeypatch.setitem(registry.BACKENDS, "flashmla", FlashMLABackend())
    monkeypatch.setitem(registry.BACKENDS, "cudnn", CudnnBackend())
    monkeypatch.setattr(base, "cuda_available", lambda: False)
    for name in ("flashmla", "cudnn"):
        with pytest.raises(base.BackendUnavailable, match=f"--attn {name} needs a CUDA GPU"):
            registry.get_backend(name)
    monkeypatch.setattr(base, "cuda_available", lambda: True)
    assert registry.get_backend("cudnn") is registry.BACKENDS["cudnn"]
    assert registry.get_backend("flash_mla") is registry.BACKENDS["flashmla"]
    assert registry.get_backend("auto").name == "cudnn"  # AUTO_PREFERENCE order (fastest first), both available


def test_unsupported_shapes_use_the_triton_backend(monkeypatch, fakes, caplog):
    calls = []
    monkeypatch.setattr(TritonBackend, "sparse_mla", lambda self, *a, **k: calls.append("mla"))
    monkeypatch.setattr(TritonBackend, "indexer_topk", lambda self, *a, **k: calls.append("topk"))
    q, kv, idx = torch.zeros(3, 16, DQK, dtype=torch.bfloat16), torch.zeros(5, DQK, dtype=torch.bfloat16), \
        torch.zeros(3, 4, dtype=torch.int32)
    FlashMLABackend().sparse_mla(q, kv, idx, 0.1, DV)  # 16 heads: not a FlashMLA head count
    FlashMLABackend().sparse_mla(q[:, :1].float().expand(3, 64, DQK), kv.float(), idx, 0.1, DV)  # fp32
    CudnnBackend().sparse_mla(q[:, :1], kv, idx, 0.1, DV)  # one head: not MQA for the cuDNN backward
    CudnnBackend().indexer_topk(torch.zeros(3, 16, 64), torch.zeros(5, 64), torch.zeros(3, 16), 2,
                                torch.zeros(3, dtype=torch.long), torch.arange(3), 0.5)  # index head dim 64
    assert calls == ["mla", "mla", "mla", "topk"]
    assert "--attn flashmla: FlashMLA's sparse forward needs (64, 128) heads per rank, got 16" in caplog.text


# ----------------------------------------------------------------------------------------------------------------------
# CPU: cuDNN path in process (fake FlashMLA forward + fake cuDNN backward: no Triton needed)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed", "empty_rows"])
def test_cudnn_sparse_mla_against_reference(fakes, layout):
    c = mla_case(layout, topk=12, seed=3)
    backend = CudnnBackend()
    assert backend.has_flash_mla()
    got = run_sparse(backend, c, with_lse_grad=False)
    assert_matches_reference(got, c, with_lse_grad=False, grad_tol=1e-2)


@pytest.mark.parametrize("layout,topk,chunk", [("batch2", 5, 1024), ("packed", 64, 7), ("cp", 5, 3),
                                               ("empty_rows", 64, 1024)])
def test_cudnn_indexer_topk_matches_reference_exactly(fakes, layout, topk, chunk):
    g = torch.Generator().manual_seed(topk + chunk)
    ks, qe, n_k = LAYOUTS[layout]()
    n_q = ks.numel()
    qi, ki, w = int_inputs(n_q, n_k, 16, 128, g, dtype=torch.float32)  # exact scores, many ties
    got = CudnnBackend().indexer_topk(qi, ki, w, topk, ks, qe, 0.25, chunk_size=chunk)
    want = reference.indexer_topk(qi, ki, w, topk, ks, qe, 0.25)
    assert got.dtype == torch.int32 and torch.equal(got, want)  # same keys, order, tie rule and -1 padding


def test_cudnn_logs_each_new_shape_once(fakes, monkeypatch, caplog):
    """cuDNN JIT-compiles per problem shape (seconds): the first call of each shape says so, repeats do not."""
    from megatron_glm5.ops import cudnn_backend

    monkeypatch.setattr(cudnn_backend, "_SEEN_SHAPES", set())
    ks, qe, n_k = LAYOUTS["packed"]()
    qi, ki, w = torch.randn(ks.numel(), 16, 128), torch.randn(n_k, 128), torch.randn(ks.numel(), 16)
    with caplog.at_level(logging.INFO, logger="megatron_glm5.ops"):
        CudnnBackend().indexer_topk(qi, ki, w, 5, ks, qe, 0.25, chunk_size=1024)
        first = [r.getMessage() for r in caplog.records if "JIT-compiles" in r.getMessage()]
        caplog.clear()
        CudnnBackend().indexer_topk(qi, ki, w, 5, ks, qe, 0.25, chunk_size=1024)
        again = [r.getMessage() for r in caplog.records if "JIT-compiles" in r.getMessage()]
    assert first and all(m.startswith("cuDNN DSA indexer top-k: first call with shape") for m in first)
    assert len(set(first)) == len(first) and again == []


# ----------------------------------------------------------------------------------------------------------------------
# CPU: paths with our Triton backward, in a child process under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

CHILD_CASES = [("flashmla", "packed", True), ("flashmla", "empty_rows", False), ("cudnn", "packed", True)]


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    cases = {(b, layout, lse): mla_case(layout, topk=12, seed=7) for b, layout, lse in CHILD_CASES}
    return cases, run_interpreted(tmp_path_factory, "external_backends", os.path.abspath(__file__), cases)


@pytest.mark.parametrize("backend,layout,with_lse_grad", CHILD_CASES)
def test_triton_backward_paths_against_reference(child_results, backend, layout, with_lse_grad):
    cases, results = child_results
    key = (backend, layout, with_lse_grad)
    assert_matches_reference(results[key], cases[key], with_lse_grad, grad_tol=2e-2)


def child_main(cases_path, results_path):
    sys.modules["flash_mla"] = fake_flash_mla_module()
    sys.modules["cudnn"] = fake_cudnn_module()
    from megatron_glm5.ops import triton_sparse_mla

    triton_sparse_mla.BWD_CONFIG.update(BLOCK_N=16, H_SPLIT=2)  # small tiles: quicker in the interpreter
    # The interpreter computes with numpy, which has no bf16 (bf16 kernels give garbage there), so the real
    # backward kernel gets fp32 copies of exactly the tensors our wrappers hand it (q, kv, indices, out, lse, ...).
    bwd = triton_sparse_mla.sparse_mla_bwd

    def bwd_fp32(q, kv, indices, out, lse, d_out, d_lse, *args, **kwargs):
        up = [None if t is None else t.float() for t in (q, kv, out, d_out, d_lse)]
        dq, dkv = bwd(up[0], up[1], indices, up[2], lse, up[3], up[4], *args, **kwargs)
        return dq.to(q.dtype), dkv.to(kv.dtype)

    triton_sparse_mla.sparse_mla_bwd = bwd_fp32
    results = {}
    for (name, layout, with_lse_grad), c in torch.load(cases_path).items():
        backend = FlashMLABackend(deterministic=True) if name == "flashmla" else CudnnBackend(deterministic=True)
        results[name, layout, with_lse_grad] = run_sparse(backend, c, with_lse_grad)
    torch.save(results, results_path)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the real libraries at GLM-5 shapes (64 heads, 576 / 512, top-k 2048, S 4096, bf16) vs the fp32 reference
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
S_GPU, TOPK, HI, DI = 4096, 2048, 32, 128


def _real(name):
    backend = FlashMLABackend() if name == "flashmla" else CudnnBackend()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        backend.check()
    except base.BackendUnavailable as e:
        pytest.skip(str(e))
    return backend


@gpu
@pytest.mark.parametrize("name,layout", [("flashmla", "causal"), ("flashmla", "packed"), ("cudnn", "causal"),
                                         ("cudnn", "packed")])
def test_gpu_real_sparse_mla(name, layout):
    from test_ops_triton import gpu_sparse_problem

    backend = _real(name)
    pr = gpu_sparse_problem(layout, seed=11)
    q, kv = pr.q.clone().requires_grad_(), pr.kv.clone().requires_grad_()
    out, lse = backend.sparse_mla(q, kv, pr.idx, pr.scale, DV)
    (out * pr.d_out).sum().backward()
    for key, got, want in (("out", out, pr.out), ("lse", lse, pr.lse), ("dq", q.grad, pr.dq), ("dkv", kv.grad, pr.dkv)):
        assert not torch.isnan(got).any(), key
        assert rel_l2(got, want) <= 1e-2, (name, layout, key, rel_l2(got, want))


@gpu
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_real_cudnn_indexer_topk(layout):
    from test_ops_triton import gpu_layouts

    backend = _real("cudnn")
    gen = torch.Generator(device="cuda").manual_seed(12)
    ks, qe = gpu_layouts()[layout]
    qi, ki, w = int_inputs(S_GPU, S_GPU, HI, DI, gen, "cuda")
    got = backend.indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25)
    assert torch.equal(got, reference.indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25))


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
