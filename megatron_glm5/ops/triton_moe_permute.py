"""Fused MoE token permute / unpermute (``--moe-permute-fusion``): Triton kernels for megatron-core's dispatchers.

megatron-core's unfused path (``moe_utils.permute`` / ``unpermute``, drop_and_pad off) does, for a routing map
``[T, E]`` (bool) and ``num_out_tokens`` rows:

- permute: the routed (expert, token) pairs in expert-major order, tokens ascending inside an expert (a stable
  argsort of the transposed map); row ``s`` of the output is token ``sorted_indices[s]``, and the permuted probs
  are ``probs[sorted_indices[s], expert of s]``; backward: the token gradient is the scatter-sum of the slot
  gradients (``index_select``'s backward), the probs gradient is the slot gradient at its (token, expert), zero
  elsewhere;
- unpermute (the dispatchers never pass probs: GLM5GroupedExperts already multiplied the rows by the permuted
  probs): ``out[t] = sum of the rows of t's slots`` (``scatter_add``; atomics on a GPU, so the order varies
  there); backward: a gather of the output gradient into the slots.

Here both directions are one kernel each, driven by a per-token row map built on the device with no host sync
(:func:`build_row_map`: one scan of the transposed map, one kernel): the slots of each token in expert order.
:func:`_permute_kernel` reads each token row once and writes it to its slots (plus the permuted probs);
:func:`_unpermute_kernel` gives each output token its own program, which sums its slots in expert order in
fp32 -- no atomics, the same bits on every run. Each autograd Function's backward is the other kernel.

Numerics: in fp32 the sum order is megatron's on CPU (slot order = expert order, from zero), so forward and
backward are bitwise equal to the unfused path there. In bf16 the sum is accumulated in fp32 and rounded once
(megatron accumulates in bf16, rounding after every add): the two differ by a few bf16 ulps of the sum (the
tests bound it at 1e-2 relative); the gathers (permute forward, unpermute backward) are copies, exact in any
dtype.

:func:`permute` / :func:`unpermute` take megatron's arguments; unsupported modes (drop_and_pad, padding for
quantization, probs merged in unpermute) fall back to megatron's unfused functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import triton_interpret_compat

triton_interpret_compat.apply()


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _row_map_kernel(map_ptr, pos_ptr, slots_ptr, experts_ptr, count_ptr, slot_token_ptr, T, E, num_out,
                    BLOCK_E: tl.constexpr):
    """One program per token: its slots in expert order, their experts and count, and the inverse map slot ->
    token. pos: inclusive cumsum of the expert-major (transposed, flattened) map, so a routed pair's slot is its
    pos - 1. Slots at or past num_out are dropped (megatron keeps the first num_out)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    routed = tl.load(map_ptr + t * E + e, mask=in_e, other=0) != 0
    slot = tl.load(pos_ptr + e.to(tl.int64) * T + t, mask=in_e, other=0) - 1
    keep = routed & (slot < num_out)
    k = keep.to(tl.int32)
    rank = tl.cumsum(k, 0) - 1
    tl.store(slots_ptr + t * E + rank, slot, mask=keep)
    tl.store(experts_ptr + t * E + rank, e, mask=keep)
    tl.store(slot_token_ptr + slot, t, mask=keep)
    tl.store(count_ptr + t, tl.sum(k, 0))


@triton.jit
def _permute_kernel(x_ptr, out_ptr, probs_ptr, out_probs_ptr, slots_ptr, experts_ptr, count_ptr, H, E, stride_x,
                    WITH_PROBS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token t, hidden block): copy t's row block to each of its slots; the first hidden block also
    writes the permuted probs."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    row = tl.load(x_ptr + t * stride_x + offs, mask=in_h)
    n = tl.load(count_ptr + t)
    for j in range(n):
        s = tl.load(slots_ptr + t * E + j).to(tl.int64)
        tl.store(out_ptr + s * H + offs, row, mask=in_h)
        if WITH_PROBS:
            e = tl.load(experts_ptr + t * E + j)
            tl.store(out_probs_ptr + s, tl.load(probs_ptr + t * E + e), mask=hb == 0)


