"""Tests of the Triton DSA kernels (megatron_glm5/ops/triton_*.py) against the torch reference.

CPU part: the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in one subprocess
(tests/triton_interp_runner.py) at tiny sizes that keep the 576/512 structure as d_v + d_rope = 32 + 16; this
process builds the inputs and compares with megatron_glm5.ops.reference.
GPU part (@pytest.mark.gpu): real GLM-5 shapes in bf16 against the fp32 reference; run on a GPU machine (python -m pytest -m gpu).
"""

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_glm5.ops import reference
from test_ops_reference import LAYOUTS, batch_layout, int_inputs, packed_layout
from interp_harness import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
F64 = torch.float64


def random_indices(key_start, query_end, topk, gen, holes=True):
    """[T, topk] int32: a random subset of each query's window (shuffled), -1 padded; some holes in the middle."""
    rows = []
    for t in range(key_start.numel()):
        lo, hi = int(key_start[t]), int(query_end[t])
        cand = torch.arange(lo, hi + 1) if hi >= lo else torch.zeros(0, dtype=torch.long)
        cand = cand[torch.randperm(cand.numel(), generator=gen)][:topk]
        row = torch.full((topk,), -1, dtype=torch.int32)
        row[:cand.numel()] = cand.int()
        if holes and cand.numel() > 2 and t % 3 == 0:
            row[1] = -1
        rows.append(row[torch.randperm(topk, generator=gen)] if t % 2 else row)
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------------------------
# CPU: interpreter
# ----------------------------------------------------------------------------------------------------------------------

D_V, D_ROPE = 32, 16
# (layout, deterministic dkv)
MLA_MODES = [("packed", True), ("packed", False), ("cp", True), ("cp", False), ("empty_rows", True)]
# backward variants besides the default (DK "auto", padding skipped): (layout, deterministic, variant) -- the
# one-kernel backward, each dk formulation, "slots" without the padding skip, buffers of 3 query rows (chunks), and
# the dense plan's products and memsets in pieces of a few rows (DENSE_PIECE_ROWS)
MLA_VARIANTS = [("packed", False, "one_kernel"), ("cp", True, "one_kernel"), ("packed", True, "slots"),
                ("cp", False, "slots"), ("packed", False, "dense"), ("empty_rows", True, "dense"),
                ("empty_rows", False, "slots_no_skip"), ("cp", True, "slots_chunked"), ("cp", False, "dense_chunked"),
                ("cp", True, "dense_chunked"), ("packed", True, "dense_chunked_split1"),
                ("cp", False, "dense_chunked_split3"), ("empty_rows", False, "dense_host_bounds"),
                ("cp", True, "dense_chunked_host_bounds"), ("empty_rows", True, "dense_host_bounds_restore"),
                ("cp", False, "dense_chunked_host_bounds_restore"), ("packed", True, "dense_host_bounds_restore"),
                ("packed", False, "dense_host_bounds_pieces"), ("cp", True, "dense_chunked_host_bounds_pieces"),
                ("empty_rows", True, "dense_host_bounds_pieces_restore"),
                ("packed", True, "dense_host_bounds_complement"),
                ("cp", False, "dense_chunked_host_bounds_pieces_complement")]
# indexer KL: (layout, deterministic d_k_idx, the forward's lse passed, key block, form / d_k_idx path); top-k 8 / 16
# / 12 below, so block 8 gives several blocks (a partial one at 12) and block 16 one (partial at 8 and 12). Paths
# (tests/triton_interp_runner.KL_DK): "auto" without host row bounds (slot form: atomics / deterministic rows),
# "auto_bounds" with them (the slot form's dense d_k_idx in deterministic mode), "dense" (that d_k_idx asked for)
# with the indexer's host bounds (loose ones), in chunks of 3 query rows, and asked for without bounds (falls back);
# "tiles" (the tile form, opt-in) likewise
KL_MODES = [("packed", False, True, 16, "auto"), ("packed", True, False, 8, "auto"), ("cp", True, True, 8, "auto"),
            ("cp", False, False, 16, "auto"), ("empty_rows", False, True, 8, "auto"),
            ("empty_rows", True, True, 16, "auto"), ("packed", False, True, 8, "dense"),
            ("cp", True, False, 16, "dense_chunked"), ("empty_rows", False, True, 8, "dense_chunked"),
            ("cp", False, True, 8, "auto_bounds"), ("empty_rows", True, False, 8, "auto_bounds"),
            ("packed", True, True, 16, "dense_no_bounds"), ("packed", False, True, 8, "tiles"),
            ("cp", True, False, 16, "tiles_chunked"), ("empty_rows", False, True, 8, "tiles_chunked"),
            ("empty_rows", True, True, 8, "tiles_no_bounds")]
TOPK_CASES = [("batch2", 5), ("packed", 64), ("cp", 5), ("empty_rows", 64)]  # 64: more than any window
KL_AFTER_TOPK = [("packed", 6), ("empty_rows", 64), ("cp", 5)]  # (layout, top-k): short and full windows


def build_cases():
    g = torch.Generator().manual_seed(0)
    cases = {}
    for name, topk in TOPK_CASES:
        ks, qe, n_k = LAYOUTS[name]()
        q, k, w = int_inputs(ks.numel(), n_k, 4, 16, g, dtype=torch.float32)
        if True:
            cases[f"topk_{name}_{topk}"] = dict(kind="topk", q_idx=q, k_idx=k, weights=w, topk=topk, key_start=ks,
                                                query_end=qe, scale=0.25)
    for name, heads, topk in (("packed", 3, 8), ("cp", 20, 16), ("empty_rows", 2, 12)):  # 20: two head groups
        ks, qe, n_k = LAYOUTS[name]()
        n_q = ks.numel()
        idx = random_indices(ks, qe, topk, g)
        q = torch.randn(n_q, heads, D_V + D_ROPE, generator=g)
        kv = torch.randn(n_k, D_V + D_ROPE, generator=g)
        cases[f"mla_{name}"] = dict(kind="mla", modes=[m[1] for m in MLA_MODES if m[0] == name], q=q, kv=kv, indices=idx, scale=0.3, d_v=D_V,
                                    variants=[m[1:] for m in MLA_VARIANTS if m[0] == name],
                                    d_out=torch.randn(n_q, heads, D_V, generator=g),
                                    d_lse=torch.randn(n_q, heads, generator=g))
        qi, ki, w = (torch.randn(n_q, 4, 8, generator=g), torch.randn(n_k, 8, generator=g),
                     torch.rand(n_q, 4, generator=g))
        mask = torch.rand(n_q, generator=g) > 0.2
        cases[f"kl_{name}"] = dict(kind="kl", q_idx=qi, k_idx=ki, weights=w, idx_scale=0.5, q=q, kv=kv, scale=0.3,
                                   indices=idx, d_v=D_V, token_mask=mask, hook="mix" if name == "cp" else "none",
                                   modes=[m[1:] for m in KL_MODES if m[0] == name])
        if name == "packed":
            cases["backend"] = dict(kind="backend", q=q, kv=kv, indices=idx, scale=0.3, d_v=D_V, key_start=ks,
                                    query_end=qe)
        if name == "empty_rows":  # a given target (0 on unused slots: the head sums' contract)
            hs = (torch.rand(idx.shape, generator=g) + 0.1) * (idx >= 0)
            cases["kl_given_target"] = dict(kind="kl_given", q_idx=qi, k_idx=ki, weights=w, idx_scale=0.5,
                                            indices=idx, head_sums=hs)
    # ZEROS "complement" on one 6-row chunk of 2 heads in pieces of 2 rows (key ends 4, 4, 9: a bound that falls
    # is carried), rows selecting keys with -1 slots and one row without keys
    cases["complement_zero"] = dict(kind="complement_zero", n_q=6, h=2, pieces=[[(0, 2, 4), (2, 4, 4), (4, 6, 9)]],
                                    indices=torch.tensor([[0, 2, -1], [3, -1, 1], [1, -1, -1], [-1, -1, -1],
                                                          [8, 0, 5], [7, 4, 2]], dtype=torch.int32))
    cases["slot_ends"] = dict(kind="slot_ends", n_keys=SLOT_ENDS_KEYS, steps=(1, 7, 128), lists=slot_end_lists(g))
    for name, topk in KL_AFTER_TOPK:  # our indexer's top-k, then the KL (integer inputs: exact scores)
        ks, qe, n_k = LAYOUTS[name]()
        qi, ki, w = int_inputs(ks.numel(), n_k, 4, 16, g, dtype=torch.float32)
        ref_idx = reference.indexer_topk(qi, ki, w, topk, ks, qe, 0.25)  # the test checks ours equal to it
        hs = (torch.rand(ks.numel(), topk, generator=g) + 0.1) * (ref_idx >= 0)  # 0 on unused slots (contract)
        cases[f"kl_after_topk_{name}"] = dict(kind="kl_after_topk", q_idx=qi, k_idx=ki, weights=w, idx_scale=0.25,
                                              topk=topk, key_start=ks, query_end=qe, head_sums=hs)
    return cases


