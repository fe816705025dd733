"""Matmuls through a frozen block-scaled FP8 weight (the format of ``fp8/blocks.py``), autograd-friendly.

``fp8_linear(x, q, scale_inv)`` = ``x @ W^T`` with ``W = dequantize_blocks(q, scale_inv)``; its backward returns the
input gradient ``dy @ W`` only (the weight is frozen: no weight gradient, and no bf16/fp32 copy of ``W`` is kept
between forward and backward: the saved tensors are ``q`` and ``scale_inv``).
``fp8_grouped_linear(x, q, scale_inv, tokens_per_expert)`` is the same for the routed experts: ``x`` holds the tokens
sorted by expert (as ``model/moe.py``'s ``grouped_linear`` takes them), expert ``e`` multiplies its
``tokens_per_expert[e]`` rows by ``W_e^T``.

Dispatch. On CUDA, when the optional module ``megatron_glm5.ops.triton_fp8_gemm`` exists and provides the function,
it is used; otherwise a reference dequantises ONE weight (one expert at a time in the grouped case, never a whole
layer's experts) in ``x``'s dtype and calls a torch matmul. The kernels' exact semantics (the contract the kernel
module implements; all tensors on one CUDA device, outputs newly allocated, in ``x``'s / ``dy``'s dtype):

- ``fp8_gemm(x, q, s) -> y``: x [M, K] bf16 (or fp16/fp32), contiguous; q [N, K] float8_e4m3fn, contiguous;
  s [ceil(N/128), ceil(K/128)] float32, contiguous. ``y[m, n] = sum_k x[m, k] * q[n, k] * s[n // 128, k // 128]``,
  y [M, N], accumulated in fp32. N and K need not be multiples of 128 (the last block is partial). M may be 0.
- ``fp8_gemm_dgrad(dy, q, s) -> dx``: dy [M, N]; ``dx[m, k] = sum_n dy[m, n] * q[n, k] * s[n // 128, k // 128]``,
  dx [M, K].
- ``fp8_grouped_gemm(x, q, s, offsets) -> y``: x [T, K]; q [E, N, K]; s [E, ceil(N/128), ceil(K/128)];
  offsets int32 [E] on the device, the cumulative token ends (expert e owns rows ``offsets[e-1]:offsets[e]``,
  offsets[-1] may be < T: rows past it are left 0). ``y[t] = fp8_gemm(x[t], q[e], s[e])`` for t in expert e's rows.
- ``fp8_grouped_gemm_dgrad(dy, q, s, offsets) -> dx``: dy [T, N] -> dx [T, K], per expert as fp8_gemm_dgrad.
- (optional) ``fp8_quantize_blocks(w) -> (q, s)``: the bytes of ``blocks.quantize_blocks_reference``.
The reference on CPU/GPU computes the same sums with the dequantised weight in x's dtype (so a bf16 reference rounds
W to bf16 first; a kernel that keeps the fp32 product is closer to the exact value, never further).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_glm5.fp8.blocks import _kernel, dequantize_blocks


_logger = logging.getLogger("megatron_glm5.fp8")
_warned = set()


def _gpu_kernel(x: torch.Tensor, name: str):
    """The Triton kernel ``name`` for a CUDA tensor; None on CPU. On a GPU without it (triton not installed) the
    dequantising reference runs instead, one weight at a time: slower, and said once per kernel."""
    if not x.is_cuda:
        return None
    k = _kernel(name)
    if k is None and name not in _warned:
        _warned.add(name)
        _logger.warning("FP8 base: the Triton kernel %s is unavailable (pip install triton); using the dequantising "
                        "torch reference, which is much slower", name)
    return k


def _linear_fwd(x2d, q, s):
    k = _gpu_kernel(x2d, "fp8_gemm")
    if k is not None:
        return k(x2d.contiguous(), q, s)
    return F.linear(x2d, dequantize_blocks(q, s, x2d.dtype))


def _linear_dgrad(dy2d, q, s):
    k = _gpu_kernel(dy2d, "fp8_gemm_dgrad")
    if k is not None:
        return k(dy2d.contiguous(), q, s)
    return dy2d @ dequantize_blocks(q, s, dy2d.dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q, s):
        ctx.save_for_backward(q, s)
        ctx.in_shape = x.shape
        return _linear_fwd(x.reshape(-1, x.shape[-1]), q, s).view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, dy):
        q, s = ctx.saved_tensors
        dx = _linear_dgrad(dy.reshape(-1, dy.shape[-1]), q, s)
        return dx.view(ctx.in_shape), None, None


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W^T`` -> ``[..., N]`` for the frozen FP8 weight ``q [N, K]`` with ``scale_inv``."""
    if q.dim() != 2 or x.shape[-1] != q.shape[1]:
        raise ValueError(f"fp8_linear: input [..., {x.shape[-1]}] does not fit the weight {list(q.shape)}")
    return _FP8Linear.apply(x, q, scale_inv)


