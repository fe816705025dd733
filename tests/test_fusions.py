"""--fusions (model/fusions.py, model/fusion_flags.py): every fused region against a reference written out here
(fp32 on CPU, forward and gradients), both as the eager function the CPU path runs and traced whole by
torch.compile (fullgraph, AOT autograd, no code generation: ``aot_eager``), the tiny model with the fused choice
against the unfused one (the SwiGLU kernel's place counted; the kernel itself: tests/test_swiglu.py), and the
flag. On a GPU: the compiled regions (Inductor's Triton kernels) against the eager ones."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.model import fusions
from megatron_glm5.model.fusion_flags import FusionsError, config_overrides
from megatron_glm5.model.absorbed_mla import absorbed_query, rope_rotate_into, rope_unrotate_into
from megatron_glm5.model.mla import latent_key
from megatron_glm5.model.moe import glm5_topk_routing
from megatron_glm5.model.norm import rms_norm
from megatron_glm5.model.rope import rope_prefix


def ref_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, cos, sin):
    """Pair j = (x[2j], x[2j+1]) rotated by angle j; written as [rotated evens | rotated odds]."""
    n = x.shape[-1] // 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    evens = [x[..., 2 * j] * cos[..., j] - x[..., 2 * j + 1] * sin[..., j] for j in range(n)]
    odds = [x[..., 2 * j + 1] * cos[..., j] + x[..., 2 * j] * sin[..., j] for j in range(n)]
    return torch.stack(evens + odds, dim=-1)


def ref_routing(logits, bias, topk, n_group, topk_group, scale):
    """Row by row: sigmoid scores, biased choice, groups ranked by their two best biased scores, top-k of the
    kept groups, weights = unbiased scores of the chosen experts normalised to 1, times the scale."""
    n, e = logits.shape
    probs = torch.zeros_like(logits)
    chosen = torch.zeros(n, e, dtype=torch.bool)
    for t in range(n):
        scores = torch.sigmoid(logits[t])
        choice = (scores + bias).detach()
        per = e // n_group
        group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] for g in range(n_group)]
        best_groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [i for i in range(e) if i // per in best_groups]
        top = sorted(allowed, key=lambda i: -float(choice[i]))[:topk]
        total = sum(scores[i] for i in top)
        for i in top:
            probs[t, i] = scores[i] / (total + 1e-20) * scale
            chosen[t, i] = True
    return probs, chosen


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _check(region, make_args, reference, n_grads, tol=2e-6):
    """region (eager, and compiled whole with aot_eager) == reference in fp32 (the regions compute in fp32): outputs and the gradients of the
    first n_grads arguments for a random upstream gradient."""
    g = torch.Generator().manual_seed(0)
    base = make_args(g)
    upstream = None
    results = []
    for fn in (reference, region.eager, torch.compile(region.eager, fullgraph=True, backend="aot_eager")):
        args = _leaves(*base[:n_grads]) + list(base[n_grads:])
        out = fn(*args)
        if upstream is None:
            upstream = torch.randn(out.shape, generator=g, dtype=out.dtype)
        (out * upstream).sum().backward()
        results.append((out.detach(), [a.grad for a in args[:n_grads]]))
    (ref_out, ref_grads), *fused = results
    for out, grads in fused:
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert all(gr.abs().sum() > 0 for gr in ref_grads)


def _angles(g, s, half):
    a = torch.rand(s, 1, half, generator=g, dtype=torch.float32) * 6.0
    return a.cos(), a.sin()


def test_rms_norm_region():
    _check(rms_norm, lambda g: (torch.randn(5, 2, 12, generator=g, dtype=torch.float32),
                                torch.randn(12, generator=g, dtype=torch.float32), 1e-6),
           ref_rms, n_grads=2)


def test_latent_key_region():
    lat, rope = 16, 8

    def make(g):
        return (torch.randn(5, 1, lat + rope, generator=g, dtype=torch.float32),
                torch.randn(lat, generator=g, dtype=torch.float32), 1e-6, *_angles(g, 5, rope // 2), lat)

    def ref(kv_c, w, eps, cos, sin, lat_):
        return torch.cat([ref_rms(kv_c[..., :lat_], w, eps), ref_rope(kv_c[..., lat_:], cos, sin)], dim=-1)
    _check(latent_key, make, ref, n_grads=2)


def test_rope_into_regions_store_into_strided_columns():
    """rope_rotate_into / rope_unrotate_into (model/absorbed_mla.py: the absorbed query's rope columns and their
    gradient), eager and compiled whole (aot_eager): the rotation of ref_rope, and its transpose (the gradient of
    ref_rope for a random upstream gradient), written into a strided view and nowhere else."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 1, 3, 24, generator=g, dtype=torch.float32)
    x = q[..., 16:].clone().requires_grad_()  # rotated from a strided view below
    cos, sin = _angles(g, 5, 4)
    dy = torch.randn(5, 1, 3, 8, generator=g, dtype=torch.float32)
    (want_dx,) = torch.autograd.grad((ref_rope(x, cos, sin) * dy).sum(), x)
    for region, src, want in ((rope_rotate_into, q[..., 16:], ref_rope(x.detach(), cos, sin)),
                              (rope_unrotate_into, dy, want_dx)):
        for fn in (region.eager, torch.compile(region.eager, fullgraph=True, backend="aot_eager")):
            buf = torch.full((5, 1, 3, 24), float("nan"))
            fn(buf[..., 16:], src, cos, sin)
            torch.testing.assert_close(buf[..., 16:], want, rtol=2e-6, atol=2e-6)
            assert buf[..., :16].isnan().all()  # the other columns untouched


