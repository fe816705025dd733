"""The two per-head products of GLM-5's absorbed MLA, written straight into the layouts their neighbours use.

* ``absorbed_query(q, w_uk, cos, sin)``: q [s, b, h, nope + rope] (linear_q_up_proj's output per head) ->
  q_abs [b * s, h, lat + rope] in token order (t = batch * s + position), the sparse kernels' query:
  [q_nope @ W_uk | RoPE(q_rope)].
* ``expanded_output(out_lat, w_uv, s, b)``: the attention's latent output [b * s, h, lat] -> [s, b, h * v] (the input
  of linear_proj): out_lat @ W_uv^T per head.

Each is one batched GEMM per batch row over the heads, whose strided operands and results cuBLAS takes as they are
(a row stride of h x width, a batch stride of width): no permuted copy of the activations, no concatenation, in the
forward or the backward -- where einsum + cat + transpose().contiguous() copied the query, the output and, in the
backward, the output's gradient (the sparse backward's dO) and the split query's gradient (concatenated again).
Gradients: the same GEMMs transposed into the same layouts; W_uk / W_uv get theirs (views of kv_up's weight; one
GEMM per batch row, rounded to the weight's dtype and summed in fp32 when there are several rows).
Measured (H100, 2026-12-07, forward + backward at GLM-5 widths, 4,096 tokens, docs/performance.md): the query
1.88 -> 0.74 ms, the output 1.09 -> 0.52 ms against the einsum path.
The RoPE part runs through ``rope_rotate_into`` / ``rope_unrotate_into`` (fused regions on a GPU with --fusions: one
kernel each, storing into the strided columns).
"""
from __future__ import annotations

import torch

from megatron_glm5.model import fusions
from megatron_glm5.model.rope import apply_interleaved_rope, interleaved_rope_grad

__all__ = ["absorbed_query", "expanded_output"]


@fusions.region
def rope_rotate_into(dst: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """dst (a strided view: the rope columns of the absorbed query) = RoPE(x) (model/rope.py): compiled, one kernel
    that stores into dst."""
    dst.copy_(apply_interleaved_rope(x, cos, sin))


@fusions.region
def rope_unrotate_into(dst: torch.Tensor, dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """dst (the rope columns of the query's gradient) = RoPE's gradient for dy (model/rope.py)."""
    dst.copy_(interleaved_rope_grad(dy, cos, sin))


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """[n, h, w] (any strides) -> the [h, n, w] view."""
    return x.transpose(0, 1)


def _summed(parts: list, like: torch.Tensor) -> torch.Tensor:
    """A weight's gradient from its per-batch-row GEMMs: the one product as it is, several summed in fp32 (or the
    weight's wider dtype) and rounded once to ``like``'s dtype."""
    if len(parts) == 1:
        return parts[0]
    acc = torch.zeros_like(like, dtype=torch.promote_types(like.dtype, torch.float32))
    for p in parts:
        acc += p
    return acc.to(like.dtype)


class _AbsorbedQuery(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w_uk, cos, sin, fuse):
        s, b, h, _ = q.shape
        nope, lat = w_uk.shape[1], w_uk.shape[2]
        rope = q.shape[-1] - nope
        out = torch.empty(b, s, h, lat + rope, dtype=q.dtype, device=q.device)
        for i in range(b):
            torch.bmm(_heads_major(q[:, i, :, :nope]), w_uk, out=_heads_major(out[i, :, :, :lat]))
        rope_rotate_into(out[..., lat:].transpose(0, 1), q[..., nope:], cos, sin, fuse=fuse)
        ctx.save_for_backward(q, w_uk, cos, sin)
        ctx.fuse = fuse
        return out.view(b * s, h, lat + rope)

    @staticmethod
    def backward(ctx, grad):
        q, w_uk, cos, sin = ctx.saved_tensors
        s, b, h, _ = q.shape
        nope, lat = w_uk.shape[1], w_uk.shape[2]
        grad = grad.reshape(b, s, h, -1)
        dq = torch.empty_like(q) if ctx.needs_input_grad[0] else None
        dw = []
        for i in range(b):
            g_lat = _heads_major(grad[i, :, :, :lat])  # [h, s, lat]
            if dq is not None:
                torch.bmm(g_lat, w_uk.transpose(1, 2), out=_heads_major(dq[:, i, :, :nope]))
            if ctx.needs_input_grad[1]:
                dw.append(torch.bmm(_heads_major(q[:, i, :, :nope]).transpose(1, 2), g_lat))
        if dq is not None:
            rope_unrotate_into(dq[..., nope:], grad[..., lat:].transpose(0, 1), cos, sin, fuse=ctx.fuse)
        return dq, (_summed(dw, w_uk) if dw else None), None, None, None


class _ExpandedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_lat, w_uv, s, b):
        h, v, lat = w_uv.shape
        rows = out_lat.view(b, s, h, lat)
        out = torch.empty(s, b, h, v, dtype=out_lat.dtype, device=out_lat.device)
        for i in range(b):
            torch.bmm(_heads_major(rows[i]), w_uv.transpose(1, 2), out=_heads_major(out[:, i]))
        ctx.save_for_backward(out_lat, w_uv)
        ctx.s, ctx.b = s, b
        return out.view(s, b, h * v)

    @staticmethod
    def backward(ctx, grad):
        out_lat, w_uv = ctx.saved_tensors
        s, b = ctx.s, ctx.b
        h, v, lat = w_uv.shape
        rows = out_lat.view(b, s, h, lat)
        grad = grad.reshape(s, b, h, v)
        d_lat = torch.empty_like(out_lat) if ctx.needs_input_grad[0] else None
        dw = []
        for i in range(b):
            g = _heads_major(grad[:, i])  # [h, s, v]
            if d_lat is not None:
                torch.bmm(g, w_uv, out=_heads_major(d_lat.view(b, s, h, lat)[i]))
            if ctx.needs_input_grad[1]:
                dw.append(torch.bmm(g.transpose(1, 2), _heads_major(rows[i])))
        return d_lat, (_summed(dw, w_uv) if dw else None), None, None


def absorbed_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   fuse: bool = False) -> torch.Tensor:
    """q [s, b, h, nope + rope], w_uk [h, nope, lat] -> [b * s, h, lat + rope] = [q_nope @ W_uk | RoPE(q_rope)]."""
    return _AbsorbedQuery.apply(q, w_uk, cos, sin, fuse)


def expanded_output(out_lat: torch.Tensor, w_uv: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """out_lat [b * s, h, lat], w_uv [h, v, lat] -> [s, b, h * v] (per head out_lat @ W_uv^T, sequence-first)."""
    return _ExpandedOutput.apply(out_lat.contiguous(), w_uv, s, b)
