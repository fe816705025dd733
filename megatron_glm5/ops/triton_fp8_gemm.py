"""Triton GEMMs through a frozen block-scaled FP8 weight (the format of ``megatron_glm5/fp8/blocks.py``), and the
GPU kernel that quantises a weight into that format.

A weight ``W [N, K]`` is stored as ``q`` (float8_e4m3fn, [N, K]) and ``s`` (fp32, [ceil(N/128), ceil(K/128)]) with
``W[n, k] = q[n, k] * s[n // 128, k // 128]``; partial last blocks are allowed. The functions (all tensors on one
CUDA device; outputs new, in the activation's dtype; fp32 accumulation):

- ``fp8_gemm(x, q, s)``: ``y = x @ W^T``, x [M, K] -> y [M, N].
- ``fp8_gemm_dgrad(dy, q, s)``: ``dx = dy @ W``, dy [M, N] -> dx [M, K].
- ``fp8_grouped_gemm(x, q, s, offsets)``: the routed experts in one launch: x [T, K] sorted by expert, q [E, N, K],
  s [E, nb, kb], offsets int32 [E] the cumulative token ends on the device (expert e owns rows
  ``offsets[e-1]:offsets[e]``; rows past ``offsets[-1]`` are written 0). y [T, N]. No host synchronisation.
- ``fp8_grouped_gemm_dgrad(dy, q, s, offsets)``: dy [T, N] -> dx [T, K], per expert ``dy_e @ W_e``.
- ``fp8_quantize_blocks(w)``: w [N, K] or [E, N, K] -> (q, s), the same bytes as
  ``blocks.quantize_blocks_reference``: per 128x128 block amax in fp32, ``s = amax / 448`` (1 for an all-zero
  block), ``q = clamp(w / s, -448, 448)`` rounded to nearest even (IEEE division, not a reciprocal).
  ``quantize_blocks_cuda`` is the same function.

Two designs share one tile loop (``design=``):

- ``"A"`` weight-only: the fp8 tile is converted to the activation dtype in registers (exact: every e4m3 value is a
  bf16 value), a bf16 ``tl.dot`` over the tile's 128-wide K step gives an fp32 partial sum, and the block scale
  multiplies that partial sum before it joins the accumulator. The product ``q * s`` is thus never rounded to bf16:
  the result is the exact dequantised weight's, to fp32 accumulation. The weight is the MMA's left operand
  (``y^T = W x^T``), so it can stay in registers after the conversion (Hopper's wgmma takes only its left operand
  from registers), and a few tokens fill the MMA's narrow side (decode-sized expert groups).
- ``"B"`` FP8 x FP8: the activations are quantised first (``quantize_rows``: one fp32 scale per row and 128
  columns, DeepSeek-V3's 1x128 groups), then an e4m3 ``tl.dot`` (wgmma e4m3 on Hopper) per K step, both scales
  applied to the fp32 partial sum of each step (so the tensor core's limited-precision accumulation spans 128 terms
  only). Twice the MMA rate, at the cost of rounding the activations to e4m3.

The default is ``DEFAULT_DESIGN`` = A. Measured on an H200 (docs/performance.md, "FP8 GEMMs (issue 15)"): A's error
against the exact product is the bf16 reference's (2.3e-3; 1.7e-3 without WS), B's ten times more (2.6e-2, the
activations' e4m3 rounding), which the issue's "forward equals the dequantised model's to rounding" excludes as a
default. B's forward is 1.3-1.6x faster than A's at 4096 rows (657 against 407 TFLOP/s on the dense fc1), its input
gradient slower for the routed experts; it is kept behind ``design="B"`` for that forward speed. In the
decode-sized regime (8 tokens per expert) both beat the bf16 grouped GEMM (half the weight bytes).
Tile configurations are picked from the shapes by ``_config``; ``config=`` overrides them (the benchmark sweeps).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

BLOCK = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
DESIGNS = ("A", "B")
DEFAULT_DESIGN = "A"

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------------------------------------------------
# the tile loop (shared by the dense and grouped kernels, forward and input gradient, designs A and B)
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_weight_left(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, row0, row_end, col0, n_red, n_out,
          stride_a, stride_sa, stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red,
          BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, FP8_DOT: tl.constexpr, IEEE: tl.constexpr,
          SCALE_W: tl.constexpr):
    """``_tile`` computed transposed, acc[BO, BM] = W_tile @ a_tile^T: the weight is the MMA's left operand."""
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    outs = col0 + tl.arange(0, BO)
    out_ok = outs < n_out
    acc = tl.zeros((BO, BM), dtype=tl.float32)
    for r0 in range(0, n_red, BR):
        red = r0 + tl.arange(0, BR)
        red_ok = red < n_red
        a = tl.load(a_ptr + rows[None, :].to(tl.int64) * stride_a + red[:, None],
                    mask=row_ok[None, :] & red_ok[:, None], other=0.0)  # [BR, BM]
        w = tl.load(q_ptr + outs[:, None].to(tl.int64) * q_stride_out + red[None, :].to(tl.int64) * q_stride_red,
                    mask=out_ok[:, None] & red_ok[None, :], other=0.0)  # [BO, BR] e4m3
        sw = tl.load(s_ptr + (outs // 128) * s_stride_out + (r0 // 128) * s_stride_red, mask=out_ok, other=0.0)
        if FP8_DOT:
            sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sa + r0 // 128, mask=row_ok, other=0.0)
            part = tl.dot(w, a)
            acc += part * sw[:, None] * sa[None, :]
        elif SCALE_W:  # the weight tile scaled in registers, rounded to the input dtype, accumulated by the MMA
            w = (w.to(tl.float32) * sw[:, None]).to(a.dtype)
            if IEEE:
                acc = tl.dot(w, a, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, a, acc)
        else:
            if IEEE:
                part = tl.dot(w.to(a.dtype), a, input_precision="ieee")
            else:
                part = tl.dot(w.to(a.dtype), a)
            acc += part * sw[:, None]
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_out + outs[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & out_ok[:, None])


@triton.jit
def _tile_rows_left(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, row0, row_end, col0, n_red, n_out,
                    stride_a, stride_sa, stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red,
                    BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, FP8_DOT: tl.constexpr, IEEE: tl.constexpr,
                    SCALE_W: tl.constexpr):
    """``_tile`` as written, acc[BM, BO] = a_tile @ W_tile^T: the weight is the MMA's right operand."""
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    outs = col0 + tl.arange(0, BO)
    out_ok = outs < n_out
    acc = tl.zeros((BM, BO), dtype=tl.float32)
    for r0 in range(0, n_red, BR):
        red = r0 + tl.arange(0, BR)
        red_ok = red < n_red
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + red[None, :],
                    mask=row_ok[:, None] & red_ok[None, :], other=0.0)  # [BM, BR]
        w = tl.load(q_ptr + outs[None, :].to(tl.int64) * q_stride_out + red[:, None].to(tl.int64) * q_stride_red,
                    mask=out_ok[None, :] & red_ok[:, None], other=0.0)  # [BR, BO] e4m3
        sw = tl.load(s_ptr + (outs // 128) * s_stride_out + (r0 // 128) * s_stride_red, mask=out_ok, other=0.0)
        if FP8_DOT:
            sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sa + r0 // 128, mask=row_ok, other=0.0)
            part = tl.dot(a, w)
            acc += part * sa[:, None] * sw[None, :]
        elif SCALE_W:
            w = (w.to(tl.float32) * sw[None, :]).to(a.dtype)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        else:
            if IEEE:
                part = tl.dot(a, w.to(a.dtype), input_precision="ieee")
            else:
                part = tl.dot(a, w.to(a.dtype))
            acc += part * sw[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + outs[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


@triton.jit
def _tile(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, row0, row_end, col0, n_red, n_out,
          stride_a, stride_sa, stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red,
          BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, FP8_DOT: tl.constexpr, IEEE: tl.constexpr,
          SCALE_W: tl.constexpr, SWAP: tl.constexpr):
    """out[row0:row0+BM (< row_end), col0:col0+BO] = a[rows, :n_red] @ W^T, with W[o, r] = q[o, r] * s[o//128, r//128]
    addressed through the strides (forward: o = n, r = k; input gradient: o = k, r = n). FP8_DOT: ``a`` is e4m3 with
    one scale per row and 128 reduction columns in ``sa``; each step's fp32 partial sum is scaled by both. SCALE_W
    (design A only): ``q * s`` is formed in registers and rounded to the input dtype before the MMA, which then
    accumulates across steps itself (no per-step partial sum). SWAP: the weight is the MMA's left operand (few rows
    fill its narrow side), else its right operand."""
    if SWAP:
        _tile_weight_left(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, row0, row_end, col0, n_red, n_out, stride_a, stride_sa,
                          stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red, BM, BO, BR, FP8_DOT,
                          IEEE, SCALE_W)
    else:
        _tile_rows_left(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, row0, row_end, col0, n_red, n_out, stride_a, stride_sa,
                        stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red, BM, BO, BR, FP8_DOT,
                        IEEE, SCALE_W)


@triton.jit
def _dense_kernel(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, M, n_red, n_out,
                  stride_a, stride_sa, stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red,
                  BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
                  FP8_DOT: tl.constexpr, IEEE: tl.constexpr, SCALE_W: tl.constexpr, SWAP: tl.constexpr):
    # tiles ordered in groups of GROUP weight tiles, rows fastest inside a group: a group's weight stays in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_o = tl.cdiv(n_out, BO)
    per_group = GROUP * tiles_m
    first_o = (pid // per_group) * GROUP
    group = tl.minimum(tiles_o - first_o, GROUP)
    pid_o = first_o + (pid % per_group) % group
    pid_m = (pid % per_group) // group
    _tile(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, pid_m * BM, M, pid_o * BO, n_red, n_out,
          stride_a, stride_sa, stride_out, q_stride_out, q_stride_red, s_stride_out, s_stride_red,
          BM, BO, BR, FP8_DOT, IEEE, SCALE_W, SWAP)


@triton.jit
def _grouped_kernel(a_ptr, sa_ptr, q_ptr, s_ptr, out_ptr, offsets_ptr, T, E, n_red, n_out,
                    stride_a, stride_sa, stride_out, q_stride_e, q_stride_out, q_stride_red,
                    s_stride_e, s_stride_out, s_stride_red,
                    BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, E_POW2: tl.constexpr,
                    FP8_DOT: tl.constexpr, IEEE: tl.constexpr, SCALE_W: tl.constexpr, SWAP: tl.constexpr):
    """Axis 0: the row tiles of all experts in order (each expert's rows cut into BM tiles of its own), then the
    tiles of the rows past the last expert (written 0); programs past those return. Axis 1: output tiles."""
    pid_m = tl.program_id(0)
    col0 = tl.program_id(1) * BO
    e = tl.arange(0, E_POW2)
    ends = tl.load(offsets_ptr + e, mask=e < E, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=(e >= 1) & (e < E), other=0)
    counts = tl.where(e < E, ends - starts, 0)
    tiles = (counts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    if expert < E:
        here = e == expert
        before = tl.sum(tl.where(here, cum - tiles, 0), 0)
        row0 = tl.sum(tl.where(here, starts, 0), 0) + (pid_m - before) * BM
        row_end = tl.sum(tl.where(here, ends, 0), 0)
        _tile(a_ptr, sa_ptr, q_ptr + expert.to(tl.int64) * q_stride_e, s_ptr + expert * s_stride_e, out_ptr,
              row0, row_end, col0, n_red, n_out, stride_a, stride_sa, stride_out, q_stride_out, q_stride_red,
              s_stride_out, s_stride_red, BM, BO, BR, FP8_DOT, IEEE, SCALE_W, SWAP)
    else:
        last = tl.max(tl.where(e == E - 1, ends, 0), 0)
        total = tl.max(cum, 0)
        rows = last + (pid_m - total) * BM + tl.arange(0, BM)
        outs = col0 + tl.arange(0, BO)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + outs[None, :],
                 tl.zeros((BM, BO), dtype=out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (outs[None, :] < n_out))


# ----------------------------------------------------------------------------------------------------------------------
# quantisation: activations by rows of 128 (design B), weights by 128x128 blocks (the release's format)
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _to_e4m3(v, scale):
    """``clamp(v / scale, -448, 448)`` in e4m3, the division correctly rounded (as torch's)."""
    return tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_s, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], _to_e4m3(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + tl.program_id(1), scale, mask=rows < M)


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, nb, kb, BS: tl.constexpr):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BS + tl.arange(0, BS)
    cols = pid_k * BS + tl.arange(0, BS)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offs = pid_e.to(tl.int64) * N * K + rows[:, None].to(tl.int64) * K + cols[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), 1), 0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q_ptr + offs, _to_e4m3(w, scale), mask=mask)
    tl.store(s_ptr + (pid_e * nb + pid_n) * kb + pid_k, scale)


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, ceil(K/128)]): one scale per row and 128 columns, ``s = amax / 448``."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, triton.cdiv(K, BLOCK), dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(triton.cdiv(M, 32), triton.cdiv(K, BLOCK))](x, q, s, M, K, x.stride(0), s.stride(0),
                                                                          BM=32, num_warps=4)
    return q, s