SLOT_ENDS_KEYS = 50


def slot_end_lists(g):
    """Top-k lists for used_slot_ends: holes (-1) and keys past the key count (unused) anywhere, a row without keys,
    a row used up to its last slot, int32 and int64, a strided view, no rows, one slot."""
    lists = []
    for dtype, (n, k) in ((torch.int32, (37, 300)), (torch.int64, (6, 2100)), (torch.int32, (0, 16)),
                          (torch.int64, (9, 1))):
        idx = torch.randint(-3, SLOT_ENDS_KEYS + 6, (n, k), generator=g).to(dtype)
        if n > 3 and k > 10:
            idx[1] = -1
            idx[2, -1] = 0
            idx[3, 10:] = torch.randint(SLOT_ENDS_KEYS, SLOT_ENDS_KEYS + 4, (k - 10,), generator=g)
        lists.append(idx)
    lists.append(lists[0][:, ::2])  # not contiguous
    return lists


def expected_slot_ends(idx, n_keys, step):
    """One past each row's last used slot (0 <= key < n_keys), in steps rounded up: a loop over the rows."""
    ends = []
    for row in idx.tolist():
        e = max([j + 1 for j, key in enumerate(row) if 0 <= key < n_keys], default=0)
        ends.append(-(-e // step))
    return ends


def test_used_slot_ends_torch_form_counts_to_each_rows_last_used_slot():
    """used_slot_ends on the CPU without the interpreter (its torch form) -- the loop's answer for every list and
    step; a bad step or a 1-D list is refused."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    for idx in slot_end_lists(torch.Generator().manual_seed(3)):
        for step in (1, 7, 128):
            got = tsm.used_slot_ends(idx, SLOT_ENDS_KEYS, step)
            assert got.dtype == torch.int32 and got.tolist() == expected_slot_ends(idx, SLOT_ENDS_KEYS, step)
    for bad in (dict(indices=torch.zeros(4, dtype=torch.int32), n_keys=3), dict(
            indices=torch.zeros(2, 4, dtype=torch.int32), n_keys=3, step=0)):
        with pytest.raises(ValueError, match="used_slot_ends"):
            tsm.used_slot_ends(**bad)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    cases = build_cases()
    return cases, run_interpreted(tmp_path_factory, "triton_interp", "triton_interp_runner.py", cases)


@needs_triton
@pytest.mark.parametrize("name,topk", TOPK_CASES)
def test_interp_indexer_topk_matches_reference_exactly(interp, name, topk):
    cases, res = interp
    c = cases[f"topk_{name}_{topk}"]
    got = res[f"topk_{name}_{topk}"]
    want = reference.indexer_topk(c["q_idx"], c["k_idx"], c["weights"], topk, c["key_start"], c["query_end"],
                                  c["scale"])
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)  # same keys, same order (descending score, ties -> smaller row), same -1 padding


def _ref_mla(c):
    q = c["q"].to(F64).requires_grad_()
    kv = c["kv"].to(F64).requires_grad_()
    out, lse = reference.sparse_mla(q, kv, c["indices"], c["scale"], c["d_v"])
    loss = (out * c["d_out"].to(F64)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * c["d_lse"].to(F64)).sum()
    loss.backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dkv=kv.grad)


@needs_triton
@pytest.mark.parametrize("name,deterministic", MLA_MODES)
def test_interp_sparse_mla_fwd_bwd(interp, name, deterministic):
    cases, res = interp
    want = _ref_mla(cases[f"mla_{name}"])
    got = res[f"mla_{name}"][deterministic]
    empty = torch.isinf(want["lse"])
    assert torch.equal(torch.isinf(got["lse"]), empty)  # rows without keys: lse = -inf, out = 0
    assert not torch.isnan(got["lse"]).any()
    torch.testing.assert_close(got["lse"][~empty].to(F64), want["lse"][~empty], rtol=1e-5, atol=1e-5)
    for key in ("out", "dq", "dkv"):
        assert torch.isfinite(got[key]).all(), key
        torch.testing.assert_close(got[key].to(F64), want[key], rtol=1e-4, atol=1e-4, msg=key)


@needs_triton
@pytest.mark.parametrize("name,deterministic,variant", MLA_VARIANTS)
def test_interp_sparse_mla_bwd_variants(interp, name, deterministic, variant):
    cases, res = interp
    want = _ref_mla(cases[f"mla_{name}"])
    got = res[f"mla_{name}"][deterministic, variant]
    for run in (got["first"], got):
        for key in ("dq", "dkv"):
            assert torch.isfinite(run[key]).all(), key
            torch.testing.assert_close(run[key].to(F64), want[key], rtol=1e-4, atol=1e-4, msg=key)
    if variant.endswith("restore"):  # the kept buffer: all zero and clean after each backward
        for run in (got["first"], got):
            assert run["kept"] and all(zero and not dirty for zero, dirty in run["kept"]), run["kept"]


@needs_triton
def test_interp_complement_zeroing_touches_exactly_the_unselected_entries_the_products_read(interp):
    """DensePlan ZEROS "complement" (triton_sparse_mla._zero_unselected_kernel): on a NaN buffer, the dS and P
    entries of a [key, row x head] chunk matrix are zero exactly where a product reads (keys below the row's piece
    end: 4 for rows 0-3, 9 for rows 4-5) and the row did not select the key; selected entries and everything past a
    row's piece end stay as they were (NaN here: the kernel writes the former, nothing reads the latter)."""
    cases, res = interp
    c, got = cases["complement_zero"], res["complement_zero"]
    n, h, kc = 6, 2, 9
    ends = [4, 4, 4, 4, 9, 9]
    for off in (0, got["p_off"]):
        mat = got["buffer"][off:off + kc * n * h].view(kc, n, h)
        for k in range(kc):
            for r in range(n):
                selected = k in c["indices"][r].tolist()
                want_zero = k < ends[r] and not selected
                assert bool((mat[k, r] == 0).all()) == want_zero and bool(mat[k, r].isnan().all()) != want_zero, (
                    off, k, r)


@needs_triton
@pytest.mark.parametrize("name,deterministic,with_lse,block_n,dk", KL_MODES)
def test_interp_indexer_kl_loss(interp, name, deterministic, with_lse, block_n, dk):
    cases, res = interp
    c = cases[f"kl_{name}"]
    got = res[f"kl_{name}"][deterministic, with_lse, block_n, dk]
    # the path the variant is about: the tile form only when asked for with bounds; the slot form's dense d_k_idx
    # when asked for, or by auto with bounds in deterministic mode
    assert got["tiles"] == (dk in ("tiles", "tiles_chunked"))
    assert got["dense"] == (dk in ("dense", "dense_chunked") or (dk == "auto_bounds" and deterministic))
    from triton_interp_runner import HOOKS

    q_idx = c["q_idx"].to(F64).requires_grad_()
    k_idx = c["k_idx"].to(F64).requires_grad_()
    w = c["weights"].to(F64).requires_grad_()
    kl, n = reference.indexer_kl_loss(q_idx, k_idx, w, c["idx_scale"], c["q"].to(F64), c["kv"].to(F64), c["scale"],
                                      None, None, indices=c["indices"], token_mask=c["token_mask"],
                                      head_sum_reduce=HOOKS[c["hook"]])
    kl.backward()
    assert got["n"] == n and n > 0
    torch.testing.assert_close(got["kl"].to(F64), kl.detach(), rtol=1e-4, atol=1e-5)
    for key, ref_grad in (("d_q_idx", q_idx.grad), ("d_k_idx", k_idx.grad), ("d_w", w.grad)):
        torch.testing.assert_close(got[key].to(F64), ref_grad, rtol=1e-4, atol=1e-5, msg=key)


def _fp64_kl_from_target(c, indices, head_sums):
    """(KL sum, counted rows, d_q_idx, d_k_idx, d_w) in float64, written here: softmax over each row's selected keys
    of sum_h w relu(scale q_idx . k_idx) against the normalised head sums."""
    idx = indices.long()
    ok = (idx >= 0) & (idx < c["k_idx"].shape[0])
    q_idx, k_idx, w = (c[k].to(F64).requires_grad_() for k in ("q_idx", "k_idx", "weights"))
    a = torch.einsum("thd,tjd->thj", q_idx, k_idx[idx.clamp(min=0)]) * c["idx_scale"]
    z = (w[:, :, None] * torch.relu(a)).sum(1).masked_fill(~ok, float("-inf"))  # relu: no gradient at 0
    rows = ok.any(1)
    log_ind = torch.log_softmax(z[rows], dim=-1)
    p = head_sums.to(F64)[rows]
    tgt = torch.where(ok[rows], p / p.sum(1, keepdim=True), 0.0)
    want = torch.where(tgt > 0, tgt * (torch.log(tgt.clamp(min=1e-300)) - log_ind.masked_fill(~ok[rows], 0.0)),
                       0.0).sum()
    want.backward()
    return want.detach(), int(rows.sum()), q_idx.grad, k_idx.grad, w.grad


def _assert_kl_close(got, want):
    kl, n, d_qi, d_ki, d_w = got[:5]
    assert int(n) == want[1]
    torch.testing.assert_close(kl.to(F64), want[0], rtol=1e-4, atol=1e-5)
    for g, ref in zip((d_qi, d_ki, d_w), want[2:]):
        torch.testing.assert_close(g.to(F64), ref, rtol=1e-4, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("name,topk", KL_AFTER_TOPK)
def test_interp_indexer_kl_takes_the_indexers_log_sum_exp(interp, name, topk):
    """Our indexer leaves under its top-k list the log-sum-exp of each row's selected scores (equal to one computed
    here in float64 from the inputs, -inf for rows without keys); the KL kernel then skips its first pass, and the
    KL and its gradients equal an fp64 KL written here -- in both modes, as with the first pass (INDEXER_LSE off).
    An equal copy of q_idx, or q_idx modified in place, does not get the remembered value."""
    cases, res = interp
    c, got = cases[f"kl_after_topk_{name}"], res[f"kl_after_topk_{name}"]
    idx = got["indices"].long()
    want_idx = reference.indexer_topk(c["q_idx"], c["k_idx"], c["weights"], topk, c["key_start"], c["query_end"],
                                      c["idx_scale"])
    assert torch.equal(got["indices"], want_idx)
    ok = idx >= 0
    scores = reference.indexer_scores_naive(c["q_idx"].to(F64), c["k_idx"].to(F64), c["weights"].to(F64),
                                            c["idx_scale"])
    lse = torch.logsumexp(scores.gather(1, idx.clamp(min=0)).masked_fill(~ok, float("-inf")), dim=1)
    assert got["lse"] is not None and got["lse"].dtype == torch.float32
    assert torch.equal(torch.isinf(got["lse"]), ~ok.any(1)) and not torch.isnan(got["lse"]).any()
    assert (~ok.any(1)).any() == (name == "empty_rows")  # that layout has rows without keys
    torch.testing.assert_close(got["lse"][ok.any(1)].to(F64), lse[ok.any(1)], rtol=1e-6, atol=1e-6)
    want = _fp64_kl_from_target(c, got["indices"], c["head_sums"])
    for det in (False, True):
        assert got["remembered", det][5] and all(got["remembered", det][5])  # every launch given the LSE
        assert got["off", det][5] and not any(got["off", det][5])
        assert got["other_q", det][5] and not any(got["other_q", det][5])
        for way in ("remembered", "off", "other_q"):
            _assert_kl_close(got[way, det], want)
    assert got["after_inplace"] is None


@needs_triton
@pytest.mark.parametrize("deterministic,skip,form", [(False, True, "slots"), (False, False, "slots"),
                                                     (True, True, "slots"), (False, True, "tiles"),
                                                     (True, True, "tiles")])
def test_interp_indexer_kl_from_a_given_target_with_the_padding_skip(interp, deterministic, skip, form):
    """indexer_kl_grads (the deferred KL's entry) from given head sums against an fp64 KL written here: the slot
    form with and without the padding skip (the -1 tail of the top-k rows, which SKIP_PAD stops before;
    deterministic mode: the per-slot rows, no skip), and the tile form (chunks of 5 query rows)."""
    cases, res = interp
    c = cases["kl_given_target"]
    _assert_kl_close(res["kl_given_target"][deterministic, skip, form],
                     _fp64_kl_from_target(c, c["indices"], c["head_sums"]))


@needs_triton
def test_interp_backend_dense_falls_back_and_sparse_uses_kernel(interp):
    cases, res = interp
    c = cases["backend"]
    dense = reference.sparse_mla(c["q"], c["kv"], None, c["scale"], c["d_v"], c["key_start"], c["query_end"])[0]
    torch.testing.assert_close(res["backend"]["dense"], dense)
    sparse = reference.sparse_mla(c["q"].to(F64), c["kv"].to(F64), c["indices"], c["scale"], c["d_v"])[0]
    torch.testing.assert_close(res["backend"]["sparse"].to(F64), sparse, rtol=1e-4, atol=1e-4)


@needs_triton
def test_backend_registry_and_deterministic_env(monkeypatch):
    from megatron_glm5.ops import base, registry
    from megatron_glm5.ops.triton_backend import TritonBackend

    b = registry.BACKENDS["triton"]
    assert isinstance(b, TritonBackend) and b.implemented
    monkeypatch.setattr(base, "cuda_available", lambda: False)
    with pytest.raises(base.BackendUnavailable, match="--attn triton needs a CUDA GPU"):
        registry.get_backend("triton")
    assert registry.get_backend("auto").name == "torch"
    monkeypatch.setattr(base, "cuda_available", lambda: True)
    monkeypatch.setattr(registry.BACKENDS["tilelang"], "_has_tilelang", False)  # auto's earlier choice, if installed
    assert registry.get_backend("triton") is b and registry.get_backend("auto") is b
    code = ("import os, sys; os.environ['GLM5_TRITON_DETERMINISTIC'] = sys.argv[1]; "
            "from megatron_glm5.ops import triton_sparse_mla as m; print(m.deterministic_default())")
    outs = [subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True, timeout=120)
            for v in ("0", "1", "maybe")]
    assert outs[0].stdout.strip() == "False" and outs[1].stdout.strip() == "True"
    assert outs[2].returncode != 0 and "GLM5_TRITON_DETERMINISTIC must be 0 or 1" in outs[2].stderr


# ----------------------------------------------------------------------------------------------------------------------
# GPU: real shapes (h = 64, d = 576 = 512 + 64, top-k 2048, indexer 32 x 128), bf16 vs the fp32 reference
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()),
                                reason="needs a CUDA GPU and triton")
