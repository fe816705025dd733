"""The cross entropy of --fusions auto (model/fused_cross_entropy.py) against the textbook loss (fp64: eager, and
traced whole by torch.compile with AOT autograd, ``aot_eager``), against megatron-core's
``vocab_parallel_cross_entropy`` on the same bf16 logits (labels outside the vocabulary included: both give
log(sum exp(x - max))), over two tensor-parallel vocabulary shards, and its wiring in the model. On a GPU: the
compiled regions at GLM-5's vocabulary against megatron-core's path, and the memory they keep."""
from __future__ import annotations

import pytest
import torch

from megatron_glm5.model import fused_cross_entropy as fce
from megatron_glm5.model import fusions
from thread_group import ThreadGroup


def _megatron_state():
    """megatron-core's cross entropy reads the tensor-parallel group: a one-process model-parallel state."""
    from megatron.core import parallel_state

    from megatron_glm5 import platform
    if not parallel_state.model_parallel_is_initialized():
        platform.initialize_model_parallel()


def _textbook(logits, labels, up):
    x = logits.detach().clone().requires_grad_()
    loss = -torch.log_softmax(x, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (loss * up).sum().backward()
    return loss.detach(), x.grad


def _ours(logits, labels, up, fuse=False, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fce.vocab_parallel_cross_entropy(x, labels, fuse=fuse, **kw)
    (loss * up).sum().backward()
    return loss.detach(), x.grad


def _inputs(shape=(7, 3), vocab=41, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    up = torch.randn(shape, generator=g, dtype=torch.float64)  # a per-token incoming gradient, not a constant
    return logits, labels, up


@pytest.mark.parametrize("traced", [False, True])
def test_matches_textbook_loss_and_grad(traced, monkeypatch):
    logits, labels, up = _inputs()
    if traced:  # each region through torch.compile's whole-graph capture, without CPU code generation
        for r in (fce._row_max, fce._row_sums, fce._logits_grad):
            monkeypatch.setattr(r, "_compiled", torch.compile(r.eager, fullgraph=True, backend="aot_eager"))
    ref_loss, ref_grad = _textbook(logits, labels, up)
    loss, grad = _ours(logits, labels, up, fuse=traced)
    assert loss.shape == labels.shape and loss.dtype == torch.float32 and grad.dtype == logits.dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)  # fp32 inside
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)


def test_matches_megatron_core_on_bf16_logits_with_out_of_range_labels():
    from megatron.core import tensor_parallel

    _megatron_state()
    logits, labels, up = _inputs(shape=(64,), vocab=1000, dtype=torch.bfloat16, seed=4)
    labels[3], labels[10], labels[11] = -100, 1000, 5000  # no shard holds them: megatron-core's loss is log(sum)
    up = up.float()
    x = logits.clone().requires_grad_()
    ref = tensor_parallel.vocab_parallel_cross_entropy(x, labels)
    (ref * up).sum().backward()
    loss, grad = _ours(logits, labels, up)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-5)
    x32 = logits.float()
    expected_oob = torch.log(torch.exp(x32 - x32.amax(-1, keepdim=True)).sum(-1))
    torch.testing.assert_close(loss[[3, 10, 11]], expected_oob[[3, 10, 11]], rtol=1e-6, atol=1e-6)
    assert grad.dtype == torch.bfloat16
    # both round an fp32 gradient once to bf16; softmax as exp / sum in both: at most one bf16 step apart
    diff = (grad.float() - x.grad.float()).abs()
    step = x.grad.float().abs() * 2 ** -7 + 1e-30
    assert bool((diff <= step).all()), float((diff / step).max())
    assert float((diff > 0).float().mean()) < 0.01
    # out-of-range rows: softmax only, no one-hot subtracted
    p = torch.softmax(x32[3], -1) * up[3]
    torch.testing.assert_close(grad[3].float(), p, rtol=1e-2, atol=1e-6)


