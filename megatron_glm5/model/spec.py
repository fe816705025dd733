"""GLM-5's layer specs: every per-layer choice (dense vs MoE MLP, full vs shared indexer) is made here, once.

Layer numbers are megatron-core's (1-based, global). HF layer i is megatron layer i + 1; the MTP layer
(HF layer num_hidden_layers) gets a full indexer of its own and stores its top-k under key "mtp".
"""
from __future__ import annotations

from functools import partial

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
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
from megatron_glm5.model.moe import GLM5GroupedExperts, GLM5Router
from megatron_glm5.model.norm import GLM5RMSNorm, latent_rms_norm

def index_source_layer(indexer_types, layer_index: int) -> int:
    """0-based index of the full-indexer layer whose top-k layer ``layer_index`` uses (itself if full)."""
    for i in range(layer_index, -1, -1):
        if indexer_types[i] == "full":
            return i
    raise ValueError(f"indexer_types: layer {layer_index} is 'shared' but no 'full' layer precedes it")


def _shared_experts(*, config, pg_collection, gate, submodules, name=None):
    return SharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection, name=name)


def _mlp_spec(moe: bool):
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if not moe:
        return partial(MLP.as_mlp_submodule, submodules=linears)
    return partial(MoELayer, submodules=MoESubmodules(
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
            specs.append(layer_spec(moe, "shared", store_key=None, source_key=index_source_layer(types, i) + 1))
    return specs


class IndexShareAcrossStagesError(UserError, NotImplementedError):
    """A pipeline stage would need the top-k of a full-indexer layer that runs on an earlier stage."""


def _check_index_share_within_stage(config, offset: int, n: int, vp_stage, pp_rank):
    """Each model chunk builds its own AttentionInputs (and IndexShare store) per forward, so a 'shared' layer
    must find its full layer in the same chunk. Passing top-k indices between pipeline stages is not
    implemented yet: refuse such a split when the model is built, not in the middle of the first forward."""
    types = config.dsa_indexer_types
    for i in range(offset, offset + n):
        if types[i] != "shared":
            continue
        src = index_source_layer(types, i)
        if src < offset:
            if pp_rank is None:
                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            where = f"pipeline stage {pp_rank}" + (f" (virtual stage {vp_stage})" if vp_stage is not None else "")
            raise IndexShareAcrossStagesError(
                f"--pp {config.pipeline_model_parallel_size}"
                + (f" --vpp {config.virtual_pipeline_model_parallel_size}"
                   if config.virtual_pipeline_model_parallel_size else "")
                + f": {where} holds layers {offset}..{offset + n - 1} (0-based, as in indexer_types), and layer {i} "
                f"is an IndexShare ('shared') layer that reuses the top-k of full layer {src} on an earlier stage; "
                "sharing top-k across pipeline stages is not supported yet. Split the layers so that every stage "
                "starts with a 'full' indexer layer (--decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers, or another --pp / --vpp)")


def _stage_layers(config, vp_stage, pp_rank) -> tuple[int, int]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return (get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
            get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def check_pipeline_split(config) -> None:
    """Check every (pipeline stage, virtual stage) of the layout, so that every rank reports the same error
    (a rank checking only its own stage would leave the others hanging in a collective)."""
    vpp = config.virtual_pipeline_model_parallel_size
    for pp_rank in range(config.pipeline_model_parallel_size):
        for vp_stage in (range(vpp) if vpp else [None]):
            offset, n = _stage_layers(config, vp_stage, pp_rank)
            _check_index_share_within_stage(config, offset, n, vp_stage, pp_rank)


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