S_GPU, H, DQK, DV, TOPK, HI, DI = 4096, 64, 576, 512, 2048, 32, 128




def rel_l2(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def gpu_causal_indices(ks, qe, topk, gen):
    """Random distinct keys of each window (all of it when it is shorter than topk), -1 padded, on the GPU."""
    n = ks.numel()
    j = torch.arange(int(qe.max()) + 1, device=ks.device)
    r = torch.rand(n, j.numel(), device=ks.device, generator=gen)
    inside = (j[None, :] >= ks[:, None]) & (j[None, :] <= qe[:, None])
    r = torch.where(inside, r, -1.0)
    val, idx = torch.topk(r, topk, dim=-1)
    return torch.where(val >= 0, idx, -1).int()


def gpu_layouts():
    ks, qe, _ = batch_layout([S_GPU])
    pks, pqe, _ = packed_layout(S_GPU, [0, 1000, 1001, 3000])
    return {"causal": (ks.cuda(), qe.cuda()), "packed": (pks.cuda(), pqe.cuda())}


def gpu_sparse_problem(layout, seed):
    """A GLM-5-shaped sparse MLA problem on the GPU in bf16 (q, kv, indices of the layout, d_out, scale) with the
    fp32 reference's out, lse and gradients (for the loss sum(out * d_out)), and NaN-filled out / lse buffers."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ks, qe = gpu_layouts()[layout]
    idx = gpu_causal_indices(ks, qe, TOPK, gen)
    q = torch.randn(S_GPU, H, DQK, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S_GPU, DQK, device="cuda", generator=gen).bfloat16()
    d_out = torch.randn(S_GPU, H, DV, device="cuda", generator=gen).bfloat16()
    scale = DQK ** -0.5
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ro, rl = reference.sparse_mla(qr, kvr, idx, scale, DV)
    (ro * d_out.float()).sum().backward()
    return SimpleNamespace(idx=idx, q=q, kv=kv, d_out=d_out, scale=scale, out=ro.detach(), lse=rl.detach(),
                           dq=qr.grad, dkv=kvr.grad,
                           nan_out=torch.full((S_GPU, H, DV), float("nan"), device="cuda", dtype=torch.bfloat16),
                           nan_lse=torch.full((S_GPU, H), float("nan"), device="cuda"))


@gpu
@needs_cuda
@pytest.mark.parametrize("layout,bwd", [("causal", "default"), ("packed", "default"), ("causal", "fallback"),
                                        ("causal", "slots"), ("packed", "one_kernel"), ("packed", "dense_split1")])
def test_gpu_sparse_mla_real_shapes(layout, bwd):
    from megatron_glm5.ops import triton_sparse_mla as tsm

    pr = gpu_sparse_problem(layout, seed=1)
    q, kv, idx, d_out, scale, out, lse = pr.q, pr.kv, pr.idx, pr.d_out, pr.scale, pr.nan_out, pr.nan_lse
    ro, rl = pr.out, pr.lse
    tsm.sparse_mla_fwd(q, kv, idx, scale, DV, out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_l2(out, ro) <= 1e-2 and rel_l2(lse, rl) <= 1e-2
    grads = {}
    # the configuration used when shared memory is short; the previous one-kernel backward (benchmarks/dsa_kernels.py)
    # (at S 4096 "auto" is "dense"; "slots" is the long-sequence formulation)
    cfg = {"default": None, "fallback": tsm.BWD_FALLBACKS[0], "slots": dict(DK="slots"),
           "one_kernel": tsm.ONE_KERNEL_BWD_CONFIG, "dense_split1": dict(DK="dense", DENSE_SPLIT=1)}[bwd]
    for det in (True, False):
        dq = torch.full_like(q, float("nan"))
        grads[det, str(cfg)] = g = tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV,
                                                       deterministic=det, dq=dq, config=cfg)
        for name, g, want in (("dq", g[0], pr.dq), ("dkv", g[1], pr.dkv)):
            assert not g.isnan().any(), name
            assert rel_l2(g, want) <= 1e-2, (name, det, cfg, rel_l2(g, want))
    again = tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=True, config=cfg)
    assert torch.equal(again[1], grads[True, str(cfg)][1]) and torch.equal(again[0], grads[True, str(cfg)][0])


@gpu
@needs_cuda
def test_gpu_sparse_mla_bwd_never_synchronises_with_the_host():
    """The backward's planning uses host-known sizes only: no device-to-host copy or synchronisation in any
    formulation (torch's sync debug mode raises on one), and the results are those of the earlier runs."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    from megatron_glm5.ops import host_windows

    pr = gpu_sparse_problem("causal", seed=4)
    out, lse = tsm.sparse_mla_fwd(pr.q, pr.kv, pr.idx, pr.scale, DV)
    # the same lists with the indexer's host row bounds (causal: row t's last key is t): cuBLAS dense products
    bounded = pr.idx.clone()
    host_windows.remember_row_ends(bounded, torch.arange(bounded.shape[0]))
    for det, cfg, idx in ((False, None, pr.idx), (True, None, pr.idx), (True, dict(DK="slots"), pr.idx),
                          (False, dict(DK="slots"), pr.idx), (False, None, bounded), (True, None, bounded),
                          (False, dict(ZEROS="complement", DENSE_PIECE_ROWS=256), bounded)):
        first = tsm.sparse_mla_bwd(pr.q, pr.kv, idx, out, lse, pr.d_out, None, pr.scale, DV, deterministic=det,
                                   config=cfg)  # compiles outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = tsm.sparse_mla_bwd(pr.q, pr.kv, idx, out, lse, pr.d_out, None, pr.scale, DV,
                                       deterministic=det, config=cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rel_l2(again[1], pr.dkv) <= 1e-2 and rel_l2(again[0], pr.dq) <= 1e-2, (det, cfg)
        if det:
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1]), cfg