def _counts_and_offsets(tokens_per_expert, num_experts: int, device):
    """(host list of counts or None, int32 device offsets) from a tensor or a sequence of counts."""
    if torch.is_tensor(tokens_per_expert):
        counts = None if tokens_per_expert.is_cuda else tokens_per_expert.tolist()
        offsets = tokens_per_expert.to(device).cumsum(0).to(torch.int32)
    else:
        counts = [int(c) for c in tokens_per_expert]
        offsets = torch.tensor(counts, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)
    if offsets.numel() != num_experts:
        raise ValueError(f"fp8_grouped_linear: {offsets.numel()} token counts for {num_experts} experts")
    return counts, offsets


def _grouped_reference(x, q, s, counts: Sequence[int], transpose: bool):
    """Per expert: dequantise q[e] alone (in x's dtype) and multiply its rows; rows past the last expert stay 0."""
    n_out = q.shape[2] if transpose else q.shape[1]
    out = x.new_zeros(x.shape[0], n_out)
    start = 0
    for e, c in enumerate(counts):
        if c:
            w = dequantize_blocks(q[e], s[e], x.dtype)
            rows = x[start:start + c]
            out[start:start + c] = rows @ w if transpose else F.linear(rows, w)
            del w
        start += c
    return out


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q, s, counts: Optional[list], offsets):
        ctx.save_for_backward(q, s, offsets)
        ctx.counts = counts
        k = _gpu_kernel(x, "fp8_grouped_gemm")
        if k is not None:
            return k(x.contiguous(), q.contiguous(), s.contiguous(), offsets)
        return _grouped_reference(x, q, s, counts if counts is not None else offsets_to_counts(offsets), False)

    @staticmethod
    def backward(ctx, dy):
        q, s, offsets = ctx.saved_tensors
        k = _gpu_kernel(dy, "fp8_grouped_gemm_dgrad")
        if k is not None:
            return k(dy.contiguous(), q.contiguous(), s.contiguous(), offsets), None, None, None, None
        counts = ctx.counts if ctx.counts is not None else offsets_to_counts(offsets)
        return _grouped_reference(dy, q, s, counts, True), None, None, None, None


def offsets_to_counts(offsets: torch.Tensor) -> list:
    return torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()


def fp8_grouped_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, tokens_per_expert=None, *,
                       offsets: Optional[torch.Tensor] = None, counts: Optional[list] = None) -> torch.Tensor:
    """Routed experts: ``x [T, K]`` sorted by expert, ``q [E, N, K]``, ``scale_inv [E, nb, kb]`` -> ``[T, N]``.

    The tokens per expert as ``tokens_per_expert`` [E] (tensor or sequence), or as model/moe.py passes them:
    ``offsets`` (int32 cumulative ends on x's device) with the host ``counts`` when known."""
    if q.dim() != 3 or x.dim() != 2 or x.shape[-1] != q.shape[2]:
        raise ValueError(f"fp8_grouped_linear: input {list(x.shape)} does not fit the experts' weight {list(q.shape)}")
    if tokens_per_expert is not None:
        counts, offsets = _counts_and_offsets(tokens_per_expert, q.shape[0], x.device)
    elif offsets is None or offsets.numel() != q.shape[0]:
        raise ValueError(f"fp8_grouped_linear: give tokens_per_expert or offsets for {q.shape[0]} experts")
    return _FP8GroupedLinear.apply(x, q, scale_inv, counts, offsets)
