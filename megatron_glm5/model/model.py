"""GLM5Model: megatron-core's GPTModel with GLM-5's layers, and ``build_model``.

The only change to GPTModel's flow is in ``_preprocess``: instead of a rotary table (GPTModel builds none for
MLA) it creates the per-forward ``AttentionInputs`` (RoPE of the real positions, attention windows, IndexShare
store) that every GLM-5 attention layer of this forward — MTP included — reads.
"""
from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_glm5.mcore_patches import registry as mcore_patches
from megatron_glm5.mcore_patches.record import Phase
from megatron_glm5.model.attention_inputs import build_attention_inputs
from megatron_glm5.model.context_parallel import check_context_parallel, default_position_ids
from megatron_glm5.model.hybridep_dispatcher import hybridep_backend, setup_hybridep_groups
from megatron_glm5.model import fused_cross_entropy, fusions, linear_cross_entropy, pipeline_topk
from megatron_glm5.model.spec import decoder_block_spec, mtp_block_spec


class GLM5Model(GPTModel):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # GPTModel builds megatron-core's TransformerBlock itself: re-classed to GLM-5's (model/block.py)
        mcore_patches.apply("glm5_transformer_block", self)

    def forward(self, input_ids, position_ids=None, attention_mask=None, *args, **kwargs):
        """GPTModel.forward; ``position_ids`` default to 0..s-1 (under context parallelism: the global positions of
        this rank's chunks) and the attention mask is not needed (GLM-5's
        attention is causal, windows come from positions / packed_seq_params). Without labels: logits [b, s, V]."""
        if position_ids is None and input_ids is not None:
            cp = self.config.context_parallel_size
            position_ids = default_position_ids(input_ids, cp, self.pg_collection.cp.rank() if cp > 1 else 0)
        if kwargs.get("labels") is not None and getattr(self.config, "cross_entropy_fusion", "none") == "chunked":
            kwargs.setdefault("output_processor", linear_cross_entropy.output_processor)
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def compute_language_model_loss(self, labels, logits):
        """megatron-core's per-token LM loss [b, s] (main head and MTP); under ``--fusions auto`` on a GPU the same
        vocabulary-parallel cross entropy in compiled regions without its fp32 copies (model/fused_cross_entropy.py).
        megatron-core's own ``cross_entropy_loss_fusion`` (TE / "native"), when set, keeps precedence."""
        if self.config.cross_entropy_loss_fusion or not fusions.on(self.config, logits):
            return super().compute_language_model_loss(labels, logits)
        loss = fused_cross_entropy.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), tp_group=self.tp_group)
        return loss.transpose(0, 1).contiguous()

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = list(super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context, packed_seq_params=packed_seq_params,
                                       padding_mask=padding_mask))
        cu_seqlens = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q
        cfg = self.config
        out[1] = build_attention_inputs(position_ids, cfg.qk_pos_emb_head_dim, cfg.rotary_base, cu_seqlens=cu_seqlens,
                                        cp_group=self.pg_collection.cp)
        return tuple(out)


def _check_selective_recompute(cfg) -> None:
    """megatron-core 0.19.2's CheckpointWithoutOutput sets ``fp8 = fp8 is not None`` (always true) and then needs
    Transformer Engine, so the selective modules built on it fail without TE; refuse them with a clear message."""
    if cfg.recompute_granularity != "selective" or "layernorm" not in (cfg.recompute_modules or []):
        return
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        raise ValueError("--recompute-modules layernorm needs Transformer Engine with megatron-core 0.19.2 "
                         "(its CheckpointWithoutOutput always takes the FP8 path); drop it or use full recompute") from None


def _reset_process_globals() -> None:
    """megatron-core keeps per-job state process-wide, which a model built later in the same process (a notebook, a
    second run, the tests) must not inherit: the MTP loss tracker, sized by the first model's MTP depth (another
    depth would index past it), and the aux-loss backward scale, which its autograd Function sets to a 0-dim 1.0
    when a backward runs outside the schedule -- the schedule's later [1]-shaped scale then cannot be copied into
    it ("output with shape [] doesn't match the broadcast shape [1]")."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # set again (assigned) by the next set_loss_scale


def build_model(config, *, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                vp_stage: Optional[int] = None, mtp: Optional[bool] = None, base_precision: str = "bf16",
                **overrides) -> GLM5Model:
    """Build GLM-5 for this rank's pipeline stage.

    ``config``: a GLM5Config (HF-level; ``overrides`` go to ``to_transformer_config``: parallel sizes, dtype,
    dsa_stage, ...) or an already-built GLM5TransformerConfig. ``mtp``: build the MTP layer (default: when the
    config has one). ``base_precision`` "fp8": the large frozen matrices are FP8 with block scales (fp8/modules.py).
    Initialises a single-process model-parallel state if none exists.
    """
    from megatron_glm5.config import GLM5Config

    if not parallel_state.model_parallel_is_initialized():
        from megatron_glm5 import platform
        platform.initialize_model_parallel()
    if isinstance(config, GLM5Config):
        if mtp is False:
            overrides.setdefault("mtp_num_layers", None)
        tcfg = config.to_transformer_config(**overrides)
    else:
        if overrides:
            raise TypeError("overrides are only accepted with a GLM5Config")
        tcfg = config
    _check_selective_recompute(tcfg)
    pipeline_topk.check_pipeline_split(tcfg)
    if pipeline_topk.needs_topk_transfer(tcfg):  # collective: every rank builds the same layout
        pipeline_topk.setup_groups()
    check_context_parallel(tcfg)
    mcore_patches.apply_phase(Phase.BUILD)
    mcore_patches.apply("mtp_roll_tensor_cp", tcfg)  # MTP's token roll, exact under --cp > 1
    if tcfg.moe_token_dispatcher_type == "hybridep" and hybridep_backend() == "torch":
        setup_hybridep_groups(tcfg)  # collective: every rank creates the intra-/inter-node groups
    _reset_process_globals()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GLM5Model(
        config=tcfg,
        transformer_layer_spec=decoder_block_spec(tcfg, vp_stage=vp_stage, base_precision=base_precision),
        vocab_size=tcfg.vocab_size,
        max_sequence_length=tcfg.max_position_embeddings if hasattr(tcfg, "max_position_embeddings") else 4096,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(tcfg.rotary_base),
        mtp_block_spec=mtp_block_spec(tcfg, base_precision),
        vp_stage=vp_stage,
    )
