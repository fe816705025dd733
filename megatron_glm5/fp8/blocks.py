"""The block-scaled FP8 format of the GLM-5-FP8 release (DeepSeek-V3 style), in one place.

A weight ``w`` of shape ``[N, K]`` (or ``[E, N, K]`` for stacked routed experts) is stored as
``q``: ``float8_e4m3fn`` of the same shape, and ``scale_inv``: ``float32`` of shape
``[..., ceil(N / 128), ceil(K / 128)]``, with

    w[..., n, k] ~= q[..., n, k] * scale_inv[..., n // 128, k // 128]

(the release's ``weight_scale_inv``: the factor that takes the stored e4m3 value back to the weight, the same
convention as transformers' ``Fp8Dequantize`` / DeepSeek's ``weight_dequant``). A partial last block (a row or
column count that is not a multiple of 128, e.g. ``kv_a_proj_with_mqa`` [576, 6144] -> scale_inv [5, 48]) has
its own scale, computed over the rows/columns that exist: no padding is stored.

Quantisation (``quantize_blocks``), amax-based: per block ``amax = max |w|`` in fp32;
``scale_inv = amax / 448`` (448 = the largest finite e4m3 value) and ``scale_inv = 1`` for an all-zero block;
``q = clamp(w_fp32 / scale_inv, -448, 448)`` rounded to e4m3 (round-to-nearest-even, torch's cast).
A GPU kernel that quantises (``megatron_glm5.ops.triton_fp8_gemm.fp8_quantize_blocks``) must give the same bytes.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # megatron: a weight ``name``'s scales are ``name + SCALE_SUFFIX`` (HF: weight_scale_inv)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scale_shape(shape, block: int = BLOCK) -> Tuple[int, ...]:
    """The ``weight_scale_inv`` shape for a weight of ``shape`` ([..., N, K]: the last two dims are blocked, leading
    dims such as experts index separate weights)."""
    if len(shape) < 2:
        raise ValueError(f"block-scaled FP8 needs a [N, K] or [E, N, K] weight, got shape {list(shape)}")
    *lead, n, k = shape
    return (*lead, math.ceil(n / block), math.ceil(k / block))


def _padded_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """``w`` zero-padded to whole blocks and viewed as ``[..., nb, block, kb, block]``."""
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    if nb * block != n or kb * block != k:
        w = torch.nn.functional.pad(w, (0, kb * block - k, 0, nb * block - n))
    return w.reshape(*lead, nb, block, kb, block)


def _expand(scale_inv: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """``scale_inv`` repeated over its blocks and cut to ``[..., n, k]``."""
    s = scale_inv.repeat_interleave(block, dim=-2)[..., :n, :]
    return s.repeat_interleave(block, dim=-1)[..., :k]


def quantize_blocks_reference(w: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``quantize_blocks`` (any device)."""
    scale_shape(w.shape, block)
    n, k = w.shape[-2:]
    blocks = _padded_blocks(w.to(torch.float32), block)
    amax = blocks.abs().amax(dim=(-3, -1))
    # a tensor divisor: CUDA turns division by a Python scalar into a multiplication by its reciprocal, which
    # differs from true division in the last bit for about half the blocks (CPU and the Triton kernel divide)
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (w.to(torch.float32) / _expand(scale_inv, n, k, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.contiguous()


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] or [E, N, K] (any float dtype) -> ``(q float8_e4m3fn, scale_inv float32)`` as the module doc says.

    On CUDA the kernel helper's ``fp8_quantize_blocks`` is used when it exists (same bytes); otherwise the reference.
    """
    if w.is_cuda and block == BLOCK:
        kernel = _kernel("fp8_quantize_blocks")
        if kernel is not None:
            return kernel(w.contiguous())
    return quantize_blocks_reference(w, block)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      block: int = BLOCK) -> torch.Tensor:
    """``q * scale_inv`` per block, the product computed in fp32 and returned in ``dtype``."""
    expected = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {list(scale_inv.shape)} does not fit a weight of shape "
                         f"{list(q.shape)} in {block}x{block} blocks (expected {list(expected)})")
    n, k = q.shape[-2:]
    return (q.to(torch.float32) * _expand(scale_inv.to(torch.float32), n, k, block)).to(dtype)



def dequantize_region(read, weight_shape, scale_shape_, offsets, sizes, groups: int = 1,
                      dtype: torch.dtype = torch.float32, block: int = BLOCK) -> torch.Tensor:
    """``w[region]`` of a stored FP8 weight, read through ``read(which, offsets, sizes)`` (``which`` "weight" or
    "scale") without reading more than the region's own scale blocks.

    The scales sit on the last two dims, leading dims one to one. A weight whose rows are ``groups`` stacked HF
    tensors with a block grid each (a gated fc1 [gate; up]: ``scale rows = 2 * ceil(N / 2 / 128)``) says so by
    ``groups`` (the scale shape alone cannot tell: 2 x ceil(200 / 128) = ceil(400 / 128)); the region must then
    lie inside one group, as every HF tensor's does."""
    *lead, n, k = weight_shape
    if n % groups or tuple(scale_shape_[-2:]) != (groups * math.ceil(n // groups / block), math.ceil(k / block)):
        raise ValueError(f"scales of shape {list(scale_shape_)} do not fit a weight of shape {list(weight_shape)} "
                         f"as {groups} stacked grid(s) of {block}x{block} blocks")
    rows_per_group = n // groups
    *lead_off, r, c = offsets
    *lead_size, nr, nc = sizes
    g = r // rows_per_group
    if (r + nr - 1) // rows_per_group != g:
        raise ValueError(f"rows {r}:{r + nr} cross the boundary of the two stacked block grids at {rows_per_group}")
    r_in = r - g * rows_per_group
    sr0, sr1 = r_in // block, math.ceil((r_in + nr) / block)
    sc0, sc1 = c // block, math.ceil((c + nc) / block)
    g_off = g * math.ceil(rows_per_group / block)
    s = read("scale", tuple(lead_off) + (g_off + sr0, sc0), tuple(lead_size) + (sr1 - sr0, sc1 - sc0))
    s = s.to(torch.float32).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    s = s[..., r_in - sr0 * block:r_in - sr0 * block + nr, c - sc0 * block:c - sc0 * block + nc]
    q = read("weight", tuple(offsets), tuple(sizes))
    return (q.to(torch.float32) * s).to(dtype)

def _kernel(name: str):
    """A function of the optional GPU module ``megatron_glm5.ops.triton_fp8_gemm``, or None when it is absent."""
    try:
        from megatron_glm5.ops import triton_fp8_gemm
    except ModuleNotFoundError as e:
        if e.name not in ("megatron_glm5.ops.triton_fp8_gemm", "triton"):
            raise
        return None
    return getattr(triton_fp8_gemm, name, None)
