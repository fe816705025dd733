"""The indexer KL target's head sums written by the Triton sparse forward (ops/triton_sparse_mla.py, head_probs):
equal to the separate head-sum kernel (ops/triton_kl.py) and to a hand-written fp64 softmax, the forward's out / lse
unchanged, and the sparse KL (loss and gradients) the same whether its target comes from the forward or from its own
kernel (``triton_kl.indexer_kl_loss_sparse(attn_head_probs=)``) -- under Triton's interpreter (CPU), in one
subprocess.  (Not used in training: measured slower than the separate kernel on the H200, docs/performance.md.)"""

import importlib.util

import pytest
import torch

from test_ops_reference import LAYOUTS
from interp_harness import run_interpreted, softmax_head_sums
from test_ops_triton import D_ROPE, D_V, random_indices

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")
# (layout, heads, top-k, forward key block, TP head-sum hook): 20 heads pad to 32 rows; block 8 < top-k 12 leaves a
# partial block
CASES = [("packed", 3, 8, 16, "none"), ("cp", 20, 16, 8, "mix"), ("empty_rows", 2, 12, 8, "none")]


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    g = torch.Generator().manual_seed(5)
    cases = {}
    for name, heads, topk, block_n, hook in CASES:
        ks, qe, n_k = LAYOUTS[name]()
        n_q = ks.numel()
        cases[name] = dict(
            q=torch.randn(n_q, heads, D_V + D_ROPE, generator=g), kv=torch.randn(n_k, D_V + D_ROPE, generator=g),
            indices=random_indices(ks, qe, topk, g), scale=0.3, d_v=D_V, block_n=block_n, hook=hook,
            q_idx=torch.randn(n_q, 4, 8, generator=g), k_idx=torch.randn(n_k, 8, generator=g),
            weights=torch.rand(n_q, 4, generator=g), idx_scale=0.5, token_mask=torch.rand(n_q, generator=g) > 0.2)
    return cases, run_interpreted(tmp_path_factory, "fused_kl", "fused_kl_interp_runner.py", cases)




@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_forward_head_sums_equal_separate_kernel_and_softmax(interp, name):
    cases, res = interp
    c, r = cases[name], res[name]
    assert not torch.isnan(r["fused"]).any()  # the NaN-poisoned buffer is written in full
    torch.testing.assert_close(r["fused"].double(), softmax_head_sums(c), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r["fused"], r["separate_lse"], rtol=1e-6, atol=1e-6)
    assert torch.equal(r["out0"], r["out1"]) and torch.equal(r["lse0"], r["lse1"])  # out / lse unchanged


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_kl_from_forward_head_sums_equals_kl_from_its_own_kernel(interp, name):
    _, res = interp
    r = res[name]
    got, want = r["kl_fused"], r["kl_separate"]
    assert int(got["n"]) == int(want["n"]) > 0
    for key in ("kl", "d_q_idx", "d_k_idx", "d_w"):
        assert torch.isfinite(got[key]).all() and got[key].abs().sum() > 0, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