@triton.jit
def _unpermute_kernel(y_ptr, out_ptr, grad_pp_ptr, grad_probs_ptr, slots_ptr, experts_ptr, count_ptr, H, E,
                      stride_out, WITH_PROBS: tl.constexpr, ACC_F64: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token t, hidden block): out[t] = sum of t's slot rows, in expert order, accumulated in fp32
    (fp64 for fp64 rows). WITH_PROBS (permute's backward): also grad_probs[t, e] = grad_pp[slot of (t, e)]."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    if ACC_F64:
        acc = tl.zeros([BLOCK_H], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    n = tl.load(count_ptr + t)
    for j in range(n):
        s = tl.load(slots_ptr + t * E + j).to(tl.int64)
        acc += tl.load(y_ptr + s * H + offs, mask=in_h, other=0).to(acc.dtype)
        if WITH_PROBS:
            e = tl.load(experts_ptr + t * E + j)
            tl.store(grad_probs_ptr + t * E + e, tl.load(grad_pp_ptr + s), mask=hb == 0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=in_h)


# ---------------------------------------------------------------------------------------------------------------
# Row map
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RowMap:
    """Where each token's rows go. ``slots[t, :counts[t]]`` are token t's rows of the permuted tensor in expert
    order and ``experts[t, :counts[t]]`` their experts (entries past counts[t] are unset); ``slot_token`` is
    megatron's ``sorted_indices`` (token of each permuted row, int64). Stands in for ``sorted_indices`` in the
    dispatchers (megatron stores it as ``reversed_*_permutation_mapping``)."""

    slots: torch.Tensor  # [T, E] int32
    experts: torch.Tensor  # [T, E] int32
    counts: torch.Tensor  # [T] int32
    slot_token: torch.Tensor  # [num_out] int64
    num_tokens: int
    num_experts: int
    num_out: int


def build_row_map(routing_map: torch.Tensor, num_out_tokens=None) -> RowMap:
    """routing_map [T, E] bool -> :class:`RowMap`, on the map's device with no host sync. num_out_tokens (int
    or a 0-d CPU tensor, megatron's): rows of the permuted tensor (the first ones in expert-major order); None
    counts the routed pairs (one host sync). Rows past the routed count are left unset (megatron fills them
    with unrouted tokens, whose probs are zero)."""
    if routing_map.dim() != 2:
        raise ValueError(f"moe permute fusion: routing_map must be [tokens, experts], got {tuple(routing_map.shape)}")
    tokens, experts = routing_map.shape
    num_out = int(routing_map.sum()) if num_out_tokens is None else int(num_out_tokens)
    dev = routing_map.device
    slots = torch.empty(tokens, experts, dtype=torch.int32, device=dev)
    expert_of = torch.empty(tokens, experts, dtype=torch.int32, device=dev)
    counts = torch.zeros(tokens, dtype=torch.int32, device=dev)
    slot_token = torch.zeros(num_out, dtype=torch.int64, device=dev)
    if tokens and experts:
        routed = (routing_map if routing_map.dtype == torch.bool else routing_map != 0).view(torch.uint8)
        # expert-major running count (a 1-D scan: torch's scan down the columns of [T, E] is ~10x slower)
        pos = routed.t().contiguous().view(-1).cumsum(0, dtype=torch.int32)
        _row_map_kernel[(tokens,)](routed.contiguous(), pos, slots, expert_of, counts, slot_token, tokens, experts,
                                   num_out, BLOCK_E=triton.next_power_of_2(experts))
    return RowMap(slots, expert_of, counts, slot_token, tokens, experts, num_out)


def _block_h(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), 2048)


def _launch_permute(x: torch.Tensor, rm: RowMap, probs: Optional[torch.Tensor]):
    hidden = x.shape[1]
    out = torch.empty(rm.num_out, hidden, dtype=x.dtype, device=x.device)
    out_probs = torch.empty(rm.num_out, dtype=probs.dtype, device=x.device) if probs is not None else None
    if rm.num_tokens and rm.num_out and hidden:
        if x.stride(1) != 1:
            x = x.contiguous()
        bh = _block_h(hidden)
        _permute_kernel[(rm.num_tokens, triton.cdiv(hidden, bh))](
            x, out, probs if probs is not None else x, out_probs if probs is not None else out, rm.slots,
            rm.experts, rm.counts, hidden, rm.num_experts, x.stride(0), WITH_PROBS=probs is not None, BLOCK_H=bh,
            num_warps=4)
    return out, out_probs


def _launch_unpermute(y: torch.Tensor, rm: RowMap, grad_pp: Optional[torch.Tensor] = None,
                      probs_dtype: Optional[torch.dtype] = None):
    hidden = y.shape[1]
    out = torch.empty(rm.num_tokens, hidden, dtype=y.dtype, device=y.device)
    grad_probs = (torch.zeros(rm.num_tokens, rm.num_experts, dtype=probs_dtype, device=y.device)
                  if grad_pp is not None else None)
    if not (rm.num_tokens and hidden):
        return out, grad_probs
    y = y.contiguous()
    if grad_pp is not None:
        grad_pp = grad_pp.contiguous()
    bh = _block_h(hidden)
    _unpermute_kernel[(rm.num_tokens, triton.cdiv(hidden, bh))](
        y, out, grad_pp if grad_pp is not None else y, grad_probs if grad_pp is not None else out, rm.slots,
        rm.experts, rm.counts, hidden, rm.num_experts, out.stride(0), WITH_PROBS=grad_pp is not None,
        ACC_F64=y.dtype == torch.float64, BLOCK_H=bh, num_warps=4)
    return out, grad_probs


# ---------------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------------


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, rm: RowMap):
        ctx.rm = rm
        ctx.probs_dtype = probs.dtype if probs is not None else None
        ctx.tokens_meta = (tokens.shape[1], tokens.dtype)
        out, out_probs = _launch_permute(tokens, rm, probs.contiguous() if probs is not None else None)
        if out_probs is None:  # autograd outputs must be tensors
            out_probs = out.new_empty(0)
            ctx.mark_non_differentiable(out_probs)
        return out, out_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        needs_probs = ctx.needs_input_grad[1]
        if grad_out is None:  # only the permuted probs were used
            hidden, dtype = ctx.tokens_meta
            grad_out = torch.zeros(ctx.rm.num_out, hidden, dtype=dtype, device=ctx.rm.counts.device)
        if needs_probs and grad_probs is None:
            grad_probs = torch.zeros(ctx.rm.num_out, dtype=ctx.probs_dtype, device=grad_out.device)
        grad_tokens, grad_p = _launch_unpermute(grad_out, ctx.rm, grad_probs if needs_probs else None,
                                                ctx.probs_dtype)
        return grad_tokens if ctx.needs_input_grad[0] else None, grad_p, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, rm: RowMap):
        ctx.rm = rm
        return _launch_unpermute(permuted, rm)[0]

    @staticmethod
    def backward(ctx, grad_out):
        return _launch_permute(grad_out, ctx.rm, None)[0], None


