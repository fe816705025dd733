"""Tests of the block-scaled FP8 GEMM and quantisation kernels (megatron_glm5/ops/triton_fp8_gemm.py).

CPU part: the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in one subprocess
(tests/triton_fp8_interp_runner.py, which also corrects the interpreter's fp8 conversions and bf16 dot) at small
shapes with partial 128-blocks in every dimension, both designs, both tile configurations, zero-token experts and
rows past the last expert; this process builds the inputs and compares with the references written below.
GPU part (@pytest.mark.gpu): GLM-5 shapes on the GPU against an fp64 reference, and quantisation bitwise.
"""

import importlib.util

import pytest
import torch

from interp_harness import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
F64 = torch.float64
E4M3 = torch.float8_e4m3fn
LARGE = dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=2)  # the many-rows configuration, forced
SMALL = dict(BM=32, BO=128, BR=128, num_warps=4, num_stages=2)
WS = dict(SMALL, WS=1)  # design A: the weight tile scaled in registers
TQ = dict(SMALL, TQ=1)  # input gradient through the transposed codes


# ----------------------------------------------------------------------------------------------------------------------
# references (written here, not taken from the module under test)
# ----------------------------------------------------------------------------------------------------------------------


def dequant(q, s):
    """q [..., N, K] e4m3 times its 128x128 block scale, in fp64."""
    n, k = q.shape[-2:]
    full = s.to(F64).repeat_interleave(128, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)[..., :k]
    return q.to(F64) * full


def dequant_rounded(dtype):
    """The weight as design A's WS option forms it: the fp32 product q * s rounded to ``dtype`` (nearest even)."""
    def weight(q, s):
        n, k = q.shape[-2:]
        full = s.repeat_interleave(128, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)[..., :k]
        return (q.float() * full).to(dtype).to(F64)
    return weight