def fp8_quantize_blocks(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] or [E, N, K] (any float dtype) -> (q e4m3, s fp32 [..., ceil(N/128), ceil(K/128)]): the bytes of
    ``megatron_glm5.fp8.blocks.quantize_blocks_reference``."""
    if w.dim() not in (2, 3):
        raise ValueError(f"fp8_quantize_blocks needs a 2-D [N, K] or 3-D [E, N, K] weight, got {list(w.shape)}")
    w = w.contiguous()
    *lead, N, K = w.shape
    E = lead[0] if lead else 1
    nb, kb = triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(*lead, nb, kb, dtype=torch.float32, device=w.device)
    if w.numel():
        _quantize_blocks_kernel[(E, nb, kb)](w, q, s, N, K, nb, kb, BS=BLOCK, num_warps=8)
    return q, s


quantize_blocks_cuda = fp8_quantize_blocks


# ----------------------------------------------------------------------------------------------------------------------
# configurations and launches
# ----------------------------------------------------------------------------------------------------------------------

# BM: activation rows per tile (the MMA's narrow side), BO: weight rows (outputs) per tile, BR: the reduction step
# (divides 128: one weight scale per step); WS: design A scales the weight tile in registers (SCALE_W); TQ: the
# input gradient reads a transposed copy of the codes (made per call) so that its reduction runs along contiguous
# memory, as the forward's does; SW (default 1): the weight is the MMA's left operand. Keyed by (design, regime,
# direction, layout); the values are the winners of `benchmarks/fp8_gemm.py --sweep` on an H200, 2026-12-01
# (docs/performance.md, "FP8 GEMMs (issue 15)"; the dense "small" entries were not swept: no dense shape has so
# few rows).
_CONFIGS: Dict[Tuple[str, str, str, str], Dict[str, int]] = {
    ("A", "small", "fwd", "dense"): dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4, WS=1),
    ("A", "small", "dgrad", "dense"): dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4),
    ("B", "small", "fwd", "dense"): dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4),
    ("B", "small", "dgrad", "dense"): dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6),
    ("A", "large", "fwd", "dense"): dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=4, SW=0, WS=1),
    ("A", "large", "dgrad", "dense"): dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=4, WS=1),
    ("B", "large", "fwd", "dense"): dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=4, SW=0),
    ("B", "large", "dgrad", "dense"): dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=4, SW=0, TQ=1),
    ("A", "small", "fwd", "grouped"): dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6),
    ("A", "small", "dgrad", "grouped"): dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4, WS=1),
    ("B", "small", "fwd", "grouped"): dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6),
    ("B", "small", "dgrad", "grouped"): dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6),
    ("A", "large", "fwd", "grouped"): dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=4, SW=0, WS=1),
    ("A", "large", "dgrad", "grouped"): dict(BM=128, BO=256, BR=64, num_warps=8, num_stages=3, WS=1),
    ("B", "large", "fwd", "grouped"): dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=4, SW=0),
    ("B", "large", "dgrad", "grouped"): dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=4, SW=0, TQ=1),
}
GROUP_TILES = 8


def regime(rows_per_group: float) -> str:
    """"small": at most 64 rows per weight (decode-sized expert groups), else "large"."""
    return "small" if rows_per_group <= 64 else "large"


def _config(design: str, rows_per_group: float, direction: str, layout: str, config: Optional[dict]) -> dict:
    if config is not None:
        return dict(config)
    return dict(_CONFIGS[design, regime(rows_per_group), direction, layout])


def _check(a: torch.Tensor, q: torch.Tensor, s: torch.Tensor, design: str, name: str, grouped: bool):
    if design not in DESIGNS:
        raise ValueError(f"{name}: design must be one of {DESIGNS}, got {design!r}")
    if a.dim() != 2 or q.dim() != (3 if grouped else 2) or q.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: expected a 2-D input and a {'3' if grouped else '2'}-D float8_e4m3fn weight, "
                         f"got {list(a.shape)} and {list(q.shape)} {q.dtype}")
    if a.dtype not in _TL_DTYPES:
        raise ValueError(f"{name}: the input must be bf16, fp16 or fp32, got {a.dtype}")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    if tuple(s.shape) != want or s.dtype != torch.float32:
        raise ValueError(f"{name}: scales of shape {list(s.shape)} {s.dtype} do not fit the weight {list(q.shape)} "
                         f"(expected {list(want)} float32)")


def _operand(a: torch.Tensor, design: str):
    """(left operand, its row scales or a dummy): the activations as they are, or e4m3 by rows of 128 (design B)."""
    a = a.contiguous()
    if design == "B":
        return quantize_rows(a)
    return a, a


def _run(a, q, s, offsets, transpose: bool, design: str, config: Optional[dict]):
    """Shared launch: forward (transpose False: reduce over K) or input gradient (True: reduce over N)."""
    grouped = offsets is not None
    experts = q.shape[0] if grouped else 1
    cfg = _config(design, a.shape[0] / experts, "dgrad" if transpose else "fwd", "grouped" if grouped else "dense",
                  config)
    if transpose and cfg.get("TQ"):  # input gradient through a transposed copy of the codes (a forward over W^T)
        q, s, transpose = q.transpose(-2, -1), s.transpose(-2, -1), False
    q, s = q.contiguous(), s.contiguous()
    n, k = q.shape[-2:]
    n_red, n_out = (n, k) if transpose else (k, n)
    if a.shape[1] != n_red:
        raise ValueError(f"input of width {a.shape[1]} does not fit the weight {list(q.shape)} "
                         f"({'input gradient' if transpose else 'forward'} reduces over {n_red})")
    rows = a.shape[0]
    out = torch.empty(rows, n_out, dtype=a.dtype, device=a.device)
    if rows == 0 or n_out == 0:
        return out
    if n_red == 0:
        return out.zero_()
    left, left_scale = _operand(a, design)
    # strides of W[o, r] in q (per expert) and in s
    q_so, q_sr = (1, k) if transpose else (k, 1)
    s_so, s_sr = (1, s.shape[-1]) if transpose else (s.shape[-1], 1)
    meta = dict(BM=cfg["BM"], BO=cfg["BO"], BR=cfg["BR"], FP8_DOT=design == "B", IEEE=a.dtype == torch.float32,
                SCALE_W=design == "A" and bool(cfg.get("WS")), SWAP=bool(cfg.get("SW", 1)),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if 128 % meta["BR"]:
        raise ValueError(f"the reduction step BR={meta['BR']} must divide 128")
    if not grouped:
        grid = (triton.cdiv(rows, meta["BM"]) * triton.cdiv(n_out, meta["BO"]),)
        _dense_kernel[grid](left, left_scale, q, s, out, rows, n_red, n_out, left.stride(0), left_scale.stride(0),
                            out.stride(0), q_so, q_sr, s_so, s_sr, GROUP=GROUP_TILES, **meta)
    else:
        if offsets.dtype != torch.int32 or offsets.numel() != experts or offsets.device != a.device:
            raise ValueError(f"offsets must be int32 [{experts}] on {a.device}, got {offsets.dtype} "
                             f"{list(offsets.shape)} on {offsets.device}")
        grid = (triton.cdiv(rows, meta["BM"]) + experts + 1, triton.cdiv(n_out, meta["BO"]))
        _grouped_kernel[grid](left, left_scale, q, s, out, offsets, rows, experts, n_red, n_out, left.stride(0),
                              left_scale.stride(0), out.stride(0), q.stride(0), q_so, q_sr, s.stride(0), s_so, s_sr,
                              E_POW2=triton.next_power_of_2(experts), **meta)
    return out


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, design: str = DEFAULT_DESIGN,
             config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W = q [N, K] * s per 128x128 block."""
    _check(x, q, s, design, "fp8_gemm", False)
    return _run(x, q, s, None, False, design, config)


