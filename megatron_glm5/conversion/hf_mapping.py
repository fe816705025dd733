"""The one HF <-> Megatron name/shape table for GLM-5.

Every tensor of a GlmMoeDsaForCausalLM checkpoint (HF names as stored on disk: one tensor per expert matrix,
MTP as layer ``num_hidden_layers``) corresponds to exactly one megatron-glm5 parameter (or buffer) or to a slice
of one. ``conversion_plan(cfg)`` expands the per-layer rules for a config into ``TensorMapping`` rows; the
in-memory converters below and the file tools (tools/convert_*.py) both work from these rows.

Kinds of rows:
- ``copy``: one HF tensor is one megatron tensor.
- ``glu``: megatron's fused gated-MLP fc1 = rows [gate_proj; up_proj].
- ``experts``: megatron's stacked expert tensor [E, ...] = the E per-expert HF tensors stacked (weight2/down).
- ``experts_glu``: stacked expert fc1 [E, 2, I, H] = per expert [gate_proj, up_proj].
- ``tied``: an HF tensor with no megatron tensor of its own (the MTP layer's embed_tokens and shared_head.head
  are the main model's embedding and output layer in megatron-core); exported as copies, checked on import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

MTP_MCORE_PREFIX = "mtp.layers.{k}."
MTP_LAYER_PREFIX = "mtp.layers.{k}.mtp_model_layer."


@dataclass(frozen=True)
class TensorMapping:
    mcore: str | None  # megatron-glm5 state-dict key (None for 'tied')
    hf: tuple[str, ...]  # HF keys, in the order the kind combines them
    kind: str  # copy | glu | experts | experts_glu | tied
    tied_to: str | None = None  # for 'tied': the megatron key it equals


# (megatron suffix, HF suffix) for every decoder layer, relative to the layer prefixes.
_ATTENTION = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
]
_INDEXER = [
    ("self_attention.core_attention.indexer.linear_wq_b.weight", "self_attn.indexer.wq_b.weight"),
    ("self_attention.core_attention.indexer.linear_wk.weight", "self_attn.indexer.wk.weight"),
    ("self_attention.core_attention.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    ("self_attention.core_attention.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    ("self_attention.core_attention.indexer.linear_weights_proj.weight", "self_attn.indexer.weights_proj.weight"),
]


def _layer_rows(mc: str, hf: str, moe: bool, full_indexer: bool, n_experts: int) -> list[TensorMapping]:
    rows = [TensorMapping(mc + a, (hf + b,), "copy") for a, b in _ATTENTION]
    if full_indexer:
        rows += [TensorMapping(mc + a, (hf + b,), "copy") for a, b in _INDEXER]
    if not moe:
        rows += [
            TensorMapping(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "glu"),
            TensorMapping(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy"),
        ]
        return rows
    experts = range(n_experts)
    rows += [
        TensorMapping(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), "copy"),
        TensorMapping(mc + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",), "copy"),
        TensorMapping(mc + "mlp.shared_experts.linear_fc1.weight",
                      (hf + "mlp.shared_experts.gate_proj.weight", hf + "mlp.shared_experts.up_proj.weight"), "glu"),
        TensorMapping(mc + "mlp.shared_experts.linear_fc2.weight", (hf + "mlp.shared_experts.down_proj.weight",), "copy"),
        TensorMapping(mc + "mlp.experts.weight1",
                      tuple(hf + f"mlp.experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj")),
                      "experts_glu"),
        TensorMapping(mc + "mlp.experts.weight2", tuple(hf + f"mlp.experts.{e}.down_proj.weight" for e in experts),
                      "experts"),
    ]
    return rows


def conversion_plan(cfg, include_mtp: bool = True) -> list[TensorMapping]:
    """All rows for a GLM5Config (global layer numbering; megatron keys as a single-stage model names them)."""
    rows = [
        TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy"),
        TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
        TensorMapping("output_layer.weight", ("lm_head.weight",), "copy"),
    ]
    for i in range(cfg.num_hidden_layers):
        rows += _layer_rows(f"decoder.layers.{i}.", f"model.layers.{i}.", cfg.mlp_layer_types[i] == "sparse",
                            cfg.indexer_types[i] == "full", cfg.n_routed_experts)
    if include_mtp:
        for k in range(cfg.num_nextn_predict_layers or 0):
            mc, hf = MTP_MCORE_PREFIX.format(k=k), f"model.layers.{cfg.num_hidden_layers + k}."
            rows += [
                TensorMapping(mc + "enorm.weight", (hf + "enorm.weight",), "copy"),
                TensorMapping(mc + "hnorm.weight", (hf + "hnorm.weight",), "copy"),
                TensorMapping(mc + "eh_proj.weight", (hf + "eh_proj.weight",), "copy"),
                TensorMapping(mc + "final_layernorm.weight", (hf + "shared_head.norm.weight",), "copy"),
                TensorMapping(None, (hf + "embed_tokens.weight",), "tied", tied_to="embedding.word_embeddings.weight"),
                TensorMapping(None, (hf + "shared_head.head.weight",), "tied", tied_to="output_layer.weight"),
            ]
            rows += _layer_rows(MTP_LAYER_PREFIX.format(k=k), hf, moe=True, full_indexer=True,
                                n_experts=cfg.n_routed_experts)
    return rows


# ---------------------------------------------------------------- assembling tensors for one row
def hf_to_mcore_tensor(row: TensorMapping, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """Combine the row's HF tensors (in ``row.hf`` order) into its megatron tensor."""
    if row.kind == "copy":
        return hf_tensors[0]
    if row.kind == "glu":
        return torch.cat(hf_tensors, dim=0)
    if row.kind == "experts":
        return torch.stack(hf_tensors, dim=0)
    if row.kind == "experts_glu":
        return torch.stack([torch.stack(hf_tensors[2 * e:2 * e + 2]) for e in range(len(hf_tensors) // 2)])
    raise ValueError(f"row kind {row.kind!r} has no megatron tensor")


def mcore_to_hf_tensors(row: TensorMapping, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Split a megatron tensor into the row's HF tensors (same order as ``row.hf``)."""
    if row.kind in ("copy", "tied"):
        return [tensor]
    if row.kind == "glu":
        return list(tensor.chunk(2, dim=0))
    if row.kind == "experts":
        return list(tensor.unbind(0))
    if row.kind == "experts_glu":
        return [half for expert in tensor.unbind(0) for half in expert.unbind(0)]
    raise ValueError(f"unknown row kind {row.kind!r}")


# ---------------------------------------------------------------- whole state dicts in memory
def hf_fused_to_disk_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]);
    checkpoints store one tensor per expert. Return the on-disk naming (other keys unchanged)."""
    out = {}
    for key, t in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            for e, w in enumerate(t.unbind(0)):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e, w in enumerate(t.unbind(0)):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[key] = t
    return out


def hf_to_mcore(hf_state: Mapping[str, torch.Tensor], cfg, include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk or transformers' in-memory naming) -> megatron-glm5 state dict (single stage)."""
    state = hf_fused_to_disk_names(hf_state)
    out, used = {}, set()
    for row in conversion_plan(cfg, include_mtp=include_mtp):
        missing = [k for k in row.hf if k not in state]
        if missing:
            raise KeyError(f"HF state dict lacks {missing[0]} (needed for {row.mcore or row.tied_to})")
        used.update(row.hf)
        if row.kind == "tied":
            continue
        out[row.mcore] = hf_to_mcore_tensor(row, [state[k] for k in row.hf])
    extra = sorted(set(state) - used)
    if extra:
        raise KeyError(f"HF state dict has {len(extra)} tensor(s) the GLM-5 table does not know, e.g. {extra[0]}")
    return out


def mcore_to_hf(mc_state: Mapping[str, torch.Tensor], cfg, include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """megatron-glm5 state dict (single stage) -> HF state dict with on-disk names."""
    out = {}
    for row in conversion_plan(cfg, include_mtp=include_mtp):
        key = row.tied_to if row.kind == "tied" else row.mcore
        if key not in mc_state:
            raise KeyError(f"megatron state dict lacks {key}")
        out.update(zip(row.hf, mcore_to_hf_tensors(row, mc_state[key])))
    return out


# ---------------------------------------------------------------- where each HF tensor lies (streaming converters)
@dataclass(frozen=True)
class Placement:
    """Where one HF tensor sits inside its row's megatron tensor.

    The HF tensor of shape ``S`` is the block ``mcore[index + (row_offset : row_offset + S[0],) + (:,) * ...]``,
    i.e. ``len(index)`` leading unit axes followed by the HF tensor itself, with its first axis shifted by
    ``row_offset``. Rows ``[r0, r1)`` of the HF tensor are therefore the megatron block at
    ``offsets = index + (row_offset + r0, 0, ...)`` of sizes ``(1,) * len(index) + (r1 - r0,) + S[1:]``.
    Streaming converters move data HF tensor by HF tensor (or row block by row block) through these.
    """
    hf: str
    index: tuple[int, ...]
    row_offset: int

    def mcore_block(self, hf_shape, r0: int = 0, r1: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the megatron tensor of HF rows [r0, r1) (whole tensor by default)."""
        hf_shape = tuple(hf_shape)
        r1 = hf_shape[0] if r1 is None else r1
        offsets = self.index + (self.row_offset + r0,) + (0,) * (len(hf_shape) - 1)
        sizes = (1,) * len(self.index) + (r1 - r0,) + hf_shape[1:]
        return offsets, sizes


def hf_placements(row: TensorMapping, hf_shapes) -> list[Placement]:
    """One Placement per HF tensor of ``row`` (same order as ``row.hf``); ``hf_shapes`` their shapes.

    Agrees with :func:`hf_to_mcore_tensor`: writing each HF tensor into its block rebuilds the megatron tensor.
    """
    if row.kind in ("copy", "tied"):
        return [Placement(row.hf[0], (), 0)]
    if row.kind == "glu":
        return [Placement(row.hf[0], (), 0), Placement(row.hf[1], (), int(hf_shapes[0][0]))]
    if row.kind == "experts":
        return [Placement(k, (e,), 0) for e, k in enumerate(row.hf)]
    if row.kind == "experts_glu":
        return [Placement(k, (i // 2, i % 2), 0) for i, k in enumerate(row.hf)]
    raise ValueError(f"unknown row kind {row.kind!r}")


def mcore_shape_from_hf(row: TensorMapping, hf_shapes) -> tuple[int, ...]:
    """Global shape of the row's megatron tensor given its HF tensors' shapes."""
    first = tuple(int(d) for d in hf_shapes[0])
    if row.kind in ("copy", "tied"):
        return first
    if row.kind == "glu":
        return (sum(int(s[0]) for s in hf_shapes),) + first[1:]
    if row.kind == "experts":
        return (len(row.hf),) + first
    if row.kind == "experts_glu":
        return (len(row.hf) // 2, 2) + first
    raise ValueError(f"unknown row kind {row.kind!r}")


def hf_shapes_from_mcore(row: TensorMapping, mcore_shape) -> list[tuple[int, ...]]:
    """Shapes of the row's HF tensors given its megatron tensor's global shape (inverse of mcore_shape_from_hf)."""
    shape = tuple(int(d) for d in mcore_shape)
    if row.kind in ("copy", "tied"):
        return [shape]
    if row.kind == "glu":
        if shape[0] % 2:
            raise ValueError(f"gated fc1 {row.mcore} has an odd first dimension {shape}")
        return [(shape[0] // 2,) + shape[1:]] * 2
    if row.kind == "experts":
        return [shape[1:]] * len(row.hf)
    if row.kind == "experts_glu":
        return [shape[2:]] * len(row.hf)
    raise ValueError(f"unknown row kind {row.kind!r}")


def mcore_checkpoint_key(state_key: str) -> str:
    """The key megatron-core's ``sharded_state_dict()`` gives a state-dict tensor (what torch_dist stores).

    Equal to the state-dict key except inside MTP layers, whose decoder layer is the attribute ``mtp_model_layer``
    but is checkpointed under the name ``transformer_layer``.
    """
    head, sep, tail = state_key.partition(".mtp_model_layer.")
    if sep and head.startswith("mtp.layers."):
        return f"{head}.transformer_layer.{tail}"
    return state_key