def test_rope_prefix_region():
    def make(g):
        return torch.randn(5, 1, 3, 16, generator=g, dtype=torch.float32), *_angles(g, 5, 3), 6

    _check(rope_prefix, make, lambda x, c, s, r: torch.cat([ref_rope(x[..., :r], c, s), x[..., r:]], dim=-1),
           n_grads=1)


def test_router_region():
    def make(g):
        return torch.randn(7, 16, generator=g, dtype=torch.float32), torch.randn(16, generator=g, dtype=torch.float32) * 0.1

    args = make(torch.Generator().manual_seed(4))
    ref_probs, ref_map = ref_routing(*args, topk=4, n_group=4, topk_group=2, scale=2.5)
    for fn in (glm5_topk_routing.eager, torch.compile(glm5_topk_routing.eager, fullgraph=True, backend="aot_eager")):
        probs, routing_map = fn(*args, 4, 4, 2, True, 2.5)
        assert torch.equal(routing_map, ref_map)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    # gradients: through the chosen scores only (the choice itself is not differentiable)
    _check(fusions.Region(lambda *a: glm5_topk_routing.eager(*a)[0]), lambda g: make(g) + (4, 4, 2, True, 2.5),
           lambda lg, b, *rest: ref_routing(lg, b, 4, 4, 2, 2.5)[0], n_grads=1)