def dense_zero_ahead_runs(backward, rows: int = 256):
    """The dense formulation's gradients with and without ZERO_AHEAD (the next chunk's buffer zeroed on a side
    stream; triton_sparse_mla.DensePlan) at S 4096 causal with ``rows``-row chunks, the indexer's host row bounds
    given: backward(problem, idx, config) -> (dq, dkv[, ...]). Both must equal bitwise: the same kernels and GEMMs in the
    same order, only where the memsets run differs; a memset racing a chunk's kernel or GEMMs would show.
    Then ZEROS "restore" (one buffer kept zero, only the written entries zeroed again after each chunk): after a
    backward of another problem (other keys, packed documents) on that buffer, twice on this one -- bitwise the
    memset path's, and the kept buffer all zero and clean after each."""
    from megatron_glm5.ops import host_windows
    from megatron_glm5.ops import triton_sparse_mla as tsm

    pr = gpu_sparse_problem("causal", seed=5)
    idx = pr.idx.clone()
    host_windows.remember_row_ends(idx, torch.arange(idx.shape[0]))
    got = {}
    for ahead in (False, True, True):
        cfg = dict(DENSE_ROWS=rows, ZERO_AHEAD=ahead)
        plan = tsm.dense_plan(pr.q, pr.kv, idx, None, cfg)
        assert plan is not None and plan.ahead == ahead and len(plan.starts) == -(-pr.q.shape[0] // rows)
        got.setdefault(ahead, []).append(backward(pr, idx, cfg))
    for a, b in zip(got[False][0], got[True][0]):
        assert torch.equal(a, b)
    for a, b in zip(got[True][0], got[True][1]):
        assert torch.equal(a, b)
    dq, dkv = got[True][0][:2]
    assert rel_l2(dq, pr.dq) <= 1e-2 and rel_l2(dkv, pr.dkv) <= 1e-2, (rel_l2(dq, pr.dq), rel_l2(dkv, pr.dkv))
    other = gpu_sparse_problem("packed", seed=7)
    idx_o = other.idx.clone()
    host_windows.remember_row_ends(idx_o, idx_o.max(1).values.long().cpu())
    cfg = dict(DENSE_ROWS=rows, ZEROS="restore")
    for prob, ix in ((other, idx_o), (pr, idx), (pr, idx)):
        plan = tsm.dense_plan(prob.q, prob.kv, ix, None, cfg)
        assert plan is not None and plan.zeros == "restore" and not plan.ahead
        res = backward(prob, ix, cfg)
        kept = [(bool(t.eq(0).all()), dirty) for t, dirty in tsm._kept_zero.buffers.values()]
        assert kept and all(zero and not dirty for zero, dirty in kept), kept
    for a, b in zip(got[False][0], res):
        assert torch.equal(a, b)


@needs_triton
def test_kept_zero_buffer_is_zeroed_again_after_a_plan_that_failed_midway(monkeypatch):
    """ZEROS "restore"'s kept buffer: reused while clean; grown as a fresh zero buffer; a plan that set it dirty
    (its kernel may have written) and never restored it -- an exception between -- is zeroed in full by the next."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    kept = tsm._KeptZero()
    entry = kept.take(8, torch.float32, "cpu")
    assert entry[0].eq(0).all() and not entry[1]
    assert kept.take(6, torch.float32, "cpu") is entry  # large enough: the same
    entry[0][3] = 5.0
    entry[1] = True  # a plan's kernel wrote; its restore never ran
    again = kept.take(8, torch.float32, "cpu")
    assert again is entry and again[0].eq(0).all() and not again[1]
    bigger = kept.take(16, torch.float32, "cpu")
    assert bigger[0].numel() == 16 and bigger[0].eq(0).all() and len(kept.buffers) == 1
    kept.release()
    assert not kept.buffers
    # "auto": restore where n_keys > ZEROS_RESTORE_RATIO x top-k (the selected entries a small part), else memsets
    from megatron_glm5.ops import host_windows
    # (on the CPU only under Triton's interpreter: the restore is a Triton kernel)
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        for n_keys, restored in ((8, False), (9, interpret == "1")):
            idx = torch.zeros(n_keys, 4, dtype=torch.int32)
            host_windows.remember_row_ends(idx, torch.zeros(n_keys, dtype=torch.int64))
            plan = tsm.dense_plan(torch.zeros(n_keys, 2, 8), torch.zeros(n_keys, 8), idx, None,
                                  dict(DK="dense", ZEROS="auto"))
            assert (plan.zeros == "restore") == restored, (interpret, n_keys)
    for zeros in ("restore", "complement"):
        with pytest.raises(ValueError, match=f"'{zeros}' runs a Triton kernel: it needs a CUDA GPU"):
            tsm.dense_plan(torch.zeros(9, 2, 8), torch.zeros(9, 8), idx, None, dict(DK="dense", ZEROS=zeros))
    with pytest.raises(ValueError, match="unknown ZEROS 'sometimes'"):
        host_idx = torch.zeros(4, 2, dtype=torch.int32)
        from megatron_glm5.ops import host_windows
        host_windows.remember_row_ends(host_idx, torch.zeros(4, dtype=torch.int64))
        tsm.dense_plan(torch.zeros(4, 2, 8), torch.zeros(4, 8), host_idx, None, dict(DK="dense", ZEROS="sometimes"))


@gpu
@needs_cuda
@pytest.mark.parametrize("det", [True, False])
def test_gpu_dense_backward_zero_ahead_is_bitwise_the_same(det):
    from megatron_glm5.ops import triton_sparse_mla as tsm

    def backward(pr, idx, cfg):
        out, lse = tsm.sparse_mla_fwd(pr.q, pr.kv, idx, pr.scale, DV)
        return tsm.sparse_mla_bwd(pr.q, pr.kv, idx, out, lse, pr.d_out, None, pr.scale, DV, deterministic=det,
                                  config=cfg)

    dense_zero_ahead_runs(backward)


@needs_triton
@pytest.mark.parametrize("config,want", [(None, [64, 32]), (dict(DK="slots"), [64, 32]),
                                         (dict(DK="slots", BLOCK_N=64), [64])])
def test_bwd_falls_back_to_smaller_blocks_unless_the_caller_set_a_block_shape(monkeypatch, config, want):
    """A launch short of shared memory (OutOfResources) is retried with BWD_FALLBACKS' smaller block shape when the
    caller's config leaves the block shape alone (the dense prefix's "slots" part asks for DK only), but not when it
    set one.  The kernel is a stand-in that refuses the first launch and records what it was asked."""
    from triton.runtime.errors import OutOfResources

    from megatron_glm5.ops import triton_sparse_mla as tsm

    launched = []

    class Stop(Exception):
        pass

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(kw["BLOCK_N"])
                if len(launched) == 1:
                    raise OutOfResources(300000, 232448, "shared memory")
                raise Stop
            return launch

    monkeypatch.setattr(tsm, "_bwd_kernel", Kernel())
    monkeypatch.setattr(tsm, "bwd_delta", lambda o, d, l: torch.zeros(o.shape[:2]))
    q, kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16), torch.zeros(64, 576, dtype=torch.bfloat16)
    idx = torch.arange(8, dtype=torch.int32).repeat(4, 1)
    out, d_out, lse = torch.zeros(4, 16, 512, dtype=torch.bfloat16), torch.zeros(4, 16, 512, dtype=torch.bfloat16), \
        torch.zeros(4, 16)
    with pytest.raises(Stop if len(want) > 1 else OutOfResources):
        tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, 0.1, 512, deterministic=False, config=config)
    assert launched == want


def _fp32_add_case(device):
    """An fp32 matrix, the view of it that mm_fp32_add_ adds into (rows and columns cut: strided), bf16 operands."""
    g = torch.Generator().manual_seed(7)
    acc = torch.randn(100, 576, generator=g).to(device)
    a = torch.randn(64, 300, generator=g).to(device, torch.bfloat16)
    b = torch.randn(300, 512, generator=g).to(device, torch.bfloat16)
    return acc, a, b


def test_mm_fp32_add_into_a_strided_view_leaves_the_rest():
    from megatron_glm5.ops import triton_sparse_mla as tsm

    acc, a, b = _fp32_add_case("cpu")
    before = acc.clone()
    tsm.mm_fp32_add_(acc[:64, :512], a, b)
    want = before[:64, :512].double() + a.double() @ b.double()
    assert (acc[:64, :512].double() - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(acc[64:], before[64:]) and torch.equal(acc[:, 512:], before[:, 512:])


@gpu
@needs_cuda
def test_gpu_mm_fp32_add_into_a_strided_view():
    """On the GPU the sum goes through cuBLAS's epilogue where torch allows it (torch.addmm out_dtype into the fp32
    view): the same as the fp32 product added afterwards, within fp32 rounding, and nothing outside the view."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    acc, a, b = _fp32_add_case("cuda")
    before = acc.clone()
    tsm.mm_fp32_add_(acc[:64, :512], a, b)
    want = before[:64, :512] + tsm._mm_fp32(a, b)
    print("fused addmm:", tsm._addmm_into_fp32(torch.bfloat16))
    assert (acc[:64, :512] - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(acc[64:], before[64:]) and torch.equal(acc[:, 512:], before[:, 512:])


@gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_gpu_indexer_topk_real_shapes(layout):
    from megatron_glm5.ops import triton_indexer

    gen = torch.Generator(device="cuda").manual_seed(2)
    ks, qe = gpu_layouts()[layout]
    # exact arithmetic at real shapes: identical lists, tie rule included
    qi, ki, w = int_inputs(S_GPU, S_GPU, HI, DI, gen, "cuda")
    got = triton_indexer.indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25)
    assert torch.equal(got, reference.indexer_topk(qi, ki, w, TOPK, ks, qe, 0.25))
    # random bf16 data: same sets except where two scores are within fp32 rounding of the k-th score
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    scale = DI ** -0.5
    got = triton_indexer.indexer_topk(qi, ki, w, TOPK, ks, qe, scale)
    want = reference.indexer_topk(qi, ki, w, TOPK, ks, qe, scale)
    assert_same_sets_up_to_rounding(got, want, qi, ki, w, scale)


