"""The deferred indexer KL of the Triton backend (megatron_glm5/ops/deferred_kl.py): the sparse-MLA backward's head
sums equal a hand-written fp64 softmax and the separate head-sum kernel, the backward's dq / dkv are unchanged by
writing them, and a training step with the KL computed in the backward gives the same loss, indexer KL and
gradients of every parameter as the forward-time KL -- under Triton's interpreter (CPU), in one subprocess."""

import importlib.util

import pytest
import torch

from test_ops_triton import D_ROPE, D_V, random_indices
from interp_harness import run_interpreted, softmax_head_sums

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")
# 14 queries, query t sees keys 0..t-1 (query 0 none); 20 heads pad to 32 rows (two groups of 16 in
# "two_groups"); top-k 12: the early rows are short (-1 padded), the last ones select
N_Q, HEADS, TOPK = 14, 20, 12
# one step of the tiny model: the forward-time KL, the deferred KL, and the deferred KL under full recompute (the
# forward runs twice) with the per-token loss (the KL sum: indexer gradients x the counted tokens, SEQ)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MODEL_RUNS = {"old": dict(defer=False, per_token=False), "new": dict(defer=True, per_token=False),
              "new_recompute_per_token": dict(defer=True, per_token=True, **FULL)}
SEQ = 20  # > top-k 16: the last queries select


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    ks, qe = torch.zeros(N_Q, dtype=torch.long), torch.arange(N_Q) - 1
    cases = dict(kernel=dict(kind="kernel", q=torch.randn(N_Q, HEADS, D_V + D_ROPE, generator=g),
                             kv=torch.randn(N_Q, D_V + D_ROPE, generator=g), indices=random_indices(ks, qe, TOPK, g),
                             scale=0.3, d_v=D_V, d_out=torch.randn(N_Q, HEADS, D_V, generator=g),
                             d_lse=torch.randn(N_Q, HEADS, generator=g)),
                 model=dict(kind="model", runs=MODEL_RUNS, ids=torch.randint(0, 512, (1, SEQ + 1), generator=g)))
    return cases, run_interpreted(tmp_path_factory, "deferred_kl", "deferred_kl_interp_runner.py", cases)




def test_backward_head_sums_equal_softmax_and_separate_kernel(interp):
    cases, res = interp
    c, r = cases["kernel"], res["kernel"]
    want = softmax_head_sums(c)
    assert (want[0] == 0).all() and (want[1:].sum(-1) - HEADS).abs().max() < 1e-9  # each head's softmax sums to 1
    assert (c["indices"][:, -4:] < 0).all(-1).sum() >= 4  # rows whose last 4-key block is padding (skipped)
    variants = [k for k in r if k != "separate"]
    assert len(variants) == 6
    for key in variants:
        v = r[key]
        assert not torch.isnan(v["head_sums"]).any(), key  # the NaN-poisoned buffer is written in full
        torch.testing.assert_close(v["head_sums"].double(), want, rtol=1e-5, atol=1e-6, msg=str(key))
        torch.testing.assert_close(v["head_sums"], r["separate"], rtol=1e-5, atol=1e-6, msg=str(key))
        # writing the head sums changes nothing else
        assert torch.equal(v["dq"], v["dq_plain"]) and torch.equal(v["dkv"], v["dkv_plain"]), key


def test_deferred_kl_step_equals_forward_time_kl(interp):
    _, res = interp
    old = res["model"]["old"]
    assert float(old["kl"][0]) > 0 and old["kl_count"] == [1]
    indexer = [n for n in old["grads"] if ".indexer." in n]
    assert len(indexer) >= 3 and all(old["grads"][n].abs().sum() > 0 for n in indexer)
    for run, tokens in (("new", 1), ("new_recompute_per_token", SEQ)):
        new = res["model"][run]
        torch.testing.assert_close(new["loss"], old["loss"], rtol=0, atol=0)
        # one indexer layer (the IndexShare one has none); its KL is known after the backward, counted once
        assert new["kl_before_backward"] == [None] and new["kl_count"] == [1], run
        torch.testing.assert_close(new["kl"][0], old["kl"][0], rtol=1e-6, atol=0, msg=run)
        assert set(new["grads"]) == set(old["grads"]), run
        for n, g_old in old["grads"].items():
            want = g_old * tokens if n in indexer else g_old
            torch.testing.assert_close(new["grads"][n], want, rtol=1e-5, atol=1e-9, msg=f"{run}: {n}")



def test_the_job_is_freed_without_the_cyclic_collector():
    """After the backward, nothing keeps the deferred-KL job alive: freed by reference counting alone (the job ->
    token -> autograd node -> job cycle is broken in the backward), with Python's collector off."""
    import gc
    import weakref

    from megatron_glm5.ops.deferred_kl import DeferredIndexerKL

    q_idx, k_idx, w = (torch.randn(4, 2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True),
                       torch.randn(4, 2, requires_grad=True))
    q = torch.randn(4, 2, 5, requires_grad=True)
    indices = torch.zeros(4, 2, dtype=torch.int32)

    def kl_grads(qi, ki, wt, idx, head_sums):  # a stand-in for the backend's kernel: value, count, gradients
        return head_sums.sum(), torch.tensor(4), torch.ones_like(qi), torch.ones_like(ki), torch.ones_like(wt)

    gc.disable()
    try:
        job = DeferredIndexerKL(q_idx, k_idx, w, indices, kl_grads, per_token=False)
        loss = job.order(q).sum() + 2.0 * job.token
        job.receive(torch.ones(4, 2))  # as the sparse-MLA backward would, before the token's backward
        loss.backward()
        assert torch.equal(q_idx.grad, torch.full_like(q_idx, 0.5))  # 2 x the ones / the 4 counted tokens
        ref = weakref.ref(job)
        del job, loss
        assert ref() is None
    finally:
        gc.enable()