def permute_tokens(tokens: torch.Tensor, rm: RowMap, probs: Optional[torch.Tensor] = None):
    """tokens [T, H] -> (rows [num_out, H] in expert-major order, permuted probs [num_out] or None)."""
    if tokens.dim() != 2 or tokens.shape[0] != rm.num_tokens:
        raise ValueError(f"moe permute fusion: tokens must be [{rm.num_tokens}, hidden], got {tuple(tokens.shape)}")
    if probs is not None and tuple(probs.shape) != (rm.num_tokens, rm.num_experts):
        raise ValueError(f"moe permute fusion: probs must be [{rm.num_tokens}, {rm.num_experts}], got "
                         f"{tuple(probs.shape)}")
    out, out_probs = _Permute.apply(tokens, probs, rm)
    return out, (out_probs if probs is not None else None)


def unpermute_tokens(permuted: torch.Tensor, rm: RowMap) -> torch.Tensor:
    """rows [num_out, H] -> [T, H]: each token's rows summed in expert order (fp32 accumulation)."""
    if permuted.dim() != 2 or permuted.shape[0] != rm.num_out:
        raise ValueError(f"moe permute fusion: permuted tokens must be [{rm.num_out}, hidden], got "
                         f"{tuple(permuted.shape)}")
    return _Unpermute.apply(permuted, rm)


# ---------------------------------------------------------------------------------------------------------------
# megatron-core's signatures
# ---------------------------------------------------------------------------------------------------------------


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
            tokens_per_expert=None, align_size=0):
    """``moe_utils.permute``'s arguments and results, with a :class:`RowMap` as the sorted indices. drop_and_pad,
    align_size and CPU tensors (without Triton's interpreter) fall back to megatron's unfused function
    (``fused`` is ignored: megatron's means Transformer Engine)."""
    from megatron.core.transformer.moe import moe_utils

    if drop_and_pad or align_size or not triton_interpret_compat.runs_kernels(tokens):
        return moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                                 drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert,
                                 align_size=align_size)
    rm = build_row_map(routing_map, num_out_tokens)
    out, out_probs = permute_tokens(tokens, rm, probs)
    return out, out_probs, rm, None, tokens_per_expert


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False, pad_offsets=None):
    """``moe_utils.unpermute``'s arguments. With a :class:`RowMap` from :func:`permute` and no probs: the fused
    kernel; otherwise megatron's unfused function (given the plain sorted indices)."""
    from megatron.core.transformer.moe import moe_utils

    if isinstance(sorted_indices, RowMap) and probs is None and not drop_and_pad and pad_offsets is None:
        if tuple(restore_shape) != (sorted_indices.num_tokens, permuted_tokens.shape[-1]):
            raise ValueError(f"moe permute fusion: restore_shape {tuple(restore_shape)} does not match the row map "
                             f"({sorted_indices.num_tokens} tokens)")
        return unpermute_tokens(permuted_tokens, sorted_indices)
    if isinstance(sorted_indices, RowMap):
        sorted_indices = sorted_indices.slot_token
    return moe_utils.unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                               drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)