def test_tp2_vocab_parallel(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    world = 2
    comm = ThreadGroup(world)
    monkeypatch.setattr(fce.linear_cross_entropy, "tp_shard", lambda group: (group, comm.local.rank, world))
    monkeypatch.setattr(torch.distributed, "all_reduce", comm.all_reduce)
    logits, labels, up = _inputs(vocab=38, seed=2)
    shard = logits.shape[-1] // world

    def rank_run(rank):
        comm.local.rank = rank
        return _ours(logits[..., rank * shard:(rank + 1) * shard], labels, up, tp_group="tp")

    with ThreadPoolExecutor(world) as pool:
        parts = list(pool.map(rank_run, range(world)))
    ref_loss, ref_grad = _textbook(logits, labels, up)
    for loss, _ in parts:  # every rank has the full loss
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([g for _, g in parts], -1), ref_grad, rtol=1e-6, atol=1e-7)
    assert all(g.abs().sum() > 0 for _, g in parts)


def test_shape_mismatch_is_one_line():
    with pytest.raises(ValueError, match=r"cross entropy: logits \(4, 9\) do not match target \(5,\)"):
        fce.vocab_parallel_cross_entropy(torch.zeros(4, 9), torch.zeros(5, dtype=torch.long))


def test_model_takes_it_only_with_fusions_on(monkeypatch):
    """GLM5Model.compute_language_model_loss: our regions when fusions.on (forced here; a CPU tensor otherwise
    never is), megatron-core's path without; same loss either way."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.fusion_flags import config_overrides
    from megatron_glm5.model import swiglu as swiglu_module
    from megatron_glm5.model.model import build_model

    cfg = GLM5Config.from_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    calls = []
    real = fce.vocab_parallel_cross_entropy
    monkeypatch.setattr(fce, "vocab_parallel_cross_entropy",
                        lambda *a, **k: calls.append(1) or real(*a, **dict(k, fuse=False)))
    model = build_model(cfg, mtp=False, **config_overrides("auto", cuda=True)).eval()
    with torch.no_grad():
        unfused = model(ids[:, :-1], labels=ids[:, 1:])
        assert not calls  # fusions.on is false for CPU tensors
        monkeypatch.setattr(fusions, "on", lambda config, x: True)
        monkeypatch.setattr(fusions.Region, "__call__", lambda self, *a, fuse=False: self.eager(*a))  # no CPU codegen
        monkeypatch.setattr(swiglu_module, "_fused", lambda y, w: swiglu_module.swiglu(y, w))  # nor Triton on CPU
        fused = model(ids[:, :-1], labels=ids[:, 1:])
    assert calls and fused.shape == unfused.shape == (2, 8)
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_matches_megatron_core_at_glm5_vocab():
    from megatron.core import tensor_parallel

    _megatron_state()
    dev, n, v = torch.device("cuda"), 2048, 154880
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(n, 1, v, generator=g, device=dev).mul_(4).to(torch.bfloat16)
    labels = torch.randint(0, v, (n, 1), generator=g, device=dev)
    labels[5, 0] = -100
    up = torch.rand(n, 1, generator=g, device=dev)
    res = {}
    for name in ("megatron", "ours"):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = (tensor_parallel.vocab_parallel_cross_entropy(x, labels) if name == "megatron"
                else fce.vocab_parallel_cross_entropy(x, labels, fuse=True))
        kept = torch.cuda.memory_allocated() - base  # what the forward keeps for the backward (+ the loss)
        (loss * up).sum().backward()
        res[name] = (loss.detach(), x.grad, kept)
    (rl, rg, rkept), (ol, og, okept) = res["megatron"], res["ours"]
    assert torch.isfinite(ol).all() and torch.isfinite(og.float()).all()
    torch.testing.assert_close(ol, rl, rtol=1e-5, atol=1e-4)
    assert float((og.float() - rg.float()).norm() / rg.float().norm()) < 1e-2
    assert okept < 0.6 * rkept, (okept, rkept)  # the bf16 logits, not an fp32 softmax
