"""GLM-5's layer specs: every per-layer choice (dense vs MoE MLP, full vs shared indexer) is made here, once.

Layer numbers are megatron-core's (1-based, global). HF layer i is megatron layer i + 1; the MTP layer
(HF layer num_hidden_layers) gets a full indexer of its own and stores its top-k under key "mtp".
"""
from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
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

from megatron_glm5.fp8.modules import experts_class, linear_classes
from megatron_glm5.model.block import GLM5MTPLayer
from megatron_glm5.model.dsa import MTP_STORE_KEY, GLM5SparseAttention
from megatron_glm5.model.mla import GLM5MLASelfAttention
from megatron_glm5.model.moe import GLM5MoELayer, GLM5Router
from megatron_glm5.model.norm import GLM5RMSNorm, latent_rms_norm
from megatron_glm5.model.pipeline_topk import stage_layers
from megatron_glm5.model.swiglu import GLM5SwiGLU


def _shared_experts(*, config, pg_collection, gate, submodules, name=None):
    return SharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection, name=name)


def _mlp_spec(moe: bool, base_precision: str = "bf16"):
    _, gated_column, row = linear_classes(base_precision)  # --base-precision fp8: the frozen FP8 base (fp8/)
    # activation_func: our SwiGLU module, which megatron-core's MLP calls when the config's use_te_activation_func
    # is set (--fusions auto on a GPU: model/fusion_flags.py); otherwise MLP's own eager SwiGLU runs
    linears = MLPSubmodules(linear_fc1=gated_column, linear_fc2=row, activation_func=GLM5SwiGLU)
    if not moe:
        return partial(MLP.as_mlp_submodule, submodules=linears)
    return partial(GLM5MoELayer, submodules=MoESubmodules(
        experts=experts_class(base_precision), shared_experts=partial(_shared_experts, submodules=linears),
        router=GLM5Router))


def layer_spec(moe: bool, index_mode: str, store_key, source_key=None, base_precision: str = "bf16") -> ModuleSpec:
    column, _, row = linear_classes(base_precision)
    core = ModuleSpec(module=GLM5SparseAttention,
                      params=dict(index_mode=index_mode, store_key=store_key, source_key=source_key))
    attention = ModuleSpec(
        module=GLM5MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "fp8_down_projections": base_precision == "fp8"},
        submodules=MLASelfAttentionSubmodules(
            linear_q_down_proj=ColumnParallelLinear,  # FP8: replaced after megatron-core's class check
            linear_q_up_proj=column,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=column,
            core_attention=core,
            linear_proj=row,
            q_layernorm=latent_rms_norm,
            kv_layernorm=latent_rms_norm,
        ),
    )
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=GLM5RMSNorm,
        self_attention=attention,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=GLM5RMSNorm,
        mlp=_mlp_spec(moe, base_precision),
        mlp_bda=get_bias_dropout_add,
    ))


def decoder_layer_specs(config, base_precision: str = "bf16") -> list[ModuleSpec]:
    """Specs of all main decoder layers (global order); the block keeps the ones of its pipeline stage."""
    types = config.dsa_indexer_types
    moe_freq = config.moe_layer_freq
    specs = []
    for i in range(config.num_layers):
        moe = bool(moe_freq[i]) if isinstance(moe_freq, (list, tuple)) else config.num_moe_experts is not None
        if types[i] == "full":
            specs.append(layer_spec(moe, "full", store_key=i + 1, base_precision=base_precision))
        else:
            specs.append(layer_spec(moe, "shared", store_key=None, source_key=config.dsa_index_source_layer(i) + 1,
                                    base_precision=base_precision))
    return specs


def decoder_block_spec(config, vp_stage=None, pp_rank=None, base_precision: str = "bf16") -> TransformerBlockSubmodules:
    offset, n = stage_layers(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=decoder_layer_specs(config, base_precision)[offset:offset + n],
                                      layer_norm=GLM5RMSNorm)


def mtp_block_spec(config, base_precision: str = "bf16") -> MultiTokenPredictionBlockSubmodules | None:
    if not config.mtp_num_layers:
        return None
    mtp_layer = ModuleSpec(module=GLM5MTPLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=GLM5RMSNorm, hnorm=GLM5RMSNorm, eh_proj=ColumnParallelLinear,
        mtp_model_layer=layer_spec(moe=config.num_moe_experts is not None, index_mode="full",
                                   store_key=MTP_STORE_KEY, base_precision=base_precision),
        layer_norm=GLM5RMSNorm))
    # GLM-5 has one MTP module; training may apply it for several steps (mtp_use_repeated_layer: one set of
    # weights, mtp_num_layers applications), as the GLM-5 report does with 3.
    n = 1 if config.mtp_use_repeated_layer else config.mtp_num_layers
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * n)
