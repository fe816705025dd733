"""CPU-only patch: megatron-core's gradient clipping without its CUDA-only assertion and buffer."""
from __future__ import annotations

import sys

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


def _clip_grad_cpu() -> bool:
    """CPU version of ``megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32``.

    Upstream asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` (an AssertionError
    with no message for every CPU fp32 grad) and allocates a ``device='cuda'`` overflow buffer
    for apex's multi_tensor_scale.  It is called by ``MegatronOptimizer.clip_grad_norm`` (and
    ``ChainedOptimizer``) whenever ``clip_grad > 0`` and the grad norm exceeds it.  The
    replacement keeps the dtype check (fp32 grads; fp32/bf16 decoupled grads) and scales the
    grads in place by ``min(1, max_norm / (total_norm + 1e-6))``.  Patched where the name is
    looked up: ``clip_grads`` and ``optimizer.optimizer`` (which imports it by name).
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            if use_decoupled_grad:
                grad = getattr(param, "decoupled_grad", None)
                if grad is None:
                    continue
                assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
            else:
                grad = param.grad
                if grad is None:
                    continue
                assert grad.dtype == torch.float32, f"expected fp32 main grads, got {grad.dtype}"
            grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        if grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grad_by_total_norm_fp32.__doc__ = clip_grads.clip_grad_by_total_norm_fp32.__doc__
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mimo = sys.modules.get("megatron.core.models.mimo.optimizer")
    if mimo is not None and hasattr(mimo, "clip_grad_by_total_norm_fp32"):
        mimo.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    return True


PATCHES = (
    Patch(
        name='clip_grad_cpu',
        site='megatron/core/optimizer/clip_grads.py clip_grad_by_total_norm_fp32',
        why='it asserts torch.cuda.FloatTensor grads and allocates a CUDA buffer',
        test='tests/test_platform.py::test_shim_is_needed[clip_grad_cpu]',
        phase=Phase.CPU, apply=_clip_grad_cpu),
)
