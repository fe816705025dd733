"""SwiGLU on the concatenated [gate | up] projection, optionally weighted per row: one Triton kernel each way.

``out = silu(y[..., :F]) * y[..., F:] * w`` for y [..., 2F] (w: one weight per row, the routed experts' combine
weight; None for the dense MLPs and the shared experts). The backward writes the gradient of y straight into one
[..., 2F] tensor (the gate half and the up half of each row from the same loads) and, weighted, the weights'
gradient ``sum_f g * silu(a) * b`` per row, reduced in a fixed order inside the row's program: no atomics, the
same bits on every run.

Why a kernel of our own: megatron-core's fused SwiGLU (``fused_bias_swiglu``, compiled by torch.compile) builds its
backward as ``torch.cat`` of the two halves, one Inductor kernel whose every element loads both branches' inputs
under masks. In a profiled GLM-5 proxy step on an H100 that backward took 3.19 ms for its 4 calls, against 1.21 ms
for this module's forward and backward kernels together (5 calls each). Alone, at the dense width, megatron-core's
forward + backward takes 0.70 ms, as fast as ours; why it is slower in the step (a shape-generic recompilation
after two widths is the likely cause) was not verified. docs/fusions.md has the measured rows. Math in fp32, one
rounding to y's dtype per stored element (megatron-core's compiled functions also compute in fp32); the weights'
gradient in fp32, returned in the weights' dtype.

:func:`swiglu` is the autograd entry; y must have a contiguous last dimension (rows may be strided).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import triton_interpret_compat

triton_interpret_compat.apply()

# columns per loop step of a row's program and its warps (every row loops over its F columns in these blocks)
SWIGLU_CONFIG = dict(BLOCK=1024, num_warps=4)


@triton.jit
def _swiglu_fwd_kernel(Y, W, OUT, n_cols, stride_y, stride_o, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = Y + row * stride_y
    o_row = OUT + row * stride_o
    if HAS_W:
        w = tl.load(W + row).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n_cols
        a = tl.load(y_row + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(y_row + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        out = a * tl.sigmoid(a) * b
        if HAS_W:
            out = out * w
        tl.store(o_row + cols, out.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(G, Y, W, DY, DW, n_cols, stride_g, stride_y, stride_dy, HAS_W: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g_row = G + row * stride_g
    y_row = Y + row * stride_y
    dy_row = DY + row * stride_dy
    if HAS_W:
        w = tl.load(W + row).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n_cols
        g = tl.load(g_row + cols, mask=m, other=0.0).to(tl.float32)
        a = tl.load(y_row + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(y_row + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        silu = a * s
        if HAS_W:
            dw += g * silu * b
            g = g * w
        tl.store(dy_row + cols, (g * b * s * (1.0 + a * (1.0 - s))).to(DY.dtype.element_ty), mask=m)
        tl.store(dy_row + n_cols + cols, (g * silu).to(DY.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(DW + row, tl.sum(dw, axis=0))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last] without a copy when its rows are evenly strided, else a contiguous copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1]).contiguous()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, w: Optional[torch.Tensor]):
        y2 = _rows(y)
        n, two_f = y2.shape
        f = two_f // 2
        out = torch.empty(n, f, dtype=y.dtype, device=y.device)
        w1 = None if w is None else w.reshape(-1).contiguous()
        if n:
            _swiglu_fwd_kernel[(n,)](y2, y2 if w1 is None else w1, out, f, y2.stride(0), out.stride(0),
                                     HAS_W=w1 is not None, BLOCK=SWIGLU_CONFIG["BLOCK"],
                                     num_warps=SWIGLU_CONFIG["num_warps"])
        ctx.save_for_backward(y2, w1)
        ctx.y_shape, ctx.w_shape = y.shape, None if w is None else w.shape
        return out.view(*y.shape[:-1], f)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y2, w1 = ctx.saved_tensors
        n, two_f = y2.shape
        f = two_f // 2
        g2 = _rows(g)
        dy = torch.empty(n, two_f, dtype=y2.dtype, device=y2.device)
        dw = None if w1 is None else torch.empty(n, dtype=torch.float32, device=y2.device)
        if n:
            _swiglu_bwd_kernel[(n,)](g2, y2, y2 if w1 is None else w1, dy, dy if dw is None else dw, f,
                                     g2.stride(0), y2.stride(0), dy.stride(0), HAS_W=w1 is not None,
                                     BLOCK=SWIGLU_CONFIG["BLOCK"], num_warps=SWIGLU_CONFIG["num_warps"])
        dw_out = None if dw is None else dw.to(w1.dtype).view(ctx.w_shape)
        return dy.view(ctx.y_shape), dw_out


def swiglu(y: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(y[..., :F]) * y[..., F:] (* weights, one per row: shape y.shape[:-1] or with a trailing 1), in y's
    dtype. y's last dimension must be even."""
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension of y must be even ([gate | up]), got {tuple(y.shape)}")
    if weights is not None and weights.numel() != y[..., 0].numel():
        raise ValueError(f"swiglu: one weight per row of y {tuple(y.shape)}, got weights {tuple(weights.shape)}")
    return _SwiGLU.apply(y, weights)
