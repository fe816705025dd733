"""Tests of megatron_glm5.ops.reference (against full-matrix float64 oracles) and the backend registry (ops/registry.py)."""

import logging

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_glm5.ops import base, reference, registry
from megatron_glm5.ops.pending_backend import PendingGPUBackend
from megatron_glm5.ops.reference import (
    indexer_kl_loss,
    indexer_kl_loss_naive,
    indexer_topk,
    indexer_topk_naive,
    sparse_mla,
    sparse_mla_naive,
)

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------------------------
# layouts: (key_start, query_end, n_keys)
# ----------------------------------------------------------------------------------------------------------------------


def int_inputs(n_q, n_k, heads, dim, gen, device="cpu", dtype=torch.bfloat16):
    """Indexer inputs of small integers (q, k in ``dtype``; weights fp32 halves): every index score is exact in
    fp32 whatever the summation order, and ties (zeros from all-negative heads, equal sums) are frequent -- so a
    top-k must match the reference exactly, tie rule included."""
    q = torch.randint(-2, 3, (n_q, heads, dim), generator=gen, device=device).to(dtype)
    k = torch.randint(-2, 3, (n_k, dim), generator=gen, device=device).to(dtype)
    w = torch.randint(-2, 3, (n_q, heads), generator=gen, device=device).float() * 0.5
    return q, k, w


def batch_layout(lengths):
    """Batch of causal sequences of different lengths folded into one token axis."""
    ks, qe, off = [], [], 0
    for n in lengths:
        ks += [off] * n
        qe += [off + p for p in range(n)]
        off += n
    return torch.tensor(ks), torch.tensor(qe), off


def packed_layout(total, doc_starts):
    """One packed sequence; attention restarts at every document start."""
    ks, qe, start = [], [], 0
    starts = set(doc_starts)
    for t in range(total):
        if t in starts:
            start = t
        ks.append(start)
        qe.append(t)
    return torch.tensor(ks), torch.tensor(qe), total


def cp_layout(n_queries, n_keys, offset):
    """Queries are tokens offset..offset+T-1 of a longer (gathered) key array; later keys are in the future."""
    return torch.zeros(n_queries, dtype=torch.long), offset + torch.arange(n_queries), n_keys


def empty_rows_layout():
    ks, qe, n = batch_layout([23, 41])
    ks = ks.clone()
    for t in (3, 30, 63):
        ks[t] = qe[t] + 1  # no key at all
    return ks, qe, n


LAYOUTS = {
    "single": lambda: batch_layout([29]),
    "batch2": lambda: batch_layout([23, 41]),
    "packed": lambda: packed_layout(50, [0, 13, 14, 31]),
    "cp": lambda: cp_layout(24, 40, 16),
    "empty_rows": empty_rows_layout,
}


def make_inputs(n_q, n_k, seed, dtype=F64, heads=3, dim=12, idx_heads=4, idx_dim=8):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    return dict(
        q=r(n_q, heads, dim),
        kv=r(n_k, dim),
        q_idx=r(n_q, idx_heads, idx_dim),
        k_idx=r(n_k, idx_dim),
        weights=r(n_q, idx_heads) * idx_heads ** -0.5,
    )


