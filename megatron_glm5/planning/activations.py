"""Activation memory of one decoder layer per token: an estimate from the tensors the layers keep for backward.

The terms follow this project's layers (model/mla.py absorbed MLA, model/dsa.py indexer, model/moe.py grouped
experts, megatron-core's MLP and embedding / loss) in bf16 (2 bytes; fp32 where the code computes in fp32).
Per token of one micro-batch on one rank; ``tp`` divides head-split tensors, sequence parallelism (on whenever
--tp > 1) divides the token-split ones.  This is an ESTIMATE: a calibration table (calibration.py) measured by
benchmarks/calibrate_layers.py replaces it where it has a row.
"""
from __future__ import annotations

from typing import Dict, Iterable

BF16, FP32, INDEX = 2, 4, 4  # top-k indices are int32


def attention_terms(cfg, tp: int, full_indexer: bool) -> Dict[str, float]:
    """Bytes per token kept by the attention block, by tensor (model/mla.py's names)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads / tp
    qlr, lat, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    t = {
        "input_layernorm in/out": 2 * h / tp * BF16,
        "x gathered (q/kv down-proj input)": h * BF16,
        "q_c, q_resid": 2 * qlr * BF16,
        "q, q_rope": nh * (cfg.qk_head_dim + rope) * BF16,
        "q_lat, q_abs": nh * (lat + lat + rope) * BF16,
        "kv_c, latent, k_rope, kv": (2 * (lat + rope) + lat + rope) * BF16,
        "out_lat, out, lse": (nh * lat + 2 * nh * cfg.v_head_dim) * BF16 + nh * FP32,
        "linear_proj out, residual": 2 * h / tp * BF16,
    }
    if full_indexer:
        t["indexer q, k, weights"] = (cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim) * BF16 \
            + cfg.index_n_heads * FP32
        t["indexer top-k indices"] = cfg.index_topk * INDEX
    return t


def mlp_terms(cfg, tp: int, etp: int, moe: bool) -> Dict[str, float]:
    """Bytes per token kept by the MLP block (tokens split over TP under sequence parallelism)."""
    h = cfg.hidden_size
    t = {"pre_mlp_layernorm in/out": 2 * h / tp * BF16}
    if not moe:
        i = cfg.intermediate_size / tp
        t["fc1 out, act out, fc2 out"] = (2 * i + i) * BF16 + h / tp * BF16
        return t
    k, e, mi = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.moe_intermediate_size / etp
    t["router logits, scores, top-k"] = (2 * e * FP32 + k * (8 + FP32)) / tp
    t["dispatched tokens (fc1 in)"] = k * h * BF16 / tp
    t["expert fc1 out, act out"] = k * 3 * mi * BF16 / tp
    t["expert fc2 out, combine"] = (k * h + h) * BF16 / tp
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts / tp
    if shared:
        t["shared expert fc1 out, act out, out"] = (3 * shared + h / tp) * BF16
    return t


def layer_bytes_per_token(cfg, tp: int, etp: int, moe: bool, full_indexer: bool) -> float:
    """Everything one layer keeps for backward when it is not recomputed."""
    return sum(attention_terms(cfg, tp, full_indexer).values()) + sum(mlp_terms(cfg, tp, etp, moe).values())


def layer_input_bytes_per_token(cfg, tp: int) -> float:
    """What full recompute keeps per layer: its input [s/tp, h] in bf16."""
    return cfg.hidden_size / tp * BF16


def dispatch_buffer_bytes_per_token(cfg, tp: int) -> float:
    """The token dispatcher's transient send + receive copies of the routed tokens during one MoE layer (alltoall:
    permuted input and its received copy, the same on the way back), beyond the kept tensors."""
    return 2 * cfg.num_experts_per_tok * cfg.hidden_size * BF16 / tp


def loss_bytes_per_token(cfg, tp: int, heads: int) -> float:
    """The LM head(s) (main + MTP) per token over V/tp columns: megatron-core's vocabulary-parallel cross-entropy
    takes ``logits.float()`` and keeps its softmax (fp32, computed in place) for backward, so each head keeps 4
    bytes; the bf16 logits (2 bytes) live only while the fp32 copy is made, and in backward the fp32 gradient is
    the softmax buffer itself, cast back to bf16 (2 bytes) for the output layer."""
    return cfg.vocab_size / tp * (FP32 * heads + BF16)


def recomputed_layers(n_layers: int, granularity, method, num_layers) -> Iterable[bool]:
    """Per layer of a stage: True when full recompute covers it (uniform: every layer, in groups of num_layers;
    block: the first num_layers of the stage)."""
    for j in range(n_layers):
        if granularity != "full":
            yield False
        elif method == "block":
            yield j < num_layers
        else:
            yield True
