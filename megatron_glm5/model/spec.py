"""GLM-5's layer specs: every per-layer choice (dense vs MoE MLP, full vs shared indexer) is made here, once.

Layer numbers are megatron-core's (1-based, global). HF layer i is megatron layer i + 1; the MTP layer
(HF layer num_hidden_layers) gets a full indexer of its own and stores its top-k under key "mtp".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_glm5.errors import UserError
from megatron_glm5.model.block import GLM5MTPLayer
from megatron_glm5.model.dsa import MTP_STORE_KEY, GLM5SparseAttention
from megatron_glm5.model.mla import GLM5MLASelfAttention
from megatron_glm5.model.moe import GLM5GroupedExperts, GLM5MoELayer, GLM5Router
from megatron_glm5.model.norm import GLM5RMSNorm, latent_rms_norm


def _shared_experts(*, config, pg_collection, gate, submodules, name=None):
    return SharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection, name=name)


def _mlp_spec(moe: bool):
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if not moe:
        return partial(MLP.as_mlp_submodule, submodules=linears)
    return partial(GLM5MoELayer, submodules=MoESubmodules(
        experts=GLM5GroupedExperts, shared_experts=partial(_shared_experts, submodules=linears), router=GLM5Router))


def layer_spec(moe: bool, index_mode: str, store_key, source_key=None) -> ModuleSpec:
    core = ModuleSpec(module=GLM5SparseAttention,
                      params=dict(index_mode=index_mode, store_key=store_key, source_key=source_key))
    attention = ModuleSpec(
        module=GLM5MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=core,
            linear_proj=RowParallelLinear,
            q_layernorm=latent_rms_norm,
            kv_layernorm=latent_rms_norm,
        ),
    )
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=GLM5RMSNorm,
        self_attention=attention,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=GLM5RMSNorm,
        mlp=_mlp_spec(moe),
        mlp_bda=get_bias_dropout_add,
    ))


def decoder_layer_specs(config) -> list[ModuleSpec]:
    """Specs of all main decoder layers (global order); the block keeps the ones of its pipeline stage."""
    types = config.dsa_indexer_types
    moe_freq = config.moe_layer_freq
    specs = []
    for i in range(config.num_layers):
        moe = bool(moe_freq[i]) if isinstance(moe_freq, (list, tuple)) else config.num_moe_experts is not None
        if types[i] == "full":
            specs.append(layer_spec(moe, "full", store_key=i + 1))
        else:
            specs.append(layer_spec(moe, "shared", store_key=None, source_key=config.dsa_index_source_layer(i) + 1))
    return specs


class IndexShareAcrossStagesError(UserError, NotImplementedError):
    """A layout needs IndexShare top-k across pipeline stages where it cannot be passed on."""


@dataclass(frozen=True)
class TopkLinks:
    """IndexShare across a pipeline boundary, for one model chunk (megatron layer numbers, 1-based, or None).

    ``receive``: the full layer whose top-k this chunk gets from the previous stage (its first layer is shared);
    ``send``: the full layer whose top-k it hands to the next stage (the next chunk's first layer is shared),
    computed here or, when this chunk has no full layer, the one it received. See model/pipeline_topk.py.
    """
    receive: Optional[int] = None
    send: Optional[int] = None


def _stage_layers(config, vp_stage, pp_rank) -> tuple[int, int]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return (get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
            get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def topk_links(config, vp_stage=None, pp_rank=None) -> TopkLinks:
    """Which top-k the chunk (pp_rank, vp_stage) receives and sends. Only the sparse DSA stage selects keys: in
    dense-warmup nothing flows. Chunks follow megatron-core's order (chunk c of rank r feeds chunk c of rank r + 1,
    chunk c of the last rank feeds chunk c + 1 of rank 0), so a boundary is where this chunk starts or ends."""
    if config.pipeline_model_parallel_size == 1 or config.dsa_stage != "sparse":
        return TopkLinks()
    types = config.dsa_indexer_types
    offset, n = _stage_layers(config, vp_stage, pp_rank)

    def shared_source(i):  # layer number of the full layer a chunk starting at layer i needs, if i is shared
        if 0 < i < len(types) and types[i] == "shared":
            return config.dsa_index_source_layer(i) + 1
        return None
    return TopkLinks(receive=shared_source(offset), send=shared_source(offset + n))


def _chunks(config):
    vpp = config.virtual_pipeline_model_parallel_size
    for pp_rank in range(config.pipeline_model_parallel_size):
        for vp_stage in (range(vpp) if vpp else [None]):
            yield pp_rank, vp_stage


def needs_topk_transfer(config) -> bool:
    """Whether some chunk of the layout receives IndexShare top-k from the previous pipeline stage."""
    return any(topk_links(config, vp, r).receive is not None for r, vp in _chunks(config))


def check_pipeline_split(config) -> None:
    """Check every (pipeline stage, virtual stage) of the layout, so that every rank reports the same error (a rank
    checking only its own stage would leave the others hanging in a collective).

    A stage may start on an IndexShare layer: the top-k of its full layer comes from the previous stage
    (model/pipeline_topk.py), through GLM5TransformerBlock.forward. Still refused: megatron-core's combined
    1F1B schedule (``overlap_moe_expert_parallel_comm``), which runs the layers without the block's forward.
    """
    for pp_rank, vp_stage in _chunks(config):
        links = topk_links(config, vp_stage, pp_rank)
        if links.receive is None or not getattr(config, "overlap_moe_expert_parallel_comm", False):
            continue
        offset, _ = _stage_layers(config, vp_stage, pp_rank)
        where = f"pipeline stage {pp_rank}" + (f" (virtual stage {vp_stage})" if vp_stage is not None else "")
        raise IndexShareAcrossStagesError(
            f"{where} starts on layer {offset} (0-based), an IndexShare ('shared') layer that needs the top-k "
            f"of full layer {links.receive - 1} from the previous stage; overlap_moe_expert_parallel_comm runs "
            "the layers without GLM5TransformerBlock.forward, which passes it on: turn that overlap off or split "
            "the layers so that every stage starts with a 'full' indexer layer")


def decoder_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    offset, n = _stage_layers(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=decoder_layer_specs(config)[offset:offset + n],
                                      layer_norm=GLM5RMSNorm)


def mtp_block_spec(config) -> MultiTokenPredictionBlockSubmodules | None:
    if not config.mtp_num_layers:
        return None
    mtp_layer = ModuleSpec(module=GLM5MTPLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=GLM5RMSNorm, hnorm=GLM5RMSNorm, eh_proj=ColumnParallelLinear,
        mtp_model_layer=layer_spec(moe=config.num_moe_experts is not None, index_mode="full",
                                   store_key=MTP_STORE_KEY),
        layer_norm=GLM5RMSNorm))
    # GLM-5 has one MTP module; training may apply it for several steps (mtp_use_repeated_layer: one set of
    # weights, mtp_num_layers applications), as the GLM-5 report does with 3.
    n = 1 if config.mtp_use_repeated_layer else config.mtp_num_layers
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * n)
