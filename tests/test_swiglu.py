"""The Triton SwiGLU (megatron_glm5/ops/triton_swiglu.py): forward, the gradient of [gate | up] and of the per-row
weights against a float64 reference written here, on CPU through Triton's interpreter (every row's program looping
over column blocks, strided rows, bf16 and fp32), and on a GPU (@pytest.mark.gpu) at GLM-5's widths against the
same reference and megatron-core's fused SwiGLU."""
import importlib.util

import pytest
import torch

from interp_harness import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def reference(y, w, g):
    """(out, dy, dw) in float64 by autograd on silu(a) * b * w."""
    y = y.double().requires_grad_()
    w = None if w is None else w.double().requires_grad_()
    a, b = y.chunk(2, -1)
    out = torch.nn.functional.silu(a) * b
    if w is not None:
        out = out * w.reshape(out.shape[:-1] + (1,))
    out.backward(g.double())
    return out.detach(), y.grad, None if w is None else w.grad


def _case(rows, f, dtype, weighted, block, seed, strided=False, w_shape=None):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * f + (6 if strided else 0)
    y = (torch.randn(rows, width, generator=gen) * 2).to(dtype)
    w = torch.rand(w_shape or (rows,), generator=gen) + 0.1 if weighted else None
    g = torch.randn(rows, f, generator=gen).to(dtype)
    return dict(y=y, w=w, g=g, block=block, cols=2 * f, strided=strided)


CASES = {
    "bf16, 3 column blocks": _case(5, 40, torch.bfloat16, False, 16, 1),
    "fp32, weighted, 2 blocks": _case(7, 32, torch.float32, True, 16, 2),
    "fp32, weighted [rows, 1], strided rows": _case(4, 24, torch.float32, True, 16, 3, strided=True,
                                                    w_shape=(4, 1)),
    "bf16, weighted, one block": _case(3, 12, torch.bfloat16, True, 32, 4),
}


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("needs triton")
    return run_interpreted(tmp_path_factory, "swiglu", "swiglu_interp_runner.py", CASES)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_interp_swiglu_matches_the_float64_reference(interp, name):
    c, got = CASES[name], interp[name]
    y = c["y"][:, : c["cols"]]
    out, dy, dw = reference(y, c["w"], c["g"])
    tol = 1e-2 if c["y"].dtype == torch.bfloat16 else 1e-5
    assert got["out"].dtype == c["y"].dtype and got["out"].shape == out.shape
    torch.testing.assert_close(got["out"].double(), out, rtol=tol, atol=tol)
    want_dy = torch.zeros(c["y"].shape, dtype=torch.float64)
    want_dy[:, : c["cols"]] = dy  # a strided view's gradient lands in its columns only
    torch.testing.assert_close(got["dy"].double(), want_dy, rtol=tol, atol=tol)
    if c["w"] is None:
        assert got["dw"] is None
    else:
        assert got["dw"].shape == c["w"].shape
        torch.testing.assert_close(got["dw"].double(), dw, rtol=1e-4, atol=1e-4)


@needs_triton
def test_swiglu_rejects_shapes_it_cannot_take():
    from megatron_glm5.ops.triton_swiglu import swiglu

    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="one weight per row"):
        swiglu(torch.zeros(2, 4), torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("rows,f,weighted", [(4096, 12288, False), (32768, 2048, True), (1000, 2048, False)])
def test_gpu_swiglu_glm5_widths(rows, f, weighted):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl

    from megatron_glm5.ops.triton_swiglu import swiglu

    gen = torch.Generator(device="cuda").manual_seed(rows)
    y = torch.randn(rows, 2 * f, device="cuda", generator=gen).bfloat16()
    w = torch.rand(rows, device="cuda", generator=gen) + 0.1 if weighted else None
    g = torch.randn(rows, f, device="cuda", generator=gen).bfloat16()
    out, dy, dw = reference(y, w, g)
    yl = y.clone().requires_grad_()
    wl = None if w is None else w.clone().requires_grad_()
    got = swiglu(yl, wl)
    got.backward(g)
    for name, a, b in (("out", got, out), ("dy", yl.grad, dy)) + ((("dw", wl.grad, dw),) if weighted else ()):
        rel = float((a.double() - b).norm() / b.norm())
        assert rel <= 1e-2, (name, rel)
    # megatron-core's fused SwiGLU on the same inputs: the same values within bf16 rounding
    ym = y.clone().requires_grad_()
    wm = None if w is None else w.clone().requires_grad_()
    mc = bias_swiglu_impl(ym, None) if w is None else weighted_bias_swiglu_impl(ym, None, wm.unsqueeze(-1))
    mc.backward(g)
    assert float((got.double() - mc.double()).norm() / mc.double().norm()) <= 1e-2
    assert float((yl.grad.double() - ym.grad.double()).norm() / ym.grad.double().norm()) <= 1e-2