def test_tiny_model_fused_equals_unfused(monkeypatch):
    """The tiny model (dense + MoE layers, DSA) with --fusions auto's config against none: same loss and
    gradients. On CPU the regions run eagerly (fusions.on is forced here, megatron-core's jit runs force_eager),
    so what is checked is the wiring: megatron-core's SwiGLU paths, the cross entropy's regions and each region's
    arguments."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.model import build_model

    cfg = GLM5Config.from_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(2))
    calls = []
    real_call = fusions.Region.__call__

    def counting_call(self, *args, fuse=False):
        calls.append((self.__name__, fuse))
        return real_call(self, *args, fuse=False)

    monkeypatch.setattr(fusions, "on", lambda config, x: bool(getattr(config, "elementwise_fusion", False)))
    monkeypatch.setattr(fusions.Region, "__call__", counting_call)
    from megatron_glm5.model import swiglu as swiglu_module

    def counted_swiglu(y, weights):  # the Triton kernel's place (tests/test_swiglu.py tests the kernel itself)
        calls.append(("swiglu" if weights is None else "swiglu weighted", True))
        return swiglu_module.swiglu(y, weights, fuse=False)
    monkeypatch.setattr(swiglu_module, "_fused", counted_swiglu)
    results, weights = {}, None
    with torch.compiler.set_stance("force_eager"):
        for fused in (False, True):
            calls.clear()
            model = build_model(cfg, mtp=False, **config_overrides("auto", cuda=fused)).train()
            if weights is None:
                weights = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
            else:
                model.load_state_dict(weights, strict=False)
            loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
            loss.backward()
            results[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}, sorted(set(calls)))
    (ref_loss, ref_grads, eager_calls), (loss, grads, fused_calls) = results[False], results[True]
    names = {"rms_norm", "latent_key", "rope_rotate_into", "rope_unrotate_into", "rope_prefix", "glm5_topk_routing"}
    assert {n for n, f in eager_calls} == names and not any(f for n, f in eager_calls)
    cross_entropy = {"_row_max", "_row_sums", "_logits_grad"}  # model/fused_cross_entropy.py: fused only
    swiglu = {"swiglu", "swiglu weighted"}  # the dense MLPs / shared experts, the routed experts
    assert {n for n, f in fused_calls if f} == names | cross_entropy | swiglu
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()) + 1e-12, msg=name)


def test_flag_and_overrides():
    from megatron_glm5.arguments import ArgumentError, build_parser
    from megatron_glm5.config import GLM5Config

    assert config_overrides("auto", cuda=True) == {"use_te_activation_func": True, "elementwise_fusion": True}
    assert config_overrides("auto", cuda=False) == {} == config_overrides("none", cuda=True)  # the defaults: off
    with pytest.raises(FusionsError, match="--fusions must be one of auto, none"):
        config_overrides("max")
    p = build_parser("finetune")
    assert p.parse_args([]).fusions == "auto" and p.parse_args(["--fusions", "none"]).fusions == "none"
    with pytest.raises(ArgumentError, match="argument --fusions: invalid choice: 'on'"):
        p.parse_args(["--fusions", "on"])
    tc = GLM5Config.from_preset("tiny").to_transformer_config(**config_overrides("auto", cuda=True))
    assert tc.use_te_activation_func and tc.elementwise_fusion and not tc.bias_activation_fusion
    tc = GLM5Config.from_preset("tiny").to_transformer_config()
    assert not tc.use_te_activation_func and not tc.elementwise_fusion and not tc.bias_activation_fusion

    class Cfg:
        elementwise_fusion = True
    assert not fusions.on(Cfg(), torch.zeros(1))  # the CPU path stays eager whatever the flag says
    assert math.isclose(float(rms_norm(torch.ones(1, 4), torch.full((4,), 2.0), 0.0)[0, 0]), 2.0)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: the compiled regions (Inductor's Triton kernels) at GLM-5 widths against the eager path
# ----------------------------------------------------------------------------------------------------------------------

def _rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compiled_regions_match_eager(dtype):
    dev, s = torch.device("cuda"), 1024
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, dt=dtype: torch.randn(*shape, generator=g, device=dev, dtype=dt)
    ang = torch.rand(s, 1, 32, generator=g, device=dev) * 100.0
    cos, sin = ang.cos(), ang.sin()
    q = rnd(s, 1, 64, 256)
    # router logits 0.02 apart within a row: no near-ties that one ulp of sigmoid could reorder
    logits = torch.argsort(torch.rand(s, 256, generator=g, device=dev), dim=-1).float() * 0.02 - 2.56
    cases = {
        "rms_norm": (rms_norm, (rnd(s, 1, 6144), 1.0 + 0.1 * rnd(6144), 1e-5), 2),
        "latent_key": (latent_key, (rnd(s, 1, 576), 1.0 + 0.1 * rnd(512), 1e-6, cos, sin, 512), 2),
        "absorbed_query": (absorbed_query, (q, 0.05 * rnd(64, 192, 512), cos, sin), 2),
        "rope_prefix": (rope_prefix, (rnd(s, 1, 32, 128), cos, sin, 64), 1),
        "router": (fusions.Region(lambda *a: glm5_topk_routing.eager(*a)[0]),
                   (logits, torch.zeros(256, device=dev), 8, 1, 1, True, 2.5), 1),
    }
    # bf16: the compiled kernels keep intermediates in fp32 registers where eager rounds some of them
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    for name, (fn, args, n_grads) in cases.items():
        outs = []
        for fuse in (False, True):
            leaves = [a.detach().clone().requires_grad_() for a in args[:n_grads]] + list(args[n_grads:])
            out = fn(*leaves, fuse=fuse)
            up = torch.randn(out.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev,
                             dtype=out.dtype)
            (out.float() * up.float()).sum().backward()
            outs.append([out.detach()] + [a.grad for a in leaves[:n_grads]])
        for i, (eager, fused) in enumerate(zip(*outs)):
            assert torch.isfinite(fused).all(), (name, i)
            assert _rel_l2(fused, eager) <= tol, (name, i, _rel_l2(fused, eager))
