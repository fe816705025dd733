"""Order-independent sums through int64 fixed point: the deterministic mode of our sparse-MLA backward's dkv and
of the indexer KL's d_k_idx.

fp32 atomic adds give a result that depends on the order the adds land in; integer adds do not (integer addition
is associative).  So each fp32 contribution v is scaled by a power of two s, rounded to the nearest integer and
added into an int64 accumulator with integer atomics; the sum is read back as acc / s.  Every run adds the same
integers, so the result is bitwise the same whatever the order -- at the speed of atomics, with no sort and no
per-contribution buffer.

The scale comes from a bound B on the sum of the absolute values of an accumulator's contributions, computed on
the device before the kernel (no host synchronisation): s = 2^floor(FIXED_BITS - log2 B), so the magnitude of every
partial sum stays below 2^FIXED_BITS < 2^63 (no wrap-around) and the resolution is B / 2^FIXED_BITS.  For the sparse
MLA dkv (``sparse_mla_dkv_bound``; the indexer KL's d_k_idx: ``indexer_dk_bound``) B is loose by about n_q x h over a typical entry (2^21 at S 32768, 64 heads), so a
typical entry keeps about 40 bits: far below the fp32 result's and the bf16 gradient's own rounding.

A kernel that adds such contributions also raises a flag (int32, ``new_flag``) when one of them is not finite or
exceeds 2^FIXED_BITS (the bound did not hold: an lse that is not the forward's); ``decode`` then gives NaN for the
whole result instead of a silently wrapped one.  Non-finite inputs make B non-finite, with the same NaN result.
"""
from __future__ import annotations

import torch

FIXED_BITS = 62  # |partial sums| < 2^62 by the bound: one bit of headroom below int64's 2^63
MAX_EXPONENT = 120  # s <= 2^120 (B tiny or zero): v * s stays a finite fp32, 2^-120 a normal one
SAFETY = 1.0625  # the bound's margin for the 16-bit rounding of p and ds and fp32 rounding in the products


def scales(bound: torch.Tensor) -> torch.Tensor:
    """fp32 [2] on bound's device: (s, 1 / s) for a 0-dim bound B >= 0, s = 2^min(floor(FIXED_BITS - log2 B),
    MAX_EXPONENT); 1 / s is NaN when B is not finite (a non-finite input), so the decoded sum is NaN."""
    b = bound.to(torch.float32).reshape(())
    e = torch.floor(FIXED_BITS - torch.log2(b)).clamp(max=MAX_EXPONENT)  # B = 0: log2 -inf, e clamped
    e = torch.where(torch.isfinite(b), e, torch.zeros_like(e))
    inv = torch.where(torch.isfinite(b), torch.exp2(-e), torch.full_like(e, float("nan")))
    return torch.stack([torch.exp2(e), inv]).contiguous()


def sparse_mla_dkv_bound(q: torch.Tensor, kv: torch.Tensor, d_out_norms: torch.Tensor, delta: torch.Tensor,
                         softmax_scale: float, d_v: int) -> torch.Tensor:
    """A 0-dim fp32 bound on sum_{i,h} |contribution| of any dkv entry of sparse MLA's backward
    (dkv_j = sum_{i,h} ds_ijh q_ih, plus p_ijh dO_ih on the d_v latent columns), from the inputs alone:

        |ds_ijh| = p_ijh |dO_ih . v_j - delta_ih| scale <= p_ijh (N_ih V + |delta_ih|) scale,

    with N_ih = ||dO_ih||_2 (``d_out_norms``, [T, h]), V = max_j ||kv_j[:d_v]||_2 (Cauchy-Schwarz) and |dO_ihd| <= N_ih;
    p_ijh <= 1 (the lse is the forward's), so summed over the at most T x h (query, head) pairs

        B = T h max_ih [scale Q (N_ih V + |delta_ih|) + N_ih] x SAFETY,   Q = max |q|.

    delta: the backward's fp32 [T, h] rowsum(dO * O) - d_lse.  Reductions only (aminmax, amax): no copies of q."""
    n_q, h = q.shape[0], q.shape[1]
    if n_q * h == 0 or kv.shape[0] == 0:
        return torch.zeros((), dtype=torch.float32, device=q.device)
    lo, hi = torch.aminmax(q)
    q_abs = torch.maximum(lo.float().abs(), hi.float().abs())
    v_max = torch.linalg.vector_norm(kv[:, :d_v], dim=1, dtype=torch.float32).amax()
    n = d_out_norms.float()
    per_row = (float(softmax_scale) * q_abs * (n * v_max + delta.float().abs()) + n).amax()
    return per_row * (float(n_q * h) * SAFETY)


def indexer_dk_bound(q_idx: torch.Tensor, weights: torch.Tensor, idx_scale: float) -> torch.Tensor:
    """A 0-dim fp32 bound on sum_{t,h} |contribution| of any d_k_idx entry of the indexer KL
    (d_k_idx_j = sum_{t,h} da_thj q_idx_th, da_thj = g_tj w_th idx_scale where a_thj > 0): g = softmax(z) - target
    has |g_tj| <= 1 (both in [0, 1]), so summed over the at most T queries

        B = T idx_scale max_t (sum_h |w_th|) max |q_idx| x SAFETY."""
    n_q = q_idx.shape[0]
    if n_q == 0 or q_idx.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=q_idx.device)
    lo, hi = torch.aminmax(q_idx)
    q_abs = torch.maximum(lo.float().abs(), hi.float().abs())
    w_sum = weights.float().abs().sum(-1).amax()
    return q_abs * w_sum * (float(idx_scale) * n_q * SAFETY)


def new_flag(device) -> torch.Tensor:
    """The int32 flag a fixed-point kernel raises (atomic max to 1) for a contribution it could not add exactly."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def decode(acc: torch.Tensor, scale_pair: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """fp32 acc / s: the int64 accumulator read back (one rounding to fp32); NaN everywhere when the flag is raised
    or the bound was not finite."""
    inv = torch.where(flag.reshape(()) > 0, torch.full_like(scale_pair[1], float("nan")), scale_pair[1])
    return acc.to(torch.float32).mul_(inv)
