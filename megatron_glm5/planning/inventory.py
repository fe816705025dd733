"""The parameter tensors one model chunk of one rank holds, in megatron-core's registration order.

Each tensor is (name, numel on this rank, kind, expert) where kind is one of KINDS: "dense" (attention, norms, dense
MLPs, shared experts, routers), "experts" (the routed experts: expert-parallel, sharded over the expert
data-parallel group), "embedding" (input embedding and output head) and "mtp" (the MTP block, its routed experts
included).  The sizes come from the model's own configuration: every layer's tensors are checked against
:meth:`GLM5Config.layer_parameters` (and the MTP block against :meth:`GLM5Config.mtp_parameters`) at tensor-parallel
size 1, so this module only says how a layer's parameters are cut into tensors and which of them tensor and expert
parallelism split; tests/test_planner.py compares the result with the tensors megatron-core builds.

Split rules (the layer specs of model/spec.py, megatron-core 0.19.2 local modules): every ColumnParallelLinear /
RowParallelLinear (the four MLA projections and linear_proj, dense and shared-expert MLPs, eh_proj) and the
vocabulary-parallel embedding / output layer are divided by --tp; norms, the DSA indexer (plain torch Linear) and
the router are replicated; routed experts are divided by --ep (experts) and --etp (their width).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

KINDS = ("dense", "experts", "embedding", "mtp")


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    kind: str
    expert: bool = False  # expert-parallel (megatron's allreduce=False): its own buffer, the expert-DP group
    shared_embedding: bool = False  # megatron puts it in a bucket of its own


@dataclass(frozen=True)
class Split:
    tp: int = 1
    ep: int = 1
    etp: int = 1


def _layer(cfg, i: Optional[int], split: Split, prefix: str, kind: str, moe: bool, full: bool) -> List[Tensor]:
    """One decoder layer: HF layer ``i`` (None: the MTP layer, MoE with its own indexer)."""
    h, nh, tp = cfg.hidden_size, cfg.num_attention_heads, split.tp
    qlr, kvlr, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    a = prefix + "self_attention."
    out = [Tensor(prefix + "input_layernorm.weight", h, kind)]
    if full:
        ix = a + "core_attention.indexer."
        out += [Tensor(ix + "linear_wq_b.weight", qlr * ih * idim, kind), Tensor(ix + "linear_wk.weight", h * idim, kind),
                Tensor(ix + "k_norm.weight", idim, kind), Tensor(ix + "k_norm.bias", idim, kind),
                Tensor(ix + "linear_weights_proj.weight", h * ih, kind)]
    out += [Tensor(a + "linear_proj.weight", nh * cfg.v_head_dim * h // tp, kind),
            Tensor(a + "linear_q_down_proj.weight", h * qlr // tp, kind),
            Tensor(a + "linear_q_up_proj.weight", qlr * nh * cfg.qk_head_dim // tp, kind),
            Tensor(a + "linear_kv_down_proj.weight", h * (kvlr + rope) // tp, kind),
            Tensor(a + "linear_kv_up_proj.weight", kvlr * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp, kind),
            Tensor(a + "q_layernorm.weight", qlr, kind), Tensor(a + "kv_layernorm.weight", kvlr, kind),
            Tensor(prefix + "pre_mlp_layernorm.weight", h, kind)]
    m = prefix + "mlp."
    if moe:
        e_local, mi = cfg.n_routed_experts // split.ep, cfg.moe_intermediate_size // split.etp
        ekind = "mtp" if kind == "mtp" else "experts"
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        out += [Tensor(m + "router.weight", cfg.n_routed_experts * h, kind),
                Tensor(m + "experts.weight1", e_local * 2 * mi * h, ekind, expert=True),
                Tensor(m + "experts.weight2", e_local * h * mi, ekind, expert=True)]
        if shared:
            out += [Tensor(m + "shared_experts.linear_fc1.weight", 2 * shared * h // tp, kind),
                    Tensor(m + "shared_experts.linear_fc2.weight", shared * h // tp, kind)]
    else:
        out += [Tensor(m + "linear_fc1.weight", 2 * cfg.intermediate_size * h // tp, kind),
                Tensor(m + "linear_fc2.weight", cfg.intermediate_size * h // tp, kind)]
    if split == Split() and i is not None:
        _check(sum(t.numel for t in out), cfg.layer_parameters(i), f"layer {i}")
    return out


def _check(got: int, want: int, what: str) -> None:
    if got != want:
        raise AssertionError(f"planning/inventory.py cuts {what} into {got} parameters, GLM5Config counts {want}: "
                             "the two disagree (a layer changed in config.py and not here)")


def mtp_tensors(cfg, split: Split) -> List[Tensor]:
    h, p = cfg.hidden_size, "mtp.layers.0."
    out = [Tensor(p + "enorm.weight", h, "mtp"), Tensor(p + "hnorm.weight", h, "mtp"),
           Tensor(p + "eh_proj.weight", 2 * h * h // split.tp, "mtp")]
    out += _layer(cfg, None, split, p + "mtp_model_layer.", "mtp", moe=True, full=True)
    out.append(Tensor(p + "final_layernorm.weight", h, "mtp"))
    if split == Split():
        _check(sum(t.numel for t in out), cfg.mtp_parameters() // max(cfg.num_nextn_predict_layers, 1), "the MTP layer")
    return out


def chunk_tensors(cfg, layers: range, split: Split, *, pre_process: bool, post_process: bool, mtp: bool,
                  shared_embedding: bool) -> List[Tensor]:
    """The parameters of one model chunk: HF layers ``layers``, the embedding when ``pre_process`` (or ``mtp``:
    megatron-core builds one on the MTP stage too, tied to the first stage's), the final norm and output layer when
    ``post_process``, the MTP block when ``mtp``.  ``shared_embedding``: the embedding is kept in sync with another
    stage's copy (megatron-core's shared_embedding attribute)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: List[Tensor] = []
    if pre_process or mtp:
        out.append(Tensor("embedding.word_embeddings.weight", v * h // split.tp, "embedding",
                          shared_embedding=shared_embedding))
    for j, i in enumerate(layers):
        out += _layer(cfg, i, split, f"decoder.layers.{j}.", "dense", moe=cfg.is_moe_layer(i),
                      full=cfg.is_full_indexer_layer(i))
    if post_process:
        out.append(Tensor("decoder.final_layernorm.weight", h, "dense"))
    if mtp:
        out += mtp_tensors(cfg, split)
    if post_process:
        out.append(Tensor("output_layer.weight", v * h // split.tp, "embedding"))
    return out


def total_parameters(cfg, mtp: bool) -> int:
    """The model's parameter count (one copy of each weight; the MTP stage's tied embedding not counted twice)."""
    return cfg.count_parameters(include_mtp=mtp)
