"""GLM-5's Multi-head Latent Attention on megatron-core's MLASelfAttention.

The parent builds the projections (linear_q_down_proj, q_layernorm, linear_q_up_proj, linear_kv_down_proj,
kv_layernorm, linear_kv_up_proj, linear_proj) and the core attention from the layer spec; this subclass replaces
the forward pass with GLM-5's:

  q_resid = q_layernorm(q_down(x))                      (eps 1e-6)
  q       = q_up(q_resid) -> per head [nope | rope]      rope part rotated (interleaved pairs)
  latent, k_rope = kv_down(x);  latent = kv_layernorm(latent);  k_rope rotated (one head shared by all heads)
  attention runs in the absorbed latent space: q_lat = [q_nope @ W_uk | q_rope], kv = [latent | k_rope],
  out = (sparse attention over the DSA-selected keys) @ W_uv, then linear_proj (the two per-head products:
  model/absorbed_mla.py, written into the layouts their neighbours use).

W_uk / W_uv are the k_nope / v rows of linear_kv_up_proj's weight (HF kv_b_proj), used in place, so the
parameters keep their HF shapes and kernels never see per-head K or V.

Tensor parallelism (heads split over TP ranks) — all communication of this module is in ``_project``:
- the input is gathered once (sequence-parallel all-gather, or an identity whose backward all-reduces);
- the two column-parallel down projections are all-gathered to full width;
- the replicated tensors that feed per-head math (q_resid and the [latent | k_rope] key) pass through
  copy_to_tensor_model_parallel_region, whose backward sums their gradients over TP. megatron-core's own
  non-TE MLA misses this for k_rope (its gradient only reflects the local heads when TP > 1); here the shared
  key's gradient is summed like the latent's, by construction. The q/kv latent norms sit before that sum, so
  their weight gradients are complete on every TP rank (norm.latent_rms_norm keeps megatron-core's
  finalize_model_grads from summing q_layernorm's over TP a second time).
Tested against one process, gradient by gradient: tests/test_layouts_cpu.py.

Context parallelism: queries stay local; the shared key ``[latent | k_rope]`` is all-gathered over the CP
group into global token order (``AttentionInputs.gather_keys``, after RoPE with the global positions), so the
core attention sees every key row of the sequence (tests/test_layouts_cp.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_glm5.model import fusions
from megatron_glm5.model.absorbed_mla import absorbed_query, expanded_output
from megatron_glm5.model.attention_inputs import AttentionInputs
from megatron_glm5.model.norm import rms_norm
from megatron_glm5.model.rope import apply_interleaved_rope


@fusions.region
def latent_key(kv_c: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               lat: int) -> torch.Tensor:
    """The shared key [latent | k_rope] from kv_down's output: kv_layernorm on the latent, RoPE on k_rope, written
    in one tensor (the layout the sparse kernels read)."""
    latent = rms_norm.eager(kv_c[..., :lat], norm_weight, eps)
    return torch.cat([latent, apply_interleaved_rope(kv_c[..., lat:], cos, sin)], dim=-1)


def local_linear(linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T with this rank's shard of a parallel linear, its communication left to the caller (``_project``).
    A linear that is more than one weight (LoRA adapters: lora/adapters.py) computes it itself."""
    own = getattr(linear, "local_linear", None)
    return own(x) if own is not None else F.linear(x, linear.weight)


def dense_weight(linear) -> torch.Tensor:
    """The weight this rank's shard of a linear applies (the absorbed attention uses kv_up's in place); a linear
    with adapters returns W + (alpha/r) B A."""
    own = getattr(linear, "dense_weight", None)
    return own() if own is not None else linear.weight