def fp8_gemm_dgrad(dy: torch.Tensor, q: torch.Tensor, s: torch.Tensor, design: str = DEFAULT_DESIGN,
                   config: Optional[dict] = None) -> torch.Tensor:
    """dy [M, N] @ W -> [M, K] in dy's dtype."""
    _check(dy, q, s, design, "fp8_gemm_dgrad", False)
    return _run(dy, q, s, None, True, design, config)


def fp8_grouped_gemm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, offsets: torch.Tensor,
                     design: str = DEFAULT_DESIGN, config: Optional[dict] = None) -> torch.Tensor:
    """x [T, K] sorted by expert, q [E, N, K], s [E, nb, kb], offsets int32 [E] cumulative ends -> [T, N]."""
    _check(x, q, s, design, "fp8_grouped_gemm", True)
    return _run(x, q, s, offsets, False, design, config)


def fp8_grouped_gemm_dgrad(dy: torch.Tensor, q: torch.Tensor, s: torch.Tensor, offsets: torch.Tensor,
                           design: str = DEFAULT_DESIGN, config: Optional[dict] = None) -> torch.Tensor:
    """dy [T, N] -> dx [T, K], expert e's rows times W_e."""
    _check(dy, q, s, design, "fp8_grouped_gemm_dgrad", True)
    return _run(dy, q, s, offsets, True, design, config)