def assert_same_sets_up_to_rounding(got, want, qi, ki, w, scale):
    """Top-k of random data: the same key sets on >= 99% of rows; on the others the keys that differ score within
    fp32 rounding of the row's k-th score (a tie the two summation orders break differently)."""
    same_rows = (torch.sort(got, dim=-1).values == torch.sort(want, dim=-1).values).all(dim=-1)
    assert float(same_rows.float().mean()) >= 0.99
    for t in torch.nonzero(~same_rows).flatten().tolist():
        s = reference.indexer_scores_naive(qi[t:t + 1], ki, w[t:t + 1], scale)[0]
        kth = s[want[t][want[t] >= 0]].min()
        diff = set(got[t].tolist()) ^ set(want[t].tolist())
        assert all(abs(float(s[j] - kth)) <= 1e-5 * (1 + abs(float(kth))) for j in diff if j >= 0), t


@gpu
@needs_cuda
def test_gpu_indexer_kl_loss_real_shapes():
    from megatron_glm5.ops import triton_kl, triton_sparse_mla

    gen = torch.Generator(device="cuda").manual_seed(3)
    ks, qe = gpu_layouts()["causal"]
    idx = gpu_causal_indices(ks, qe, TOPK, gen)
    q = torch.randn(S_GPU, H, DQK, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S_GPU, DQK, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    lse = triton_sparse_mla.sparse_mla_fwd(q, kv, idx, DQK ** -0.5, DV)[1]
    probs = []
    for given in (None, lse):  # two passes, or one with the forward's lse: the same head sums
        p = torch.full((S_GPU, TOPK), float("nan"), device="cuda")
        triton_kl.head_summed_probs(q, kv, idx, DQK ** -0.5, DV, attn_lse=given, out=p)
        assert not p.isnan().any()
        probs.append(p)
    assert rel_l2(probs[1], probs[0]) <= 1e-3
    a = [x.clone().float().requires_grad_() for x in (qi, ki, w)]
    kl_r, n_r = reference.indexer_kl_loss(a[0], a[1], a[2], DI ** -0.5, q.float(), kv.float(), DQK ** -0.5,
                                          None, None, indices=idx)
    kl_r.backward()
    g_r = [x.grad for x in a]
    det_grads = []
    for det, given in ((False, None), (True, lse), (True, lse)):
        a = [x.clone().requires_grad_() for x in (qi, ki, w)]  # bf16 indexer inputs, as in training
        kl_t, n_t = triton_kl.indexer_kl_loss_sparse(a[0], a[1], a[2], DI ** -0.5, q, kv, DQK ** -0.5, idx, DV,
                                                     attn_lse=given, deterministic=det)
        kl_t.backward()
        assert n_t == n_r and abs(float(kl_t - kl_r)) <= 1e-2 * abs(float(kl_r)), (det, float(kl_t), float(kl_r))
        for x, gr, name in zip(a, g_r, ("d_q_idx", "d_k_idx", "d_w")):
            assert not x.grad.isnan().any() and rel_l2(x.grad, gr) <= 1e-2, (name, det, rel_l2(x.grad, gr))
        if det:
            det_grads.append(a[1].grad)
    assert torch.equal(det_grads[0], det_grads[1])  # deterministic d_k_idx: bitwise the same run to run
    # with the host row bounds the indexer leaves (here: read back): the slot form's dense d_k_idx and the tile
    # form (its G buffer NaN-poisoned: every element must be written), either mode
    from megatron_glm5.ops import host_windows, triton_kl_tiles
    idx_b = idx.clone()
    host_windows.remember_row_ends(idx_b, idx_b.max(1).values.long().cpu())
    real_new_g = triton_kl_tiles._new_g
    triton_kl_tiles._new_g = lambda *a: real_new_g(*a).fill_(float("nan"))
    try:
        for config in (dict(FORM="slots", DK="dense"), dict(FORM="tiles")):
            no_atomics = []
            for det in (False, True):
                a = [x.clone().requires_grad_() for x in (qi, ki, w)]
                kl_t, n_t = triton_kl.indexer_kl_loss_sparse(a[0], a[1], a[2], DI ** -0.5, q, kv, DQK ** -0.5, idx_b,
                                                             DV, attn_lse=lse, deterministic=det, config=config)
                kl_t.backward()
                assert n_t == n_r and abs(float(kl_t - kl_r)) <= 1e-2 * abs(float(kl_r)), (config, float(kl_t))
                for x, gr, name in zip(a, g_r, ("d_q_idx", "d_k_idx", "d_w")):
                    assert not x.grad.isnan().any() and rel_l2(x.grad, gr) <= 1e-2, (name, config, rel_l2(x.grad, gr))
                no_atomics.append(a[1].grad)
            assert torch.equal(no_atomics[0], no_atomics[1])  # no atomics: the same bits in both modes
    finally:
        triton_kl_tiles._new_g = real_new_g


@gpu
@needs_cuda
@pytest.mark.parametrize("indexer", ["triton", "tilelang"])
def test_gpu_indexer_kl_after_our_indexer_takes_its_log_sum_exp(indexer):
    """GLM-5 shapes, causal: our indexer's top-k leaves the log-sum-exp of each row's selected scores (within 1e-5
    of one computed here in fp32 from the reference scores); the KL then skips its first pass and equals the
    fp32 reference and the two-pass KL (INDEXER_LSE off) in both modes."""
    from megatron_glm5.ops import host_windows, triton_indexer, triton_kl

    if indexer == "tilelang":
        from megatron_glm5.ops import tilelang_sparse_mla
        if not tilelang_sparse_mla.probe_tilelang():
            pytest.skip("tilelang is not installed")
        from megatron_glm5.ops.tilelang_indexer import tilelang_indexer_topk as topk_fn
    else:
        topk_fn = triton_indexer.indexer_topk
    gen = torch.Generator(device="cuda").manual_seed(5)
    ks, qe = gpu_layouts()["causal"]
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    scale = DI ** -0.5
    idx = topk_fn(qi, ki, w, TOPK, ks, qe, scale)
    lse = host_windows.selected_lse(idx, qi, ki, w, scale)
    assert lse is not None
    ok = idx >= 0
    want = torch.empty(S_GPU, device="cuda")
    for c0 in range(0, S_GPU, 512):  # fp32 reference scores of the selected keys, in row chunks
        s = reference.indexer_scores_naive(qi[c0:c0 + 512].float(), ki.float(), w[c0:c0 + 512], scale)
        sel = s.gather(1, idx[c0:c0 + 512].long().clamp(min=0)).masked_fill(~ok[c0:c0 + 512], float("-inf"))
        want[c0:c0 + 512] = torch.logsumexp(sel, dim=1)
    assert ok.any(1).all()  # causal: every row has its own key
    assert (lse - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    head_sums = torch.rand(S_GPU, TOPK, device="cuda", generator=gen) * ok  # any target, 0 on unused slots
    want_kl = _fp64_kl_from_target(dict(q_idx=qi, k_idx=ki, weights=w, idx_scale=scale), idx, head_sums)
    results = {}
    for det in (False, True):
        for cfg in ({}, dict(INDEXER_LSE=False)):
            results[det, bool(cfg)] = triton_kl.indexer_kl_grads(qi, ki, w, idx, head_sums, scale, deterministic=det,
                                                                 config=cfg or None)
    for det in (False, True):
        one, two = results[det, False], results[det, True]
        assert int(one[1]) == S_GPU == want_kl[1] and int(two[1]) == S_GPU
        assert abs(float(one[0] - two[0])) <= 1e-4 * abs(float(two[0])), (float(one[0]), float(two[0]))
        assert abs(float(one[0]) - float(want_kl[0])) <= 1e-2 * abs(float(want_kl[0])), (float(one[0]), want_kl[0])
        for g1, g2, gr, name in zip(one[2:], two[2:], want_kl[2:], ("d_q_idx", "d_k_idx", "d_w")):
            assert not g1.isnan().any() and rel_l2(g1, g2) <= 1e-4, (name, det, rel_l2(g1, g2))
            assert rel_l2(g1, gr.to(g1.dtype)) <= 1e-2, (name, det, rel_l2(g1, gr.to(g1.dtype)))


@needs_triton
def test_indexer_kl_dense_dk_choice_and_its_fallback_is_logged(caplog, monkeypatch):
    """DK "auto": dense only in deterministic mode with host bounds and few enough keys; "dense" asked for top-k lists
    without bounds says once that it takes the atomic path; an unknown mode is refused."""
    import logging

    from megatron_glm5.ops import base, triton_kl

    monkeypatch.setattr(base, "_warned", set())  # warn_once: not already said by another test in this process
    bounds = torch.zeros(4, dtype=torch.int64)
    assert triton_kl._dk_dense({"DK": "auto"}, bounds, 4096, 2048, True)
    assert not triton_kl._dk_dense({"DK": "auto"}, bounds, 4096, 2048, False)
    assert not triton_kl._dk_dense({"DK": "auto"}, bounds, 32768 * 2, 2048, True)  # ratio 32 > 20
    assert not triton_kl._dk_dense({"DK": "auto"}, None, 4096, 2048, True)
    assert triton_kl._dk_dense({"DK": "dense"}, bounds, 32768 * 2, 2048, False)
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        assert not triton_kl._dk_dense({"DK": "dense"}, None, 4096, 2048, False)
    assert "DK='dense' needs the host row bounds" in caplog.text and "atomic d_k_idx path" in caplog.text
    with pytest.raises(ValueError, match="unknown DK mode 'fast'"):
        triton_kl._dk_dense({"DK": "fast"}, bounds, 4096, 2048, False)


@needs_triton
def test_indexer_kl_tile_form_choice_and_its_fallback_is_logged(caplog, monkeypatch):
    """FORM: the slot form by default (the tile form measured slower); "tiles" with host bounds takes it, without
    them says once that it takes the slot form; an unknown form is refused."""
    import logging

    from megatron_glm5.ops import base, triton_kl

    monkeypatch.setattr(base, "_warned", set())
    bounds = torch.zeros(4, dtype=torch.int64)
    assert triton_kl.KL_CONFIG["FORM"] == "slots" and not triton_kl._tiles_form(triton_kl.KL_CONFIG, bounds)
    assert triton_kl._tiles_form({"FORM": "tiles"}, bounds)
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        assert not triton_kl._tiles_form({"FORM": "tiles"}, None)
    assert "FORM='tiles' needs the host row bounds" in caplog.text and "the slot form" in caplog.text
    with pytest.raises(ValueError, match="unknown FORM 'auto'"):
        triton_kl._tiles_form({"FORM": "auto"}, bounds)


def test_head_dims_below_the_dot_minimum_fall_back_on_a_gpu(monkeypatch):
    """The tiny presets' d_rope 8 cannot go through tl.dot on a GPU (a compile error there; the interpreter does
    not check): the backend names the reason and uses the reference instead."""
    from megatron_glm5.ops import triton_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "below Triton's matrix-multiply minimum of 16" in triton_backend._kernel_dims_reason(d_v=16, d_rope=8)
    assert triton_backend._kernel_dims_reason(d_v=512, d_rope=64, index_head_dim=128) is None
    assert "not a power of two" in triton_backend._kernel_dims_reason(d_v=24)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_backend._kernel_dims_reason(d_v=16, d_rope=8) is None  # the interpreter runs tiny shapes


def _compile_for_sm90a(fn, signature: dict, constexprs: dict, cfg: dict, divisible=()):
    """Triton's own compiler and ptxas, no GPU: (the PTX, the shared-memory bytes, ptxas's resource report).
    ``divisible``: the arguments to compile as multiples of 16 (what Triton specialises on at a launch whose pointers
    and integers are)."""
    import os

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    src = ASTSource(fn=fn, signature=dict(signature, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in divisible})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"],
                                                                          num_stages=cfg["num_stages"]))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = None
    if os.path.exists(ptxas):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(k.asm["ptx"])
            proc = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".cubin"],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            report = proc.stderr
    return k.asm["ptx"], k.metadata.shared, report


