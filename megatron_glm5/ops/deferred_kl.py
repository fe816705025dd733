"""The sparse-stage indexer KL computed in the backward pass, from the head sums the sparse-MLA backward leaves.

The KL target P[t, j] = sum_h softmax_j (per query t and selected key j) is exactly what the sparse-MLA backward's
first kernel recomputes for every selected key (``triton_sparse_mla.sparse_mla_bwd(head_sums=)``), so computing it
again in the forward (``triton_kl.head_summed_probs``) is a second pass over the keys.  ``DeferredIndexerKL``
moves the KL to the backward, after that kernel:

* ``_DeferredKLLoss`` (forward: nothing computed) saves the indexer's q_idx, k_idx, weights and the top-k and
  returns a scalar token, 0; the caller attaches ``coeff * token`` to the attention output with megatron-core's
  ``MoEAuxLossAutoScaler`` exactly as it attaches the forward-time KL, so the token's gradient is the one that
  KL would get (coeff x ``main_loss_backward_scale``);
* ``_After`` (identity on the attention query q, no gradient for the token) makes q's consumer, the sparse MLA,
  depend on the token: autograd runs the token's backward only once the sparse-MLA backward has produced dq --
  and with it the head sums, handed to the job (``receive``);
* the token's backward then runs the fused indexer KL kernel (``kl_grads``, the backend's: value, n_tokens and the
  q_idx / k_idx / weights gradients), scales the gradients by the token's gradient (divided by the counted tokens
  for the mean, as the forward-time path's division does) and reports the mean KL (``on_value``: the layer's
  ``last_indexer_loss`` and log).  Under recompute the graph is built (and the KL counted) once, by the forward
  that runs with gradients.

Only torch here; the backend supplies the kernels.  Used by ``--attn triton`` (``TritonBackend.defer_kl``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["DeferredIndexerKL"]


class DeferredIndexerKL:
    """One layer's sparse-stage indexer KL, deferred to the backward (see the module docstring).

    kl_grads(q_idx, k_idx, weights, indices, head_sums) -> (kl_sum, n_tokens, d_q_idx, d_k_idx, d_weights), fp32,
    n_tokens a 0-dim tensor.  per_token: the token stands for the KL sum (``calculate_per_token_loss``), else for
    the mean over counted tokens.  on_value(mean KL, detached) is called once, in the backward."""

    def __init__(self, q_idx, k_idx, weights, indices, kl_grads: Callable, per_token: bool,
                 on_value: Optional[Callable[[torch.Tensor], None]] = None):
        self.kl_grads, self.per_token, self.on_value = kl_grads, bool(per_token), on_value
        self.head_sums: Optional[torch.Tensor] = None
        self.token = _DeferredKLLoss.apply(q_idx, k_idx, weights, indices, self)

    def order(self, q: torch.Tensor) -> torch.Tensor:
        """q for the sparse MLA, made to depend on the token (its backward waits for the sparse-MLA backward)."""
        return _After.apply(q, self.token)

    def receive(self, head_sums: torch.Tensor) -> None:
        """Called by the sparse-MLA backward with the KL target's head sums [T, topk] fp32."""
        self.head_sums = head_sums


class _After(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _DeferredKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, indices, job):
        ctx.save_for_backward(q_idx.detach(), k_idx.detach(), weights.detach(), indices)
        ctx.job = job
        return torch.zeros((), dtype=torch.float32, device=q_idx.device)

    @staticmethod
    def backward(ctx, grad):
        job = ctx.job
        if job is None:
            raise RuntimeError("deferred indexer KL: its backward ran a second time (retain_graph); the KL is "
                               "computed once per forward -- set GLM5_TRITON_DEFER_KL=0 for graphs run twice")
        # job -> token -> this node -> ctx -> job is a reference cycle: broken here, so that the step's graph and
        # the job are freed by reference counting instead of waiting for Python's cyclic collector (whose full
        # collections took ~11 ms of host time inside a proxy step on the H200, 2026-12-01)
        ctx.job, job.token = None, None
        head_sums, job.head_sums = job.head_sums, None
        if head_sums is None:
            raise RuntimeError("deferred indexer KL: the sparse-MLA backward did not hand over its head sums "
                               "(the query passed to sparse_mla must be DeferredIndexerKL.order(q))")
        q_idx, k_idx, weights, indices = ctx.saved_tensors
        kl_sum, n_tokens, d_qi, d_ki, d_w = job.kl_grads(q_idx, k_idx, weights, indices, head_sums)
        n = n_tokens.clamp_min(1)
        if job.on_value is not None:
            job.on_value((kl_sum / n).detach())
        g = grad if job.per_token else grad / n
        need = ctx.needs_input_grad
        return (
            (d_qi.to(q_idx.dtype) * g).to(q_idx.dtype) if need[0] else None,
            (d_ki.to(k_idx.dtype) * g).to(k_idx.dtype) if need[1] else None,
            (d_w.to(weights.dtype) * g).to(weights.dtype) if need[2] else None,
            None,
            None,
        )