def test_defer_kl_setting(monkeypatch):
    """GLM5_TRITON_DEFER_KL, read when asked: 1 deferred, 0 forward-time, auto / unset deferred in a one-process run
    only; the constructor's value wins; a bad value is one line naming the variable and its values
    (docs/bad_input.md)."""
    import torch.distributed as dist

    from megatron_glm5.errors import UserError
    from megatron_glm5.ops.triton_backend import TritonBackend

    b, fixed = TritonBackend(), TritonBackend(defer_kl=False)
    monkeypatch.delenv("GLM5_TRITON_DEFER_KL", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # no process group (another test may have one)
    assert b.defer_kl is True and fixed.defer_kl is False  # one process: deferred
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert b.defer_kl is False  # several processes: the forward-time KL
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "auto")
    assert b.defer_kl is False
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert b.defer_kl is True
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "1")
    assert b.defer_kl is True and TritonBackend(defer_kl=True).defer_kl is True
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "0")
    assert b.defer_kl is False
    assert b.deferred_indexer_kl(None, None, None, 1.0, None, 16, torch.zeros(1, 1)) is None  # off: forward-time
    monkeypatch.setenv("GLM5_TRITON_DEFER_KL", "maybe")
    with pytest.raises(UserError, match=r"^GLM5_TRITON_DEFER_KL='maybe': must be auto, 0 or 1 \(1: the indexer KL "
                                        r"loss computed in the backward .*; 0: in the forward; auto: 1 in a "
                                        r"one-process run, else 0\)$"):
        b.defer_kl
    assert fixed.defer_kl is False

# ----------------------------------------------------------------------------------------------------------------------
# GPU: GLM-5 shapes (h 64, d 576 = 512 + 64, top-k 2048, indexer 32 x 128), bf16
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and triton")
def test_gpu_deferred_kl_real_shapes():
    from megatron_glm5.ops import triton_kl, triton_sparse_mla as tsm
    from megatron_glm5.ops.triton_backend import TritonBackend
    from test_ops_triton import DI, DQK, DV, HI, S_GPU, TOPK, gpu_causal_indices, gpu_layouts, rel_l2

    gen = torch.Generator(device="cuda").manual_seed(4)
    ks, qe = gpu_layouts()["causal"]
    idx = gpu_causal_indices(ks, qe, TOPK, gen)
    q = torch.randn(S_GPU, 64, DQK, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S_GPU, DQK, device="cuda", generator=gen).bfloat16()
    d_out = torch.randn(S_GPU, 64, DV, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(S_GPU, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(S_GPU, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(S_GPU, HI, device="cuda", generator=gen) * HI ** -0.5
    scale = DQK ** -0.5
    out, lse = tsm.sparse_mla_fwd(q, kv, idx, scale, DV)
    want = triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=lse)
    for cfg in (None, tsm.BWD_FALLBACKS[0], dict(DK="slots")):  # default, 4 head groups, the long-sequence dk
        hs = torch.full(idx.shape, float("nan"), device="cuda")
        got = tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=True, config=cfg,
                                 head_sums=hs)
        plain = tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, deterministic=True, config=cfg)
        assert not hs.isnan().any() and rel_l2(hs, want) <= 1e-4, (cfg, rel_l2(hs, want))
        assert rel_l2(got[0], plain[0]) <= 1e-6 and rel_l2(got[1], plain[1]) <= 1e-6, cfg
    # a layer's loss through the backend: the forward-time KL and the deferred one, same value and gradients
    res = {}
    for defer in (False, True):
        b = TritonBackend(deterministic=True, defer_kl=defer)
        a = [x.clone().requires_grad_() for x in (q, kv, qi, ki, w)]
        seen = []
        job = b.deferred_indexer_kl(a[2], a[3], a[4], DI ** -0.5, a[0], DV, idx, on_value=seen.append)
        assert (job is not None) == defer
        o, o_lse = b.sparse_mla(a[0], a[1], idx, scale, DV, **({"kl_job": job} if job else {}))
        if job is None:
            kl_sum, n = b.indexer_kl_loss(a[2], a[3], a[4], DI ** -0.5, a[0].detach(), a[1].detach(), scale, None,
                                          None, indices=idx, attn_lse=o_lse.detach())
            aux = kl_sum / n.clamp_min(1)
            seen.append(aux.detach())
        else:
            aux = job.token
        ((o.float() * d_out.float()).sum() + 0.5 * aux).backward()
        res[defer] = (seen[0], [x.grad for x in a])
    (kl_old, g_old), (kl_new, g_new) = res[False], res[True]
    assert float(kl_old) > 0 and abs(float(kl_new - kl_old)) <= 1e-4 * float(kl_old)
    for name, x, y in zip(("dq", "dkv", "d_q_idx", "d_k_idx", "d_w"), g_new, g_old):
        assert not x.isnan().any() and rel_l2(x, y) <= 1e-3, (name, rel_l2(x, y))
