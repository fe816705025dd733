"""Rotary position embedding as GLM-5 applies it: interleaved pairs, one angle per pair.

GLM-5 rotates the last ``qk_rope_head_dim`` dims of every attention query, the shared RoPE key, and the first
``qk_rope_head_dim`` dims of the indexer's query and key. The pairs are interleaved, (x0, x1), (x2, x3), ...;
like transformers, the rotated result is written de-interleaved as [evens | odds]. Dot products do not depend on
that layout, only intermediate tensors do.

Angles are computed in fp32 from explicit position ids (so packed documents and context-parallel chunks get
their true positions) and the rotation is applied in fp32, the result cast back to the activation dtype.
(transformers casts cos/sin to bf16 first; at positions in the thousands that costs accuracy: in fp32 both are
the same, in bf16 ours stays closer to the fp32 result — docs/performance.md.)
"""
from __future__ import annotations

import torch

from megatron_glm5.model import fusions


def rope_angles(position_ids: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [s, b, rope_dim // 2] (fp32) for position_ids of shape [b, s]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=position_ids.device) / rope_dim))
    angles = position_ids.to(torch.float32).transpose(0, 1).unsqueeze(-1) * inv_freq  # [s, b, rope_dim/2]
    return angles.cos(), angles.sin()


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [s, b, ..., rope_dim] by angles [s, b, rope_dim/2]; returns [evens' | odds'] layout."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x32 = x.float()
    x_even, x_odd = x32[..., 0::2], x32[..., 1::2]
    return torch.cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1).to(x.dtype)


def interleaved_rope_grad(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``apply_interleaved_rope`` (for any x): dy [..., rope_dim] in the [evens' | odds'] layout ->
    dx in x's interleaved layout, the transposed rotation computed in fp32."""
    while cos.dim() < dy.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = dy.shape[-1] // 2
    d32 = dy.float()
    da, db = d32[..., :half], d32[..., half:]
    return torch.stack([da * cos + db * sin, db * cos - da * sin], dim=-1).flatten(-2).to(dy.dtype)


@fusions.region
def rope_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``x`` [..., D] with its first ``rope_dim`` dims rotated (the indexer's query and key), the rest unchanged."""
    return torch.cat([apply_interleaved_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
