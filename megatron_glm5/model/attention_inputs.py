"""Per-forward inputs that every GLM-5 attention layer of one micro-batch shares.

megatron-core's MLA computes RoPE from sequence indices inside each layer and knows nothing of DSA. GLM-5 needs,
once per forward: the RoPE angles of the true token positions (for MLA and the indexer), the causal window of
every query in the flattened token layout the sparse kernels use, and a store where "full" indexer layers leave
their top-k for the IndexShare layers after them. ``GLM5Model`` builds one ``AttentionInputs`` per forward and
hands it to the decoder in megatron-core's ``rotary_pos_emb`` slot, which TransformerBlock and TransformerLayer
forward untouched to self-attention (and GPTModel to the MTP block). Keeping it per forward (not global) keeps
micro-batches of a pipeline schedule and activation recomputation apart.

Token layout: megatron activations are [s, b, ...]; attention works on T = b * s tokens flattened batch-major
(token t = i * s + p). For query t the allowed keys are rows key_start[t] .. query_end[t] (inclusive) of the
flattened key tensor: the query's own sequence (or packed document) up to itself.

Context parallelism (model/context_parallel.py): a rank holds s = S / cp tokens of each sequence of S. Queries
are its T = b * s local tokens (flattened as above); keys are all b * S tokens, gathered from every CP rank
by ``gather_keys`` and flattened batch-major in global order (key row i * S + global position). Windows, top-k
indices and the IndexShare store are rows of that global key tensor, the same rows as in a one-rank run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_glm5.model.context_parallel import gather_sequence, global_order, local_positions
from megatron_glm5.model.rope import rope_angles
from megatron_glm5.ops import host_windows


@dataclass
class AttentionInputs:
    cos: torch.Tensor  # [s, b, rope_dim/2] fp32
    sin: torch.Tensor
    key_start: torch.Tensor  # [T] int64
    query_end: torch.Tensor  # [T] int64
    max_window: int  # the longest window (keys of one query); computed once per forward, not per layer
    # IndexShare: megatron layer_number of a full-indexer layer -> its top-k indices [T, topk_width] (TOPK_DTYPE)
    topk_store: dict = field(default_factory=dict)
    # MTP: which application of the (repeated) MTP layer this is; the counter is shared by the per-step copies
    mtp_step: int = 0
    mtp_counter: list = field(default_factory=lambda: [0])
    # context parallelism: the CP group (None: one rank) and the global order of the all-gathered sequence
    cp_group: Optional[object] = None
    key_order: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.key_start.numel()

    def topk_width(self, index_topk: int) -> int:
        """Columns of this forward's top-k indices: ``index_topk`` (--dsa-index-topk), or fewer when no query has
        that many keys. The same on every rank and pipeline stage of a micro-batch (``max_window`` is global)."""
        return min(index_topk, self.max_window)

    def gather_keys(self, t: torch.Tensor, cache_key=None) -> torch.Tensor:
        """A per-token key tensor of this rank [s, b, ...] -> the token-flattened key rows [b * S, ...] of the
        whole sequence in global order (all-gathered over CP, gradient reduce-scattered back; S = s without CP).
        ``cache_key`` names the keys ((layer_number, "kv" | "index")): ignored here; generation's cache-aware
        inputs (generation/kv_cache.py) store the new rows under it and return the cached rows instead."""
        if self.cp_group is not None:
            t = gather_sequence(t, self.cp_group, self.key_order)
        return t.transpose(0, 1).reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def token_windows(batch: int, seq: int, cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                  cp_rank: int = 0, device=None):
    """(key_start [T], query_end [T], max_window) of CP rank ``cp_rank``'s T = batch * seq / cp_size query tokens
    over the batch * seq global key rows; ``seq`` is the global sequence length (see the module docstring).
    Built on the host from host-known values (a device cu_seqlens is copied once) and moved to ``device``
    asynchronously; ops/host_windows.py keeps the host copies, which the kernels' chunk planning reads."""
    t = torch.arange(batch * seq, dtype=torch.int64)  # every global token, batch-major
    if cu_seqlens is None:
        key_start = (t // seq) * seq
    else:
        if batch != 1:
            raise ValueError(f"packed sequences need micro-batch size 1 (got a batch of {batch})")
        cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
        if int(cu[-1]) != seq:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed sequence has {seq} tokens")
        doc = torch.searchsorted(cu, t, right=True) - 1
        key_start = cu[doc]
    # over all global tokens, so that every CP rank picks the same top-k width as a one-rank run
    max_window = int((t - key_start).max()) + 1 if t.numel() else 0
    if cp_size > 1:
        pos = local_positions(seq, cp_size, cp_rank)
        t = (torch.arange(batch)[:, None] * seq + pos[None, :]).reshape(-1)
        key_start = key_start[t]
    return host_windows.to_device(key_start, device), host_windows.to_device(t, device), max_window


def build_attention_inputs(
    position_ids: torch.Tensor,
    rope_dim: int,
    rope_theta: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_group=None,
) -> AttentionInputs:
    """position_ids [b, s] (this rank's tokens, global positions) -> AttentionInputs.

    ``cu_seqlens`` (packed sequences, b == 1): cumulative document lengths [n_docs + 1] of the whole (global)
    row; keys never cross a document boundary. Without it every row of the batch is one causal sequence.
    ``cp_group``: the context-parallel group (None or size 1: this rank holds whole sequences).
    """
    b, s = position_ids.shape
    device = position_ids.device
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    rank = 0 if cp == 1 else torch.distributed.get_rank(cp_group)
    cos, sin = rope_angles(position_ids, rope_dim, rope_theta)
    key_start, query_end, max_window = token_windows(b, s * cp, cu_seqlens, cp, rank, device=device)
    if cp == 1:
        return AttentionInputs(cos=cos, sin=sin, key_start=key_start, query_end=query_end, max_window=max_window)
    return AttentionInputs(cos=cos, sin=sin, key_start=key_start, query_end=query_end, max_window=max_window,
                           cp_group=cp_group, key_order=global_order(s * cp, cp, device=device))
