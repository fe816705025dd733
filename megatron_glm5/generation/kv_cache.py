"""GLM-5's generation cache: per layer and token the MLA key in latent form, and the lightning indexer's key.

MLA attends in the absorbed latent space (model/mla.py): every head's query meets one shared key row
``[latent | k_rope]`` (the kv_layernorm-ed 512-dim latent and the 64-dim roped key at full size), whose first 512
dims are also the values. So the cache holds that one row per token and layer, not per-head keys and values:
(512 + 64) x 2 bytes per token and layer in bf16. Full-indexer layers also cache the indexer's key (128 dims,
k_norm-ed and roped); IndexShare layers have no indexer and reuse, at each step, the top-k their source layer
computed in the same forward, exactly as in training.

Layout: one buffer [batch, max_len, D] per (layer_number, "kv" | "index"), megatron layer numbers (1-based).
Token p of batch row i lives in key row ``i * max_len + p`` of the buffer's flat view [batch * max_len, D], and a
query of row i at position p sees key rows ``i * max_len .. i * max_len + p`` (``key_start``/``query_end`` of
``AttentionInputs``). The attention ops read the flat view directly, so a step copies nothing but its new rows;
rows past a query's position (not yet written, or left by the right-padding of a shorter prompt) are outside
every window.

``CachedInputs`` is the ``AttentionInputs`` of a cached forward: the model's layers hand it their new key rows
through ``gather_keys(rows, cache_key)`` (the hook in model/mla.py and model/dsa.py); it writes them at their
positions and returns the whole flat buffer instead of the forward's own rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_glm5.model.attention_inputs import AttentionInputs
from megatron_glm5.model.rope import rope_angles

KV, INDEX = "kv", "index"


def cache_bytes_per_token(cfg, bytes_per_value: int = 2) -> int:
    """Bytes the cache holds per token for a GLM5Config (``bytes_per_value`` 2: bf16): every layer's
    ``[latent | k_rope]`` row plus the indexer key of each full-indexer layer (the MTP layer is not cached)."""
    kv = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
    index = cfg.index_head_dim * len(cfg.full_layers)
    return (kv + index) * bytes_per_value


class KVCache:
    """The key buffers of a model's decoder layers for ``batch`` rows of up to ``max_len`` tokens each."""

    def __init__(self, kv_layers, index_layers, batch: int, max_len: int, kv_dim: int, index_dim: int,
                 dtype: torch.dtype, device):
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_len >= 1, got {batch} and {max_len}")
        self.batch, self.max_len = int(batch), int(max_len)
        self.buffers: Dict[Tuple[int, str], torch.Tensor] = {}
        for layer in kv_layers:
            self.buffers[(layer, KV)] = torch.zeros(batch, max_len, kv_dim, dtype=dtype, device=device)
        for layer in index_layers:
            self.buffers[(layer, INDEX)] = torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        """A cache for ``model`` (a single-stage GLM5Model): one latent buffer per decoder layer, one indexer key
        buffer per full-indexer layer, in the model's params_dtype (the activations' dtype, the keys' too)."""
        cfg = model.config
        kv_layers, index_layers = [], []
        for layer in model.decoder.layers:
            attention = layer.self_attention
            kv_layers.append(attention.layer_number)
            if attention.core_attention.indexer is not None:
                index_layers.append(attention.layer_number)
        device = next(model.parameters()).device
        return cls(kv_layers, index_layers, batch, max_len, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim,
                   cfg.dsa_index_head_dim, cfg.params_dtype, device)

    def bytes_per_token(self) -> int:
        """Bytes held per cached token (all layers, one batch row)."""
        return sum(b.shape[-1] * b.element_size() for b in self.buffers.values())

    def store(self, cache_key, rows: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Write ``rows`` [s, b, D] (a forward's new keys) at ``position_ids`` [b, s]; the flat buffer
        [batch * max_len, D] that the attention ops read (rows of a batch row i start at i * max_len)."""
        buf = self.buffers.get(tuple(cache_key) if cache_key is not None else None)
        if buf is None:
            raise RuntimeError(f"the generation cache has no buffer for {cache_key!r} (built for another model?); "
                               f"it holds {sorted(self.buffers)}")
        b = rows.shape[1]
        if b != self.batch:
            raise RuntimeError(f"a cached forward of {b} rows against a cache of {self.batch}")
        batch_rows = torch.arange(b, device=buf.device)[:, None]
        buf[batch_rows, position_ids] = rows.transpose(0, 1).to(buf.dtype)
        return buf.view(self.batch * self.max_len, buf.shape[-1])


@dataclass
class CachedInputs(AttentionInputs):
    """AttentionInputs of a forward whose keys live in a ``KVCache`` (see the module doc)."""
    cache: Optional[KVCache] = None
    position_ids: Optional[torch.Tensor] = None  # [b, s]: where this forward's tokens sit in the cache

    def gather_keys(self, t: torch.Tensor, cache_key=None) -> torch.Tensor:
        if cache_key is None:
            raise RuntimeError("a cached forward needs every key gather named (AttentionInputs.gather_keys' "
                               "cache_key); a layer passed none")
        return self.cache.store(cache_key, t, self.position_ids)


def cached_inputs(cache: KVCache, position_ids: torch.Tensor, rope_dim: int, rope_theta: float) -> CachedInputs:
    """The CachedInputs of tokens at ``position_ids`` [b, s] (absolute positions, < cache.max_len): RoPE of
    those positions, and for the query at (i, p) the key window ``i * max_len .. i * max_len + p``."""
    b, s = position_ids.shape
    if b != cache.batch:
        raise ValueError(f"position_ids has {b} rows, the cache {cache.batch}")
    if position_ids.numel() and (int(position_ids.min()) < 0 or int(position_ids.max()) >= cache.max_len):
        raise ValueError(f"positions must lie in [0, {cache.max_len}) (the cache's length)")
    position_ids = position_ids.to(torch.int64)
    cos, sin = rope_angles(position_ids, rope_dim, rope_theta)
    row_start = torch.arange(b, device=position_ids.device, dtype=torch.int64)[:, None] * cache.max_len
    key_start = row_start.expand(b, s).reshape(-1)
    query_end = (row_start + position_ids).reshape(-1)
    return CachedInputs(cos=cos, sin=sin, key_start=key_start.contiguous(), query_end=query_end.contiguous(),
                        max_window=int(position_ids.max()) + 1, cache=cache, position_ids=position_ids)
