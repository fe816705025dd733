"""SwiGLU of the dense MLPs, the shared experts and the routed experts: ``silu(gate) * up`` on the concatenated
[gate | up] projection, the routed experts' rows weighted by their combine weight. One function for all three.

With ``--fusions`` on (model/fusions.py's :func:`~megatron_glm5.model.fusions.on`: the flag and a CUDA tensor) it
is our Triton kernel (ops/triton_swiglu.py: one pass each way, the [gate | up] gradient written in place of a
concatenation); otherwise eager torch, the weighted product in fp32 and cast back, as megatron-core's unfused
path computes it. The dense MLPs and the shared experts are megatron-core ``MLP`` modules: they call it through
their activation-module slot (:class:`GLM5SwiGLU`; megatron-core reads that slot when the config's
``use_te_activation_func`` is set, which ``--fusions auto`` does on a GPU: model/fusion_flags.py); the routed
experts (model/moe.py) call :func:`swiglu` directly.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_glm5.model import fusions

__all__ = ["swiglu", "GLM5SwiGLU"]


def _fused(y: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    from megatron_glm5.ops.triton_swiglu import swiglu as kernel

    return kernel(y, weights)


def swiglu(y: torch.Tensor, weights: Optional[torch.Tensor] = None, fuse: bool = False) -> torch.Tensor:
    """silu(y[..., :F]) * y[..., F:], times ``weights`` (one per row) when given; in y's dtype."""
    if fuse:
        return _fused(y, weights)
    gate, up = y.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if weights is None:
        return act
    return (act.float() * weights.float().reshape(act.shape[:-1] + (1,))).to(act.dtype)


class GLM5SwiGLU(torch.nn.Module):
    """megatron-core MLP's activation module (``MLPSubmodules.activation_func``): [.., 2F] -> [.., F]."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y, fuse=fusions.on(self.config, y))