def random_indices(ks, qe, topk, seed, holes=True):
    """Random distinct keys of each window, shuffled, with -1 slots scattered in."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for a, b in zip(ks.tolist(), qe.tolist()):
        window = list(range(a, b + 1))
        perm = torch.randperm(len(window), generator=g).tolist() if window else []
        take = [window[i] for i in perm[:topk]]
        if holes and take and len(take) > 1:
            take = take[:-1]
        row = take + [-1] * (topk - len(take))
        order = torch.randperm(topk, generator=g).tolist()
        rows.append([row[i] for i in order])
    return torch.tensor(rows, dtype=torch.int32)


def window_indices(ks, qe):
    """All keys of every window, padded with -1."""
    width = max(1, int((qe - ks + 1).clamp(min=0).max()))
    rows = []
    for a, b in zip(ks.tolist(), qe.tolist()):
        keys = list(range(a, b + 1))
        rows.append(keys + [-1] * (width - len(keys)))
    return torch.tensor(rows, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------------------------
# 1. indexer_topk
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("topk", [1, 4, 16, 64])
@pytest.mark.parametrize("chunk", [1024, 5])
def test_indexer_topk_matches_naive(layout, topk, chunk):
    ks, qe, n_k = LAYOUTS[layout]()
    x = make_inputs(len(ks), n_k, seed=topk)
    args = (x["q_idx"], x["k_idx"], x["weights"], topk, ks, qe, 8 ** -0.5)
    got = indexer_topk(*args, chunk_size=chunk)
    want = indexer_topk_naive(*args)
    assert got.dtype == torch.int32 and got.shape == (len(ks), topk)
    assert torch.equal(got, want)
    # slots beyond the window are -1, and exactly min(topk, window) are used
    n_valid = (qe - ks + 1).clamp(min=0)
    assert torch.equal((got >= 0).sum(-1), n_valid.clamp(max=topk))
    # bitwise reproducible, also in fp32
    assert torch.equal(got, indexer_topk(*args, chunk_size=chunk))
    x32 = {k: v.float() for k, v in x.items()}
    args32 = (x32["q_idx"], x32["k_idx"], x32["weights"], topk, ks, qe, 8 ** -0.5)
    assert torch.equal(indexer_topk(*args32, chunk_size=chunk), indexer_topk(*args32, chunk_size=chunk))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_indexer_topk_ties_pick_smaller_index(dtype):
    # small integers and power-of-two scales: every score is exact, so ties are exact whatever the summation order
    g = torch.Generator().manual_seed(0)
    ks, qe, n_k = batch_layout([40, 33])
    n_q = len(ks)
    q_idx = torch.randint(-2, 3, (n_q, 2, 4), generator=g).to(dtype)
    base = torch.randint(-2, 3, (3, 4), generator=g).to(dtype)
    k_idx = base[torch.arange(n_k) % 3]  # only three distinct keys -> massive ties
    k_idx[::7] = 0  # and exact zeros (relu ties)
    weights = torch.full((n_q, 2), 0.25, dtype=dtype)
    for topk in (1, 5, 12, 50):
        got = indexer_topk(q_idx, k_idx, weights, topk, ks, qe, 0.5, chunk_size=16)
        assert torch.equal(got, indexer_topk_naive(q_idx, k_idx, weights, topk, ks, qe, 0.5))
        scores = reference.indexer_scores_naive(q_idx, k_idx, weights, 0.5)
        for t in range(n_q):
            sel = [j for j in got[t].tolist() if j >= 0]
            s = scores[t]
            # descending score, ascending index among equal scores
            for a, b in zip(sel, sel[1:]):
                assert s[a] > s[b] or (s[a] == s[b] and a < b)
            # every unselected window key with the same score as the last selected one has a larger index
            last = sel[-1]
            for j in range(int(ks[t]), int(qe[t]) + 1):
                if j not in sel:
                    assert s[j] < s[last] or (s[j] == s[last] and j > last)


# ----------------------------------------------------------------------------------------------------------------------
# 2. sparse_mla
# ----------------------------------------------------------------------------------------------------------------------


def run_mla(fn, q, kv, indices, ks, qe, d_v, go, gl, **kw):
    q = q.detach().clone().requires_grad_(True)
    kv = kv.detach().clone().requires_grad_(True)
    out, lse = fn(q, kv, indices, 0.3, d_v, ks, qe, **kw)
    loss = (out.to(go.dtype) * go).sum() + (lse.masked_fill(torch.isinf(lse), 0.0).to(gl.dtype) * gl).sum()
    loss.backward()
    return out, lse, q.grad, kv.grad


def assert_mla_close(a, b, rtol, atol):
    out_a, lse_a, dq_a, dkv_a = a
    out_b, lse_b, dq_b, dkv_b = b
    torch.testing.assert_close(out_a.to(F64), out_b.to(F64), rtol=rtol, atol=atol)
    assert torch.equal(torch.isinf(lse_a), torch.isinf(lse_b))
    fin = torch.isfinite(lse_b)
    torch.testing.assert_close(lse_a[fin].to(F64), lse_b[fin].to(F64), rtol=rtol, atol=atol)
    torch.testing.assert_close(dq_a.to(F64), dq_b.to(F64), rtol=rtol, atol=atol)
    torch.testing.assert_close(dkv_a.to(F64), dkv_b.to(F64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["indexer", "random", "dense"])
def test_sparse_mla_matches_naive(layout, mode):
    ks, qe, n_k = LAYOUTS[layout]()
    n_q, d_v, topk = len(ks), 8, 8
    x = make_inputs(n_q, n_k, seed=1)
    if mode == "indexer":
        indices = indexer_topk(x["q_idx"], x["k_idx"], x["weights"], topk, ks, qe, 8 ** -0.5)
    elif mode == "random":
        indices = random_indices(ks, qe, topk, seed=2)
    else:
        indices = None
    g = torch.Generator().manual_seed(3)
    go = torch.randn(n_q, 3, d_v, generator=g, dtype=F64)
    gl = torch.randn(n_q, 3, generator=g, dtype=F64)
    want = run_mla(sparse_mla_naive, x["q"], x["kv"], indices, ks, qe, d_v, go, gl)
    for chunk in (None, 7):
        got = run_mla(sparse_mla, x["q"], x["kv"], indices, ks, qe, d_v, go, gl, chunk_size=chunk)
        assert got[1].dtype == F64
        assert_mla_close(got, want, rtol=1e-10, atol=1e-12)
    # fp32 inputs against the float64 result
    got32 = run_mla(sparse_mla, x["q"].float(), x["kv"].float(), indices, ks, qe, d_v, go.float(), gl.float())
    assert got32[0].dtype == torch.float32 and got32[1].dtype == torch.float32
    assert_mla_close(got32, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dense_mode_equals_all_window_indices(layout):
    ks, qe, n_k = LAYOUTS[layout]()
    x = make_inputs(len(ks), n_k, seed=4)
    g = torch.Generator().manual_seed(5)
    go = torch.randn(len(ks), 3, 10, generator=g, dtype=F64)
    gl = torch.randn(len(ks), 3, generator=g, dtype=F64)
    dense = run_mla(sparse_mla, x["q"], x["kv"], None, ks, qe, 10, go, gl, chunk_size=6)
    sparse = run_mla(sparse_mla, x["q"], x["kv"], window_indices(ks, qe), None, None, 10, go, gl)
    assert_mla_close(dense, sparse, rtol=1e-10, atol=1e-12)


def test_positions_below_topk_equal_dense_causal():
    ks, qe, n_k = batch_layout([40, 57])
    topk = 16
    x = make_inputs(len(ks), n_k, seed=6)
    idx = indexer_topk(x["q_idx"], x["k_idx"], x["weights"], topk, ks, qe, 8 ** -0.5)
    out_s, lse_s = sparse_mla(x["q"], x["kv"], idx, 0.3, 8)
    out_d, lse_d = sparse_mla(x["q"], x["kv"], None, 0.3, 8, ks, qe)
    ref_d, _ = sparse_mla_naive(x["q"], x["kv"], None, 0.3, 8, ks, qe)
    pos = qe - ks
    early = pos < topk
    assert int(early.sum()) == 2 * topk
    torch.testing.assert_close(out_s[early], out_d[early], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse_s[early], lse_d[early], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out_d, ref_d, rtol=1e-10, atol=1e-12)
    # later positions are really sparse: they differ from dense attention
    assert not torch.allclose(out_s[~early], out_d[~early])


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_rows_without_keys(mode):
    ks, qe, n_k = empty_rows_layout()
    empty = qe < ks
    x = make_inputs(len(ks), n_k, seed=7)
    indices = random_indices(ks, qe, 6, seed=8) if mode == "sparse" else None
    if mode == "sparse":
        indices[empty] = -1
    q = x["q"].clone().requires_grad_(True)
    kv = x["kv"].clone().requires_grad_(True)
    out, lse = sparse_mla(q, kv, indices, 0.3, 8, ks, qe)
    assert torch.all(out[empty] == 0)
    assert torch.all(lse[empty] == float("-inf"))
    assert torch.isfinite(lse[~empty]).all()
    (out.sum() + lse.masked_fill(torch.isinf(lse), 0).sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert torch.all(q.grad[empty] == 0)
    assert q.grad[~empty].abs().sum() > 0


def test_sparse_mla_bf16():
    ks, qe, n_k = batch_layout([30, 20])
    x = make_inputs(len(ks), n_k, seed=9)
    idx = random_indices(ks, qe, 8, seed=10)
    q = x["q"].to(torch.bfloat16).requires_grad_(True)
    kv = x["kv"].to(torch.bfloat16).requires_grad_(True)
    out, lse = sparse_mla(q, kv, idx, 0.3, 8)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, ref_lse = sparse_mla_naive(q.detach().double(), kv.detach().double(), idx, 0.3, 8)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and kv.grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------------------
# 3. indexer_kl_loss
# ----------------------------------------------------------------------------------------------------------------------


def run_kl(fn, x, ks, qe, indices, token_mask, **kw):
    t = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
    kl, n = fn(
        t["q_idx"], t["k_idx"], t["weights"], 8 ** -0.5, t["q"], t["kv"], 0.3, ks, qe,
        indices=indices, token_mask=token_mask, **kw,
    )
    (kl * 1.7).backward()
    return kl, n, t


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stage", ["dense", "sparse"])
@pytest.mark.parametrize("masked", [False, True])
def test_indexer_kl_loss_matches_naive(layout, stage, masked):
    ks, qe, n_k = LAYOUTS[layout]()
    n_q = len(ks)
    x = make_inputs(n_q, n_k, seed=11)
    indices = None
    if stage == "sparse":
        indices = indexer_topk(x["q_idx"], x["k_idx"], x["weights"], 8, ks, qe, 8 ** -0.5)
    token_mask = None
    if masked:
        token_mask = torch.rand(n_q, generator=torch.Generator().manual_seed(12)) < 0.6
    kl_ref, n_ref, t_ref = run_kl(indexer_kl_loss_naive, x, ks, qe, indices, token_mask)
    assert n_ref > 0
    for chunk in (None, 7):
        kl, n, t = run_kl(indexer_kl_loss, x, ks, qe, indices, token_mask, chunk_size=chunk)
        assert n == n_ref
        assert kl.dim() == 0 and kl.dtype == F64
        assert float(kl.detach()) > 0
        torch.testing.assert_close(kl, kl_ref, rtol=1e-10, atol=1e-12)
        for name in ("q_idx", "k_idx", "weights"):
            torch.testing.assert_close(t[name].grad, t_ref[name].grad, rtol=1e-9, atol=1e-12)
        assert t["q"].grad is None and t["kv"].grad is None  # the target is detached
    # fp32 inputs: fp32 loss close to the float64 one
    x32 = {k: v.float() for k, v in x.items()}
    kl32, _, t32 = run_kl(indexer_kl_loss, x32, ks, qe, indices, token_mask)
    assert kl32.dtype == torch.float32
    torch.testing.assert_close(kl32.double(), kl_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t32["k_idx"].grad.double(), t_ref["k_idx"].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_kl_head_sum_reduce(stage):
    ks, qe, n_k = batch_layout([20, 31])
    x = make_inputs(len(ks), n_k, seed=13)
    indices = None
    if stage == "sparse":
        indices = indexer_topk(x["q_idx"], x["k_idx"], x["weights"], 6, ks, qe, 8 ** -0.5)
    shapes = []

    def reduce(s):  # elementwise, so chunking cannot change it; applied before normalisation
        shapes.append(tuple(s.shape))
        return s ** 2 + 0.5 * s

    kl_ref, _, t_ref = run_kl(indexer_kl_loss_naive, x, ks, qe, indices, None, head_sum_reduce=reduce)
    shapes.clear()
    kl, _, t = run_kl(indexer_kl_loss, x, ks, qe, indices, None, head_sum_reduce=reduce, chunk_size=8)
    assert len(shapes) == -(-len(ks) // 8) and all(s[0] <= 8 for s in shapes)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t["q_idx"].grad, t_ref["q_idx"].grad, rtol=1e-9, atol=1e-12)
    # a scale-only reduce (e.g. an all-reduce of identical shards) changes nothing
    kl2, _, _ = run_kl(indexer_kl_loss, x, ks, qe, indices, None, head_sum_reduce=lambda s: 3.0 * s)
    kl1, _, _ = run_kl(indexer_kl_loss, x, ks, qe, indices, None)
    torch.testing.assert_close(kl2, kl1, rtol=1e-12, atol=1e-14)


def test_indexer_kl_no_grad_mode():
    ks, qe, n_k = batch_layout([12])
    x = make_inputs(len(ks), n_k, seed=14)
    with torch.no_grad():
        kl, n = indexer_kl_loss(x["q_idx"], x["k_idx"], x["weights"], 0.3, x["q"], x["kv"], 0.3, ks, qe)
    assert not kl.requires_grad and n == 12


# ----------------------------------------------------------------------------------------------------------------------
# memory: nothing of size T * Tk is ever allocated or saved for backward
# ----------------------------------------------------------------------------------------------------------------------


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


def test_memory_lean_at_4096_tokens():
    n = 4096
    ks, qe = torch.zeros(n, dtype=torch.long), torch.arange(n)
    x = make_inputs(n, n, seed=15, dtype=torch.float32, heads=2, dim=16, idx_heads=2, idx_dim=8)
    x = {k: v.requires_grad_(True) for k, v in x.items()}
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    mode = LargestTensor()
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        idx = indexer_topk(x["q_idx"], x["k_idx"], x["weights"], 64, ks, qe, 8 ** -0.5)
        out_d, lse_d = sparse_mla(x["q"], x["kv"], None, 0.25, 8, ks, qe)
        out_s, lse_s = sparse_mla(x["q"], x["kv"], idx, 0.25, 8)
        kl_d, _ = indexer_kl_loss(x["q_idx"], x["k_idx"], x["weights"], 0.3, x["q"], x["kv"], 0.25, ks, qe)
        kl_s, _ = indexer_kl_loss(
            x["q_idx"], x["k_idx"], x["weights"], 0.3, x["q"], x["kv"], 0.25, ks, qe, indices=idx
        )
        ops_forward = mode.ops
        (out_d.sum() + lse_d.sum() + out_s.sum() + lse_s.sum() + kl_d + kl_s).backward()
    assert mode.ops > ops_forward + 20  # backward ran under the mode too
    assert mode.largest < n * n, mode.largest
    assert mode.largest <= reference.CHUNK_BUDGET
    assert saved and max(saved) <= n * 64, max(saved)  # only O(T * max(topk, H * D)) is kept for backward
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x.values() if t is not x["q"])


# ----------------------------------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------------------------------


def test_get_backend_auto_and_torch(caplog, monkeypatch):
    monkeypatch.setattr(registry, "_logged", set())
    monkeypatch.setattr(base, "cuda_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="megatron_glm5.ops"):
        b = registry.get_backend("auto")
        assert b.name == "torch" and b is registry.get_backend("torch") and b.available()
        registry.get_backend("auto")
    assert sum("attention backend: torch" in r.getMessage() for r in caplog.records) == 1  # once per process
    ks, qe, n_k = batch_layout([9])
    x = make_inputs(9, n_k, seed=16)
    out, _ = b.sparse_mla(x["q"], x["kv"], None, 0.3, 8, ks, qe)
    torch.testing.assert_close(out, sparse_mla_naive(x["q"], x["kv"], None, 0.3, 8, ks, qe)[0])


def test_get_backend_unknown_name():
    with pytest.raises(ValueError) as e:
        registry.get_backend("flashattn9")
    for choice in ("auto", "torch", "triton", "tilelang", "cudnn", "flashmla"):
        assert choice in str(e.value)


@pytest.mark.parametrize(
    "name,needle",
    [
        ("tilelang", "--attn tilelang needs the tilelang package: pip install 'megatron-glm5[tilelang]'"),
        ("cudnn", "pip install 'megatron-glm5[cudnn]'"),
        ("flashmla", "build FlashMLA from source: https://github.com/deepseek-ai/FlashMLA"),
        ("triton", "--attn triton needs the triton package"),
    ],
)
def test_get_backend_missing_package(monkeypatch, name, needle):
    backend = registry.BACKENDS[name]
    monkeypatch.setattr(getattr(backend, "fallback", backend), "_has_package", False)  # triton missing too
    if name == "tilelang":  # the library itself missing (also where it is installed)
        monkeypatch.setattr(backend, "_has_tilelang", False)
    assert not registry.BACKENDS[name].available()
    with pytest.raises(base.BackendUnavailable) as e:
        registry.get_backend(name)
    assert isinstance(e.value, ImportError)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_get_backend_no_cuda_and_not_shipped(monkeypatch):
    pending = PendingGPUBackend("tilelang", "tilelang", "pip install 'megatron-glm5[tilelang]'")
    monkeypatch.setitem(registry.BACKENDS, "tilelang", pending)  # the placeholder class, on a registered name
    monkeypatch.setattr(pending, "_has_package", True)
    monkeypatch.setattr(base, "cuda_available", lambda: False)
    with pytest.raises(base.BackendUnavailable, match="needs a CUDA GPU"):
        registry.get_backend("tilelang")
    monkeypatch.setattr(base, "cuda_available", lambda: True)
    assert pending.available()
    with pytest.raises(base.BackendUnavailable, match="--attn tilelang: kernels arrive in a later release; use"):
        registry.get_backend("tilelang")
    with pytest.raises(base.BackendUnavailable):
        pending.sparse_mla(None, None, None, 1.0, 1)
    # auto never picks a backend without kernels
    assert registry.get_backend("auto").name in ("triton", "torch")  # triton has kernels when installed


def test_windows_host_copy_is_reused_only_for_the_same_unmodified_tensors():
    """reference.windows: one device->host copy per step (every layer passes the same key_start / query_end)."""
    ks, qe = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2])
    first = reference.windows(ks, qe, 3, 3)
    assert reference.windows(ks, qe, 3, 3) is first
    qe[2] = 1  # modified in place: recomputed
    second = reference.windows(ks, qe, 3, 3)
    assert second is not first and second.n_valid.tolist() == [1, 2, 1]
    assert reference.windows(ks.clone(), qe, 3, 3) is not second  # equal values, another tensor: recomputed
    with pytest.raises(ValueError, match="inside the 1 key rows"):  # the checks still run on a new key count
        reference.windows(ks, qe, 3, 1)