@needs_triton
@pytest.mark.parametrize("need_grad", [True, False])
def test_kl_tile_kernel_lowers_to_wgmma_for_sm90a(need_grad):
    """The tile form's kernel at GLM-5's indexer shapes (32 heads x 128, bf16) with its default configuration,
    compiled for the H200 without a GPU: it lowers (the reshapes of the head reduction included), its products are
    wgmma, its shared memory fits, and ptxas accepts it (its register / spill report in the failure message)."""
    from megatron_glm5.ops import triton_kl_tiles as m

    cfg = m.TILE_CONFIG
    sig = {"QI": "*bf16", "KI": "*bf16", "W": "*fp32", "PD": "*fp32", "TOT": "*fp32", "CNT": "*i8", "KL": "*fp32",
           "DQI": "*fp32", "DW": "*fp32", "G": "*bf16", "stride_qit": "i32", "stride_qih": "i32",
           "stride_kit": "i32", "stride_wt": "i32", "stride_pd": "i32", "t0": "i32", "n_rows": "i32",
           "n_heads": "i32", "n_keys": "i32", "key_end": "i32", "scale": "fp32"}
    const = {"DI": 128, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_H": 32, "BLOCK_N": cfg["BLOCK_N"], "NEED_GRAD": need_grad,
             "IEEE": False}
    ptx, shared, report = _compile_for_sm90a(m._kl_tiles_kernel, sig, const, cfg)
    print(f"KL tile kernel, need_grad={need_grad}: shared {shared} B\n{report}")  # docs/design.md quotes it (-s)
    assert "wgmma.mma_async" in ptx
    assert shared <= 227 * 1024, shared
    if report is not None:
        assert "registers" in report, report


