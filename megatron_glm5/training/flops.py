"""Model FLOPs of GLM-5 per trained token: the count MFU and TFLOP/s figures use.

Counted as matrix multiply-adds x 2 of the model's own math (not the absorbed form a kernel may use):
projections, attention scores and values per head at qk_head_dim / v_head_dim over the keys each query
attends to (top-k, or the causal window when shorter), the lightning indexer (its projections and its scores
over the whole causal window), dense MLPs, MoE (router, top-k routed experts, shared experts), the LM head and
the MTP layer(s). Training = 3x forward (backward is twice the forward). Elementwise work, norms, softmax and the
indexer loss are not counted.
"""
from __future__ import annotations


def _avg_keys(seq_len: int, topk: int | None) -> float:
    """Mean number of keys per query over causal positions 1..seq_len (capped at topk)."""
    if topk is None or topk >= seq_len:
        return (seq_len + 1) / 2
    # positions 1..topk see themselves fully, the rest see topk
    return (topk * (topk + 1) / 2 + (seq_len - topk) * topk) / seq_len


def layer_forward_flops(cfg, layer: int, seq_len: int, sparse: bool = True, moe=None, full_indexer=None) -> float:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    moe = cfg.mlp_layer_types[layer] == "sparse" if moe is None else moe
    full_indexer = cfg.indexer_types[layer] == "full" if full_indexer is None else full_indexer
    f = 2 * (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
             + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v) + heads * v * h)
    keys = _avg_keys(seq_len, cfg.index_topk if sparse else None)
    f += 2 * heads * keys * (qk + v)
    if full_indexer:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        f += 2 * (cfg.q_lora_rank * hi * di + h * di + h * hi) + 2 * hi * di * _avg_keys(seq_len, None)
    if moe:
        f += 2 * h * cfg.n_routed_experts
        f += 2 * 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    else:
        f += 2 * 3 * h * cfg.intermediate_size
    return f


def forward_flops_per_token(cfg, seq_len: int, sparse: bool = True, mtp_layers: int = 0) -> float:
    f = sum(layer_forward_flops(cfg, i, seq_len, sparse) for i in range(cfg.num_hidden_layers))
    f += 2 * cfg.hidden_size * cfg.vocab_size
    for _ in range(mtp_layers):
        f += 2 * 2 * cfg.hidden_size * cfg.hidden_size
        f += layer_forward_flops(cfg, 0, seq_len, sparse, moe=True, full_indexer=True)
        f += 2 * cfg.hidden_size * cfg.vocab_size
    return f


def training_flops_per_token(cfg, seq_len: int, sparse: bool = True, mtp_layers: int = 0) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len, sparse, mtp_layers)
