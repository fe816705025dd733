"""``--cross-entropy-fusion chunked`` (the flag: model/cross_entropy_flags.py): the output layer and the LM cross
entropy without materialising the logits.

GLM-5's vocabulary has 154,880 entries: at 4096 tokens the unfused path (``--cross-entropy-fusion none``, the
default: megatron-core's output layer, then ``vocab_parallel_cross_entropy``) keeps bf16 logits (1.2 GiB) and the
fp32 softmax (2.4 GiB) alive from the forward to the backward (under ``--fusions auto`` on a GPU the logits only:
model/fused_cross_entropy.py).  megatron-core 0.19.2 has no linear + cross entropy
fusion outside Transformer Engine; its ``fused_vocab_parallel_cross_entropy`` (cross_entropy_fusion_impl "native")
still materialises the logits, and in the tiny model on a CPU (fp32) its gradients differed from the unfused path's
by up to 0.5 % of each tensor's largest entry (the loss agreed to 1e-5), so it is not offered.

``ChunkedLinearCrossEntropy``: over slices of the vocabulary (``CHUNK_BYTES`` of fp32 logits each) the forward
computes the slice's logits (the output GEMM in the weight dtype, then fp32, as the unfused path), keeps a running
max and sum of exponentials per token and picks the target logits; under tensor parallelism these are combined over
the group as megatron-core's VocabParallelCrossEntropy does (max all-reduced, then the rescaled sums and the target
logit).  Only the per-token loss and log-sum-exp are kept.  The backward recomputes each slice's logits (one more
output GEMM: the price of not keeping them), forms (softmax - one-hot) x the incoming per-token gradient in fp32,
rounds it to the weight dtype, writes that slice of the output weight's gradient (once, no accumulator) and adds
its part of the hidden states' gradient into an fp32 [tokens, hidden] sum.  Slicing over tokens instead needs an
fp32 accumulator of the whole weight gradient (3.7 GiB for GLM-5): measured on the H200 at 4096 tokens it took
9.2 GiB above the inputs against the unfused path's 4.8, and 89 ms against 42 (docs/performance.md).  Sequence
parallelism and the tensor-parallel input gradient go through megatron-core's region functions, as in
ColumnParallelLinear.

The main LM head only: megatron-core's MTP loss (``process_mtp_loss``) computes its logits itself.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

__all__ = ["CHUNK_BYTES", "ChunkedLinearCrossEntropy", "chunked_linear_cross_entropy", "output_processor", "tp_shard"]

#: fp32 logits held at once (a [tokens, CHUNK_BYTES / 4 / tokens] slice of the vocabulary: 5 slices of GLM-5's
#: 154,880 entries at 4096 tokens)
CHUNK_BYTES = 512 << 20


def tp_shard(group):
    """(group, this rank, world size) of a vocabulary-parallel group; (None, 0, 1) without one (or of one rank)."""
    if group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return None, 0, 1
    return group, torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _slice_logits(hidden, weight, v0, v1):
    """fp32 logits of vocabulary rows v0:v1, rounded through the weight dtype as the unfused output layer's are."""
    return torch.matmul(hidden, weight[v0:v1].t()).float()


def _targets_in(labels, start, width):
    """(rows, columns) of the tokens whose label lies in vocabulary columns start:start+width."""
    local = labels - start
    rows = torch.nonzero((local >= 0) & (local < width)).squeeze(1)
    return rows, local[rows]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss [N] fp32 = logsumexp(h W^T) - (h W^T)[label] over the full (vocab-parallel) vocabulary, computed over
    slices of ``chunk`` vocabulary rows: the forward keeps a running max and sum of exponentials per token (then
    all-reduces them over the tensor-parallel group), the backward recomputes each slice's logits and writes that
    slice of the weight gradient once, accumulating the hidden states' gradient over the slices in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, tp_group, chunk):
        group, rank, _ = tp_shard(tp_group)
        n, v_local = hidden.shape[0], weight.shape[0]
        offset = rank * v_local
        m = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        sum_exp = torch.zeros_like(m)
        target = torch.zeros_like(m)
        for v0 in range(0, v_local, chunk):
            v1 = min(v_local, v0 + chunk)
            logits = _slice_logits(hidden, weight, v0, v1)
            rows, cols = _targets_in(labels, offset + v0, v1 - v0)
            target[rows] = logits[rows, cols]
            m_new = torch.maximum(m, logits.max(dim=-1).values)
            sum_exp = sum_exp * torch.exp(m - m_new) + logits.sub_(m_new.unsqueeze(1)).exp_().sum(dim=-1)
            m = m_new
        if group is not None:
            m_all = m.clone()
            torch.distributed.all_reduce(m_all, op=torch.distributed.ReduceOp.MAX, group=group)
            stats = torch.stack([sum_exp * torch.exp(m - m_all), target])
            torch.distributed.all_reduce(stats, group=group)
            m, (sum_exp, target) = m_all, stats
        lse = m + torch.log(sum_exp)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.offset, ctx.chunk = offset, chunk
        return lse - target

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        v_local = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        scale = grad_loss.float().unsqueeze(1)
        for v0 in range(0, v_local, ctx.chunk):
            v1 = min(v_local, v0 + ctx.chunk)
            g = _slice_logits(hidden, weight, v0, v1)
            g.sub_(lse.unsqueeze(1)).exp_()  # softmax over the full vocabulary
            rows, cols = _targets_in(labels, ctx.offset + v0, v1 - v0)
            g[rows, cols] -= 1.0
            g = g.mul_(scale).to(weight.dtype)
            if need_w:
                grad_w[v0:v1] = torch.matmul(g.t(), hidden)
            if need_h:
                grad_h += torch.matmul(g, weight[v0:v1]).float()
        return None if grad_h is None else grad_h.to(hidden.dtype), grad_w, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tp_group=None,
                                 chunk: Optional[int] = None) -> torch.Tensor:
    """Per-token loss with hidden [..., H] local to this tensor-parallel rank's vocabulary shard weight [V/tp, H]
    (the input already gathered / copied to the region), labels [...] global vocabulary ids; shape of labels.
    chunk: vocabulary rows per slice (default: CHUNK_BYTES of fp32 logits)."""
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (4 * max(1, h.shape[0])))
    loss = ChunkedLinearCrossEntropy.apply(h, weight, labels.reshape(-1), tp_group, int(chunk))
    return loss.view(shape)


def output_processor(hidden_states, output_layer, output_weight, labels, config, **unused):
    """GPTModel._postprocess's ``output_processor`` hook: the per-token LM loss [b, s] from hidden_states [s, b, H]
    through ``output_layer`` (megatron-core's ColumnParallelLinear, no bias) and ``chunked_linear_cross_entropy``."""
    weight = output_layer.weight if output_weight is None else output_weight
    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True,
                                                             group=group)
    else:
        hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    loss = chunked_linear_cross_entropy(hidden_states, weight, labels.transpose(0, 1), tp_group=group)
    return loss.transpose(0, 1).contiguous()