@needs_triton
def test_zeroing_kernels_store_16_byte_vectors_for_sm90a():
    """The dense plan's zeroing kernels (ZEROS "restore": _restore_zeros_kernel; "complement":
    _zero_unselected_kernel) at 64 heads in bf16, compiled for the H200 without a GPU, with the pointers and sizes
    multiples of 16 as at GLM-5 shapes: every global store is a 16-byte vector (a head row of 128 bytes in eight),
    not element by element."""
    import re

    from megatron_glm5.ops import triton_sparse_mla as tsm

    cases = (
        (tsm._restore_zeros_kernel, {"IDX": "*i32", "PDS": "*bf16", "stride_it": "i32", "t0": "i32", "kc": "i32",
                                     "topk": "i32", "dense_cols": "i32", "p_off": "i32", "n_heads": "i32"},
         {"BLOCK_S": 64, "HP": 64}, ("IDX", "PDS", "stride_it", "dense_cols", "p_off", "n_heads")),
        (tsm._zero_unselected_kernel, {"SEL": "*u8", "PDS": "*bf16", "stride_sel": "i32", "k_lo": "i32",
                                       "k_hi": "i32", "r_lo": "i32", "n_rows": "i32", "dense_cols": "i32",
                                       "p_off": "i32", "n_heads": "i32"},
         {"BLOCK_K": 16, "BLOCK_R": 8, "HP": 64}, ("SEL", "PDS", "dense_cols", "p_off", "n_heads")))
    for fn, sig, const, divisible in cases:
        ptx, _, _ = _compile_for_sm90a(fn, sig, const, dict(num_warps=4, num_stages=1), divisible)
        stores = re.findall(r"st\.global[.\w]*", ptx)
        assert stores and set(stores) == {"st.global.v4.b32"}, (fn.__name__, sorted(set(stores)))


