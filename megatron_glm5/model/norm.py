"""RMSNorm computed exactly as transformers' GLM-5 does: fp32 statistics, cast back, then times the weight."""
from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_glm5.model import fusions
from megatron_glm5.model.params import param_device


@fusions.region
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)): statistics in fp32, the normalised x cast back to x's dtype before the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class GLM5RMSNorm(MegatronModule):
    """A megatron-core LayerNormBuilder: ``GLM5RMSNorm(config=, hidden_size=, eps=)``.

    ``sequence_parallel``: the norm sees a sequence-parallel shard, so its weight gradient is partial on each
    tensor-parallel rank and megatron-core's finalize_model_grads sums it over TP. Norms applied to full,
    already-gathered sequences (MLA's latent norms) pass ``sequence_parallel=False``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool | None = None):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=param_device(config)))
        sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
        setattr(self.weight, "sequence_parallel", sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, fuse=fusions.on(self.config, x))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def latent_rms_norm(config, hidden_size: int, eps: float = None) -> GLM5RMSNorm:
    """Builder for MLA's q_a / kv_a norms: GLM-5's own eps (1e-6, not rms_norm_eps), applied to full sequences.

    GLM5MLASelfAttention applies them to the full, TP-replicated latents and sums the gradients of their outputs
    over TP (copy_to_tensor_model_parallel_region), so every TP rank already holds the complete weight gradient.
    megatron-core's finalize_model_grads would still SUM the grads of parameters named ``*q_layernorm*`` over TP
    (``config.qk_layernorm``; meant for its own MLA, whose q norm sees a sequence-parallel shard) and so double
    q_layernorm's gradient at TP2. ``average_gradients_across_tp_domain`` takes precedence there: averaging equal
    gradients leaves them unchanged.
    """
    norm = GLM5RMSNorm(config, hidden_size, eps=config.latent_norm_eps, sequence_parallel=False)
    norm.weight.average_gradients_across_tp_domain = True
    return norm
