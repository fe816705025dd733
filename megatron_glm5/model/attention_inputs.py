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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_glm5.model.rope import rope_angles


@dataclass
class AttentionInputs:
    cos: torch.Tensor  # [s, b, rope_dim/2] fp32
    sin: torch.Tensor
    key_start: torch.Tensor  # [T] int64
    query_end: torch.Tensor  # [T] int64
    max_window: int  # the longest window (keys of one query); computed once per forward, not per layer
    # IndexShare: megatron layer_number of a full-indexer layer -> its top-k indices [T, topk] (int32, -1 unused)
    topk_store: dict = field(default_factory=dict)
    # MTP: which application of the (repeated) MTP layer this is; the counter is shared by the per-step copies
    mtp_step: int = 0
    mtp_counter: list = field(default_factory=lambda: [0])

    @property
    def num_tokens(self) -> int:
        return self.key_start.numel()


def build_attention_inputs(
    position_ids: torch.Tensor,
    rope_dim: int,
    rope_theta: float,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> AttentionInputs:
    """position_ids [b, s] -> AttentionInputs.

    ``cu_seqlens`` (packed sequences, b == 1): cumulative document lengths [n_docs + 1]; keys never cross a
    document boundary. Without it every row of the batch is one causal sequence.
    """
    b, s = position_ids.shape
    device = position_ids.device
    cos, sin = rope_angles(position_ids, rope_dim, rope_theta)
    t = torch.arange(b * s, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        key_start = (t // s) * s
    else:
        if b != 1:
            raise ValueError(f"packed sequences need micro-batch size 1 (got a batch of {b})")
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        if int(cu[-1]) != s:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed sequence has {s} tokens")
        doc = torch.searchsorted(cu, t, right=True) - 1
        key_start = cu[doc]
    max_window = int((t - key_start).max()) + 1 if t.numel() else 0
    return AttentionInputs(cos=cos, sin=sin, key_start=key_start, query_end=t, max_window=max_window)
