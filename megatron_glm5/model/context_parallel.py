"""Context parallelism (CP) for GLM-5 with DSA: which tokens a CP rank holds, and how it sees everyone's keys.

Layout (megatron-core's load-balanced causal split): a sequence of S tokens is cut into 2 * cp equal chunks and
CP rank r holds chunks r and 2cp-1-r, in that order, so every rank gets the same amount of causal attention
work. Every [b, s] input (tokens, labels, loss mask, position ids) is split the same way; position ids keep
their global values. Packed micro-batches (one THD row, ``cu_seqlens``) are split the same way, as one row:
document boundaries may fall anywhere inside a chunk, and the attention windows come from the global
``cu_seqlens`` (megatron-core's per-sequence balancing; per-document splitting would need every document
padded to a multiple of 2 * cp).

Attention: a rank's queries need the keys of every earlier token, wherever it lives. The two key tensors of a
layer — the lightning indexer's keys and MLA's latent ``[latent | k_rope]`` (RoPE already applied with the
global positions) — are all-gathered over the CP group and put back into global token order; windows,
top-k indices and IndexShare's stored indices are rows of that global key tensor. The gather's backward
reduce-scatters: each rank gets its own rows of the gradient summed over all ranks' queries.

MTP: for --cp > 1 build_model replaces megatron-core's MTP token roll by one that shifts the gathered global
sequence (``roll_left``) and keeps MTP's per-token loss scale global (patch ``mtp_roll_tensor_cp``,
mcore_patches/mtp_roll.py).

Pure index arithmetic lives here (testable without processes); ``AttentionInputs`` holds the per-forward
result and ``training/data.py`` slices the batches.
"""
from __future__ import annotations

import torch

from megatron_glm5.errors import UserError


class ContextParallelUnsupported(UserError, ValueError):
    """A feature combined with --cp > 1 that context parallelism does not handle (yet)."""


def local_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions (int64 [seq_len // cp_size]) of the tokens CP rank ``cp_rank`` holds, in its order."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence of {seq_len} tokens is not divisible by 2 x --cp {cp_size} = {2 * cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} outside 0..{cp_size - 1}")
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def default_position_ids(input_ids: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Position ids [b, s] for ``input_ids`` [b, s] given without them: 0..s-1, or under context parallelism (the
    ids are this rank's load-balanced chunks of a sequence cp_size times longer) their global positions."""
    s = input_ids.shape[1]
    if cp_size == 1:
        pos = torch.arange(s, device=input_ids.device)
    else:
        pos = local_positions(s * cp_size, cp_size, cp_rank, device=input_ids.device)
    return pos.expand_as(input_ids)


def global_order(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """int64 [seq_len]: the row of the rank-major all-gathered sequence (rank 0's tokens, then rank 1's, ...)
    that holds each global position, i.e. ``global = gathered[global_order]``."""
    gathered_pos = torch.cat([local_positions(seq_len, cp_size, r, device) for r in range(cp_size)])
    order = torch.empty_like(gathered_pos)
    order[gathered_pos] = torch.arange(seq_len, device=device)
    return order


def split_for_cp_rank(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``t`` along the sequence dimension ``dim`` (global length, divisible by 2 * cp)."""
    if cp_size == 1:
        return t
    idx = local_positions(t.shape[dim], cp_size, cp_rank, device=t.device)
    return t.index_select(dim, idx)


def gather_sequence(t: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """t [s_local, ...] of every CP rank -> [s_local * cp, ...] in global token order.

    Forward: all-gather over ``group``; backward: reduce-scatter (each rank its rows of the summed gradient)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(t.contiguous(), tensor_parallel_output_grad=True, group=group)
    return gathered.index_select(0, order)


def _gather_global(t: torch.Tensor, group) -> torch.Tensor:
    """[..., s_local] of every CP rank -> [..., S] in global order (no autograd: token ids and masks)."""
    cp = torch.distributed.get_world_size(group)
    src = t.to(torch.uint8) if t.dtype == torch.bool else t
    parts = [torch.empty_like(src) for _ in range(cp)]
    torch.distributed.all_gather(parts, src.contiguous(), group=group)
    full = torch.cat(parts, dim=-1)
    return full.index_select(-1, global_order(full.shape[-1], cp, device=full.device)).to(t.dtype)


def roll_left(t: torch.Tensor, group, cu_seqlens=None):
    """MTP's one-token left shift of this rank's [..., s_local] tokens in global order: token g takes the value
    of token g + 1, and the last token of every sequence (every document of a packed row, ``cu_seqlens`` global)
    takes 0. Returns (local rolled, global tensor, global rolled)."""
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    full = _gather_global(t, group)
    seq = full.shape[-1]
    rolled = torch.roll(full, shifts=-1, dims=-1)
    ends = torch.tensor([seq], device=full.device) if cu_seqlens is None else cu_seqlens[1:].to(full.device)
    rolled[..., ends.long() - 1] = 0
    return rolled.index_select(-1, local_positions(seq, cp, rank, device=full.device)), full, rolled


def check_context_parallel(tcfg) -> None:
    """Refuse what context parallelism does not handle, naming the flags."""
    if tcfg.context_parallel_size == 1 or not tcfg.mtp_num_layers:
        return
    if tcfg.mtp_num_layers > 1:
        raise ContextParallelUnsupported(
            f"--cp {tcfg.context_parallel_size} with --mtp-steps {tcfg.mtp_num_layers} (MTP layers/steps): the MTP "
            "loss scale is exact under context parallelism for one MTP step only; use --mtp-steps 1 or --cp 1")
