"""model/absorbed_mla.py against the einsum / cat formulation it replaces, values and gradients in fp64 (one and
several batch rows), and the RoPE gradient against autograd's."""
import pytest
import torch

from megatron_glm5.model.absorbed_mla import absorbed_query, expanded_output
from megatron_glm5.model.rope import apply_interleaved_rope, interleaved_rope_grad, rope_angles

F64 = torch.float64


def _angles(s, b, rope, g):
    pos = torch.randint(0, 5000, (b, s), generator=g)
    cos, sin = rope_angles(pos, rope, 1e6)
    return cos.to(F64), sin.to(F64)


@pytest.mark.parametrize("s,b,h", [(7, 1, 3), (5, 3, 2)])
def test_absorbed_query_equals_einsum_and_cat(s, b, h):
    g = torch.Generator().manual_seed(s * 10 + b)
    nope, rope, lat = 6, 4, 5
    q = torch.randn(s, b, h, nope + rope, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(h, nope, lat, generator=g, dtype=F64, requires_grad=True)
    cos, sin = _angles(s, b, rope, g)
    got = absorbed_query(q, w, cos, sin)
    assert got.shape == (b * s, h, lat + rope) and got.is_contiguous()
    ref = torch.cat([torch.einsum("sbhn,hnc->sbhc", q[..., :nope], w), apply_interleaved_rope(q[..., nope:], cos, sin)],
                    dim=-1).transpose(0, 1).reshape(b * s, h, lat + rope)  # token order: t = batch * s + position
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    d = torch.randn(b * s, h, lat + rope, generator=g, dtype=F64)
    want = torch.autograd.grad((ref * d).sum(), (q, w))
    have = torch.autograd.grad((got * d).sum(), (q, w))
    torch.testing.assert_close(have[0][..., :nope], want[0][..., :nope], rtol=0, atol=1e-12)
    torch.testing.assert_close(have[0][..., nope:], want[0][..., nope:], rtol=0, atol=1e-5)  # RoPE: fp32 math
    torch.testing.assert_close(have[1], want[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("s,b,h", [(7, 1, 3), (5, 3, 2)])
def test_expanded_output_equals_einsum_and_copy(s, b, h):
    g = torch.Generator().manual_seed(s * 10 + b + 1)
    lat, v = 5, 4
    o = torch.randn(b * s, h, lat, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(h, v, lat, generator=g, dtype=F64, requires_grad=True)
    got = expanded_output(o, w, s, b)
    ref = torch.einsum("thc,hvc->thv", o, w).reshape(b, s, h * v).transpose(0, 1)
    assert got.shape == (s, b, h * v)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    d = torch.randn(s, b, h * v, generator=g, dtype=F64)
    want = torch.autograd.grad((ref * d).sum(), (o, w))
    have = torch.autograd.grad((got * d).sum(), (o, w))
    for a, r, name in zip(have, want, ("d_out_lat", "dw_uv")):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12, msg=name)
    assert have[0].is_contiguous()  # the sparse backward's dO: no copy needed


def test_interleaved_rope_grad_is_the_gradient_of_the_rotation():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 3, 8, generator=g, dtype=F64, requires_grad=True)
    cos, sin = _angles(6, 2, 8, g)
    dy = torch.randn(6, 2, 3, 8, generator=g, dtype=F64)
    (want,) = torch.autograd.grad((apply_interleaved_rope(x, cos, sin) * dy).sum(), x)
    torch.testing.assert_close(interleaved_rope_grad(dy, cos, sin), want, rtol=0, atol=1e-5)  # both in fp32
    assert not torch.allclose(interleaved_rope_grad(dy, cos, sin), interleaved_rope_grad(dy, cos, -sin))  # the sign


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_no_copy_kernels_at_glm5_widths():
    """bf16 at GLM-5's widths (64 heads, 192 + 64 -> 512 + 64, 512 -> 256): the same values as the einsum path
    (rel. L2 <= 1e-2 against fp32), and forward + backward launch no copy / cat kernel (the layouts are cuBLAS's
    strides; the RoPE part is the only elementwise work)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    s, h = 2048, 64
    q = torch.randn(s, 1, h, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w_uk = (torch.randn(h, 192, 512, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    o = torch.randn(s, h, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w_uv = (torch.randn(h, 256, 512, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    cos, sin = (t.cuda() for t in rope_angles(torch.arange(s).unsqueeze(0), 64, 1e6))
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    qa = absorbed_query(q, w_uk, cos, sin)
    ref = torch.cat([torch.einsum("sbhn,hnc->sbhc", q.float()[..., :192], w_uk.float()),
                     apply_interleaved_rope(q.float()[..., 192:], cos, sin)], -1).transpose(0, 1).reshape(s, h, 576)
    assert rel(qa, ref) <= 1e-2
    oe = expanded_output(o, w_uv, s, 1)
    assert rel(oe, torch.einsum("thc,hvc->thv", o.float(), w_uv.float()).reshape(s, 1, h * 256)) <= 1e-2
    d_q, d_o = torch.randn_like(qa), torch.randn_like(oe)
    step = lambda: ((absorbed_query(q, w_uk, cos, sin, fuse=True) * d_q).sum()
                    + (expanded_output(o, w_uv, s, 1) * d_o).sum()).backward()
    step()  # compiles the RoPE regions
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.key.lower() for e in prof.key_averages()]
    regions = [n for n in names if n.startswith("triton_")]  # Inductor's kernels: the two RoPE regions, one each
    assert len(regions) == 2, regions
    assert not [n for n in names if n not in regions and ("copy" in n or "cat" in n.split("(")[0])], names
