"""The LM cross entropy under ``--fusions auto`` on a GPU: megatron-core's vocabulary-parallel cross entropy, the
same formulas, in three compiled regions (model/fusions.py) that read the logits in their own dtype.

megatron-core's ``vocab_parallel_cross_entropy`` (the unfused path) copies GLM-5's bf16 logits to fp32 (2.4 GiB at
4096 tokens x 154,880 entries), subtracts the max, exponentiates, divides and keeps that fp32 softmax for the
backward, which subtracts the one-hot, multiplies by the incoming gradient and copies the result back to bf16:
about eight full passes over the [tokens, vocab] tensor, 10.7 ms of elementwise kernels per 4096-token step on the
H200 (docs/performance.md). Here:

* forward: region 1 -- each row's max over this rank's vocabulary shard (fp32 of the logits, never stored);
  all-reduced (MAX) over the tensor-parallel group; region 2 -- the sum of exp(x - max) and the target's x - max
  (0 where the label lies outside the shard), all-reduced (SUM); loss = log(sum) - target term, as megatron-core's
  (a label in no shard gives log(sum), as there).  Kept for the backward: the logits themselves (their own dtype),
  the max and the sum ([tokens] fp32 each) -- not an fp32 softmax.
* backward: region 3 -- (exp(x - max) / sum - one-hot) x the per-token gradient, in fp32, rounded once to the
  logits' dtype: one read of the logits, one write of their gradient.

``fuse=False`` runs the same functions eagerly (the CPU path and the tests); the model calls it through
``GLM5Model.compute_language_model_loss`` when ``fusions.on`` (``--fusions auto`` on a CUDA tensor) and
``--cross-entropy-fusion none`` (``chunked``, model/linear_cross_entropy.py, never forms the logits at all).
"""
from __future__ import annotations

import torch

from megatron_glm5.model import fusions, linear_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]


@fusions.region
def _row_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(-1)


@fusions.region
def _row_sums(logits: torch.Tensor, row_max: torch.Tensor, local_target: torch.Tensor):
    """(sum_j exp(x_j - max), x[target] - max or 0 where the target is outside this shard), fp32 [N] each."""
    width = logits.shape[-1]
    inside = (local_target >= 0) & (local_target < width)
    sum_exp = torch.exp(logits.float() - row_max.unsqueeze(-1)).sum(-1)
    picked = torch.gather(logits, -1, local_target.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1).float() - row_max
    return sum_exp, torch.where(inside, picked, torch.zeros_like(picked))


@fusions.region
def _logits_grad(logits: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
    width = logits.shape[-1]
    p = torch.exp(logits.float() - row_max.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    cols = torch.arange(width, device=logits.device)
    hit = (cols == local_target.unsqueeze(-1)).to(p.dtype)  # no column matches a target outside the shard
    return ((p - hit) * grad.float().unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group, fuse):
        group, rank, _ = linear_cross_entropy.tp_shard(group)
        local_target = target - rank * logits.shape[-1]
        row_max = _row_max(logits, fuse=fuse)
        if group is not None:
            torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=group)
        sum_exp, picked = _row_sums(logits, row_max, local_target, fuse=fuse)
        if group is not None:
            torch.distributed.all_reduce(picked, group=group)
            torch.distributed.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(logits, row_max, sum_exp, local_target)
        ctx.fuse = fuse
        return torch.log(sum_exp) - picked

    @staticmethod
    def backward(ctx, grad):
        logits, row_max, sum_exp, local_target = ctx.saved_tensors
        return _logits_grad(logits, row_max, sum_exp, local_target, grad.contiguous(), fuse=ctx.fuse), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 fuse: bool = True) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``target``) of logits [..., V/tp] (this rank's vocabulary shard, as the
    output layer returns it) and target [...] global vocabulary ids: megatron-core's
    ``tensor_parallel.vocab_parallel_cross_entropy`` without its fp32 copies; see the module docstring."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"cross entropy: logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    loss = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), tp_group, bool(fuse))
    return loss.view(target.shape)