def quant_rows_ref(x):
    """One scale per row and 128 columns: s = amax / 448 (1 where the group is 0), q = clamp(x / s) in e4m3."""
    m, k = x.shape
    kb = -(-k // 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).view(m, kb, 128)
    amax = xp.abs().amax(-1)
    # a tensor divisor: torch on CUDA divides by a Python number as a multiplication by its fp32 reciprocal
    s = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    q = (xp / s[..., None]).clamp(-448.0, 448.0).to(E4M3).view(m, kb * 128)[:, :k]
    return q, s


def rows_dequant(q, s):
    return q.to(F64) * s.to(F64).repeat_interleave(128, dim=-1)[:, :q.shape[1]]


def random_weight(shape, g):
    """(q e4m3, s fp32): random codes and block scales around 0.02 (a trained weight's size)."""
    n, k = shape[-2:]
    q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(E4M3)
    s = torch.rand(*shape[:-2], -(-n // 128), -(-k // 128), generator=g) * 2e-4 + 1e-4
    return q, s


def gemm_ref(kind, a, q, s, offsets=None, weight=dequant):
    """fp64 reference; ``a`` as given (fp64 of the bf16 values, or of the e4m3 rows for design B)."""
    if offsets is None:
        w = weight(q, s)
        return a @ (w if kind == "dgrad" else w.T)
    n_out = q.shape[2] if kind == "gdgrad" else q.shape[1]
    out = torch.zeros(a.shape[0], n_out, dtype=F64, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        w = weight(q[e], s[e])
        out[start:end] = a[start:end] @ (w if kind == "gdgrad" else w.T)
        start = end
    return out


# ----------------------------------------------------------------------------------------------------------------------
# CPU: interpreter
# ----------------------------------------------------------------------------------------------------------------------

# name: (kind, rows, N, K, tokens per expert or None, forced config or None, input dtype)
GEMM_CASES = {
    "fwd_small": ("fwd", 40, 200, 300, None, None, torch.bfloat16),
    "fwd_large": ("fwd", 130, 136, 260, None, None, torch.bfloat16),
    "dgrad_small": ("dgrad", 40, 200, 300, None, None, torch.bfloat16),
    "dgrad_large": ("dgrad", 130, 136, 260, None, None, torch.bfloat16),
    "fwd_fp32": ("fwd", 9, 130, 129, None, None, torch.float32),
    "gfwd": ("gfwd", 84, 136, 200, [7, 0, 70, 0, 3], None, torch.bfloat16),
    "gdgrad": ("gdgrad", 84, 136, 200, [7, 0, 70, 0, 3], None, torch.bfloat16),
    "gfwd_large": ("gfwd", 140, 130, 136, [0, 130, 5, 0], LARGE, torch.bfloat16),
    "gdgrad_large": ("gdgrad", 140, 130, 136, [0, 130, 5, 0], LARGE, torch.bfloat16),
    "gfwd_empty": ("gfwd", 6, 130, 136, [0, 0, 0], None, torch.bfloat16),
    "fwd_ws": ("fwd", 40, 200, 300, None, WS, torch.bfloat16),
    "dgrad_tq": ("dgrad", 40, 200, 300, None, TQ, torch.bfloat16),
    "gdgrad_tq_ws": ("gdgrad", 84, 136, 200, [7, 0, 70, 0, 3], dict(TQ, WS=1), torch.bfloat16),
    # SW=0: the weight as the MMA's right operand
    "fwd_sw0": ("fwd", 130, 136, 260, None, dict(LARGE, SW=0), torch.bfloat16),
    "dgrad_sw0_tq": ("dgrad", 40, 200, 300, None, dict(TQ, SW=0), torch.bfloat16),
    "gdgrad_sw0": ("gdgrad", 84, 136, 200, [7, 0, 70, 0, 3], dict(SMALL, SW=0), torch.bfloat16),
    "gfwd_sw0_ws": ("gfwd", 140, 130, 136, [0, 130, 5, 0], dict(LARGE, SW=0, WS=1), torch.bfloat16),
}


def build_cases():
    g = torch.Generator().manual_seed(0)
    cases = {}
    for name, (kind, rows, n, k, counts, config, dtype) in GEMM_CASES.items():
        grouped = counts is not None
        q, s = random_weight((len(counts), n, k) if grouped else (n, k), g)
        width = n if "dgrad" in kind else k
        a = torch.randn(rows, width, generator=g).to(dtype)
        only_a = dtype == torch.float32 or (config or {}).get("WS")
        c = dict(kind=kind, a=a, q=q, s=s, config=config, designs=("A",) if only_a else ("A", "B"))
        if grouped:
            c["offsets"] = torch.tensor(counts).cumsum(0).to(torch.int32)
        cases[name] = c
    w2 = torch.randn(200, 300, generator=g).bfloat16()
    w2[128:, 256:] = 0  # the partial corner block is all zero: scale 1, codes 0
    w2[5, 7] = -6.0  # the largest |w| of its block, negative: code -448
    w3 = torch.randn(3, 130, 129, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    cases["quant_blocks_2d"] = dict(kind="quant_blocks", w=w2)
    cases["quant_blocks_3d"] = dict(kind="quant_blocks", w=w3)
    x = torch.randn(37, 300, generator=g).bfloat16()
    x[3, 128:256] = 0
    cases["quant_rows"] = dict(kind="quant_rows", x=x)
    return cases


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    cases = build_cases()
    return cases, run_interpreted(tmp_path_factory, "triton_fp8_interp", "triton_fp8_interp_runner.py", cases)


def effective_config(c, design):
    """The tile configuration a case ran with: its own, or the module's default for its shape."""
    from megatron_glm5.ops.triton_fp8_gemm import _config

    groups = c["q"].shape[0] if c["q"].dim() == 3 else 1
    return _config(design, c["a"].shape[0] / groups, "dgrad" if "dgrad" in c["kind"] else "fwd",
                   "grouped" if c["q"].dim() == 3 else "dense", c["config"])


def rel_l2(a, b):
    return ((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm()).item()


@needs_triton
@pytest.mark.parametrize("name", sorted(GEMM_CASES))
def test_interp_gemm_matches_fp64_reference(interp, name):
    cases, res = interp
    c = cases[name]
    kind, offsets = c["kind"], c.get("offsets")
    exact = gemm_ref(kind, c["a"].to(F64), c["q"], c["s"], offsets)
    tail = int(offsets[-1]) if offsets is not None else c["a"].shape[0]
    for design in c["designs"]:
        got = res[name][design]
        assert got.dtype == c["a"].dtype and got.shape == exact.shape, (design, got.shape)
        assert torch.isfinite(got).all(), design
        assert torch.equal(got[tail:], torch.zeros_like(got[tail:])), design  # rows past the last expert: 0
        if design == "A" and effective_config(c, design).get("WS"):  # the weight rounded to bf16 first
            want = gemm_ref(kind, c["a"].to(F64), c["q"], c["s"], offsets, weight=dequant_rounded(got.dtype))
            rtol = 1e-5 if got.dtype == torch.float32 else 2 ** -8
        elif design == "A":  # the exact dequantised weight, fp32 accumulation, one rounding to the output dtype
            want = exact
            rtol = 1e-5 if got.dtype == torch.float32 else 2 ** -8
        else:  # the rows rounded to e4m3 with their 1x128 scales, then the same
            want = gemm_ref(kind, rows_dequant(*quant_rows_ref(c["a"])), c["q"], c["s"], offsets)
            rtol = 2 ** -8
            # and still near the exact product (e4m3 keeps 3 mantissa bits)
            assert not exact.any() or rel_l2(got, exact) < 0.06
        atol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(got.to(F64), want, rtol=rtol, atol=atol, msg=f"design {design}")


@needs_triton
@pytest.mark.parametrize("name", ["quant_blocks_2d", "quant_blocks_3d"])
def test_interp_quantize_blocks_bitwise(interp, name):
    from megatron_glm5.fp8.blocks import quantize_blocks_reference

    cases, res = interp
    w = cases[name]["w"]
    q, s = res[name]
    q_ref, s_ref = quantize_blocks_reference(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == s_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    # and what the format means, independently: each block's largest |w| is code +-448, w ~ q * s to e4m3 rounding
    err = (dequant(q, s) - w.to(F64)).abs()
    assert (err <= 2 ** -4 * w.to(F64).abs() + 2 ** -9 * s.to(F64).amax() + 1e-30).all()
    if name == "quant_blocks_2d":
        assert q.float()[5, 7] == -448 and s[0, 0] == torch.tensor(6.0) / 448
        assert s[1, 2] == 1 and not q.float()[128:, 256:].any()


@needs_triton
def test_interp_quantize_rows_bitwise(interp):
    cases, res = interp
    q, s = res["quant_rows"]
    q_ref, s_ref = quant_rows_ref(cases["quant_rows"]["x"])
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert s[3, 1] == 1


def test_bad_shapes_are_refused():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    from megatron_glm5.ops import triton_fp8_gemm as k

    q, s = random_weight((130, 256), torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="does not fit the weight"):
        k.fp8_gemm(torch.zeros(2, 100, dtype=torch.bfloat16), q, s)
    with pytest.raises(ValueError, match="expected \\[2, 2\\] float32"):
        k.fp8_gemm(torch.zeros(2, 256, dtype=torch.bfloat16), q, s[:1])
    with pytest.raises(ValueError, match="design must be one of"):
        k.fp8_gemm(torch.zeros(2, 256, dtype=torch.bfloat16), q, s, design="C")


# ----------------------------------------------------------------------------------------------------------------------
# GPU: GLM-5 shapes (hidden 6144, kv_a's 576 rows = 4.5 blocks, routed expert w1 [2*2048, 6144])
# ----------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")


@gpu
@needs_cuda
@pytest.mark.parametrize("design", ["A", "B"])
def test_gpu_gemms_at_glm5_shapes(design):
    from megatron_glm5.ops import triton_fp8_gemm as k

    g = torch.Generator().manual_seed(2)
    dev = "cuda"
    q, s = (t.to(dev) for t in random_weight((576, 6144), g))
    w = dequant(q, s)
    x = torch.randn(4096, 6144, generator=g).bfloat16().to(dev)
    dy = torch.randn(4096, 576, generator=g).bfloat16().to(dev)
    bound = 5e-3 if design == "A" else 6e-2
    assert rel_l2(k.fp8_gemm(x, q, s, design=design), x.to(F64) @ w.T) < bound
    assert rel_l2(k.fp8_gemm_dgrad(dy, q, s, design=design), dy.to(F64) @ w) < bound
    counts = [0, 700, 3, 0, 1300, 8, 0, 50]  # zero-token experts, and 100 rows past the last one
    qe, se = (t.to(dev) for t in random_weight((8, 4096, 2048), g))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
    xe = torch.randn(sum(counts) + 100, 2048, generator=g).bfloat16().to(dev)
    dye = torch.randn(sum(counts) + 100, 4096, generator=g).bfloat16().to(dev)
    y = k.fp8_grouped_gemm(xe, qe, se, offsets, design=design)
    dx = k.fp8_grouped_gemm_dgrad(dye, qe, se, offsets, design=design)
    assert not y[-100:].any() and not dx[-100:].any()
    assert rel_l2(y, gemm_ref("gfwd", xe.to(F64), qe, se, offsets)) < bound
    assert rel_l2(dx, gemm_ref("gdgrad", dye.to(F64), qe, se, offsets)) < bound


@gpu
@needs_cuda
def test_gpu_quantize_blocks_bitwise():
    from megatron_glm5.fp8.blocks import quantize_blocks_reference
    from megatron_glm5.ops import triton_fp8_gemm as k

    g = torch.Generator().manual_seed(3)
    # the reference on the CPU: on CUDA its ``amax / 448`` is computed as amax * fp32(1/448), which differs from
    # the division (the kernel's and the CPU's) in the last bit of about half the scales
    for w in (torch.randn(576, 6144, generator=g).bfloat16(), torch.randn(4, 1000, 2050, generator=g) * 0.02):
        q, s = k.fp8_quantize_blocks(w.cuda())
        q_ref, s_ref = quantize_blocks_reference(w)
        assert torch.equal(s.cpu(), s_ref)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    x = torch.randn(4096, 6144 + 64, generator=g).bfloat16()
    q, s = k.quantize_rows(x.cuda())
    q_ref, s_ref = quant_rows_ref(x)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