class GLM5MLASelfAttention(MLASelfAttention):

    def __init__(self, config, *args, fp8_down_projections: bool = False, **kwargs):
        super().__init__(config, *args, **kwargs)
        if fp8_down_projections:  # megatron-core builds only its own classes there: swapped for the frozen FP8 base
            from megatron_glm5.fp8.modules import replace_down_projections
            replace_down_projections(self)
        selective = config.recompute_granularity == "selective"
        modules = config.recompute_modules or []
        if selective and "mla_up_proj" in modules:
            raise ValueError("--recompute-modules mla_up_proj: not supported by GLM-5's absorbed MLA (the sparse "
                             "attention keeps its query for backward anyway); use core_attn or full recomputation")
        # core_attn: recompute the DSA core (indexer + sparse attention) in backward instead of keeping its state
        self.recompute_core_attention = selective and "core_attn" in modules

    def _tp_size(self) -> int:
        return self.pg_collection.tp.size() if self.pg_collection.tp is not None else 1

    def _project(self, hidden_states: torch.Tensor):
        """x [s_local, b, H] -> x_full [s, b, H], q_compressed [s, b, q_lora], kv_combined [s, b, kv_lora + rope]."""
        tp = self._tp_size()
        if self.config.sequence_parallel and tp > 1:
            x = gather_from_sequence_parallel_region(hidden_states, group=self.pg_collection.tp)
        else:
            x = copy_to_tensor_model_parallel_region(hidden_states, group=self.pg_collection.tp)
        q_c = local_linear(self.linear_q_down_proj, x)
        kv_c = local_linear(self.linear_kv_down_proj, x)
        if tp > 1:
            q_c = gather_from_tensor_model_parallel_region(q_c, group=self.pg_collection.tp)
            kv_c = gather_from_tensor_model_parallel_region(kv_c, group=self.pg_collection.tp)
        return x, q_c, kv_c

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None,
                *, inference_params=None):
        inputs = rotary_pos_emb
        if not isinstance(inputs, AttentionInputs):
            raise TypeError("GLM5MLASelfAttention expects the per-forward AttentionInputs in the rotary_pos_emb "
                            "slot (built by GLM5Model); got " + type(inputs).__name__)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("megatron-core's inference context is not used by GLM-5's MLA: generate "
                                      "with megatron_glm5.generation (its own MLA latent cache)")
        cfg = self.config
        h = self.num_attention_heads_per_partition
        nope, rope, dv, lat = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

        x, q_c, kv_c = self._project(hidden_states)
        s, b, _ = x.shape
        group = self.pg_collection.tp

        q_resid = self.q_layernorm(q_c)
        q = local_linear(self.linear_q_up_proj, copy_to_tensor_model_parallel_region(q_resid, group=group))
        q = q.view(s, b, h, nope + rope)

        fuse = fusions.on(cfg, x)
        kv_norm = self.kv_layernorm
        kv = copy_to_tensor_model_parallel_region(
            latent_key(kv_c, kv_norm.weight, kv_norm.eps, inputs.cos, inputs.sin, lat, fuse=fuse), group=group)

        w_kv = dense_weight(self.linear_kv_up_proj).view(h, nope + dv, lat)
        w_uk, w_uv = w_kv.split([nope, dv], dim=1)
        q_abs = absorbed_query(q, w_uk, inputs.cos, inputs.sin, fuse=fuse)  # [b * s, h, lat + rope], token order

        core = lambda q_, kv_, x_, qr_: self.core_attention(q_, kv_, x_, qr_, inputs)
        # keys of the whole sequence: all-gathered over context parallelism, in global token order
        # (generation's cache-aware inputs return the cached rows of this layer instead, see generation/kv_cache.py)
        keys = inputs.gather_keys(kv, (self.layer_number, "kv"))
        core_args = (q_abs, keys, x.detach(), q_resid.detach())
        # Recompute only when a gradient flows into the core: with nothing upstream trainable (--dsa-stage
        # dense-warmup trains the indexers alone) the checkpoint's backward would never run, and with it the
        # indexer loss the core attaches in the recomputation.
        if self.recompute_core_attention and self.training and any(t.requires_grad for t in core_args):
            out_lat = tensor_parallel.checkpoint(core, False, *core_args)
        else:
            out_lat = core(*core_args)
        return self.linear_proj(expanded_output(out_lat, w_uv, s, b))  # [s, b, h * v]