@needs_triton
def test_interp_used_slot_ends_kernel_counts_to_each_rows_last_used_slot(interp):
    """The one-pass kernel (_slot_ends_kernel, under the interpreter): the loop's answer for every list and step."""
    cases, results = interp
    c = cases["slot_ends"]
    for i, idx in enumerate(c["lists"]):
        for step in c["steps"]:
            got = results["slot_ends"][i, step]
            assert got.dtype == torch.int32 and got.tolist() == expected_slot_ends(idx, c["n_keys"], step), (i, step)


@gpu
@needs_cuda
def test_gpu_used_slot_ends_kernel_counts_to_each_rows_last_used_slot():
    """The one-pass kernel on the GPU, at a GLM-5 list size too (4,096 x 2,048 with a causal -1 tail and holes)."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    g = torch.Generator().manual_seed(5)
    causal = torch.randint(0, 4096, (4096, 2048), generator=g, dtype=torch.int32)
    causal[torch.arange(2048)[None, :] > torch.arange(4096)[:, None]] = -1
    causal[torch.rand(causal.shape, generator=g) < 0.01] = -1
    for idx, n_keys in [(x, SLOT_ENDS_KEYS) for x in slot_end_lists(g)] + [(causal, 4096)]:
        for step in (1, 128):
            got = tsm.used_slot_ends(idx.cuda(), n_keys, step)
            assert got.is_cuda and got.cpu().tolist() == expected_slot_ends(idx, n_keys, step), step
