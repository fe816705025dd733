"""Activation recomputation that carries GLM-5's per-forward AttentionInputs.

megatron-core's full recomputation passes the layers' inputs through ``tensor_parallel.checkpoint``, which saves
them with ``save_for_backward`` — tensors only — while GLM-5's attention inputs (RoPE, windows, IndexShare
store) travel as an object in the ``rotary_pos_emb`` slot. These subclasses checkpoint only the hidden states and
capture everything else in the recomputed closure, like megatron-core does for packed_seq_params.

Recomputed DSA layers are exact: top-k is deterministic, so a full layer writes the same indices again and shared
layers read the entry of their own forward; losses attached in forward (indexer KL, MoE aux) are computed once,
in the recomputation (the first pass runs without grad).

IndexShare across pipeline stages also happens here, once per forward of a model chunk: a chunk that starts on a
shared layer receives the top-k of its full layer from the previous stage before its layers run, and a chunk whose
successor starts on a shared layer sends it after them (model/pipeline_topk.py). Recomputation replays the layers
against the same per-forward store, so it needs no second transfer.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

from megatron.core import tensor_parallel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import get_pg_rank, make_viewless_tensor

from megatron_glm5.model import pipeline_topk


class GLM5TransformerBlock(TransformerBlock):

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        links = self._topk_links()
        inputs = kwargs.get("rotary_pos_emb")
        if (links.receive or links.send) and inputs is None:
            raise RuntimeError("GLM5TransformerBlock: IndexShare across pipeline stages needs the forward's "
                               "AttentionInputs (rotary_pos_emb keyword, built by GLM5Model)")
        if links.receive is not None:
            pipeline_topk.receive(inputs, links.receive, self.config.dsa_index_topk)
        out = self._forward_layers(hidden_states, attention_mask, *args, **kwargs)
        if links.send is not None:
            pipeline_topk.send(inputs, links.send)
        return out

    def _topk_links(self):
        links = self.__dict__.get("_glm5_topk_links")
        if links is None:
            pp = getattr(self.pg_collection, "pp", None)
            links = pipeline_topk.topk_links(self.config, self.vp_stage, get_pg_rank(pp) if pp is not None else None)
            self.__dict__["_glm5_topk_links"] = links
        return links

    def _forward_layers(self, hidden_states, attention_mask, *args, **kwargs):
        cfg = self.config
        if not (cfg.recompute_granularity == "full" and self.training):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("GLM5TransformerBlock takes its optional inputs as keywords")
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        layer_kwargs = dict(attention_mask=attention_mask, rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                            packed_seq_params=kwargs.get("packed_seq_params"),
                            padding_mask=kwargs.get("padding_mask"))
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if cfg.sequence_parallel else nullcontext()
        with rng:
            hidden_states = self._recomputed_layers(hidden_states, layer_kwargs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()
        return hidden_states

    def _recomputed_layers(self, hidden_states, layer_kwargs):
        cfg = self.config
        n_layers, n = len(self.layers), cfg.recompute_num_layers or 1

        def run(start, end):
            def forward(x):
                for layer in self.layers[start:end]:
                    x, _ = layer(hidden_states=x, **layer_kwargs)
                return x
            return forward

        if cfg.recompute_method == "uniform":
            for start in range(0, n_layers, n):
                hidden_states = tensor_parallel.checkpoint(
                    run(start, min(start + n, n_layers)), cfg.distribute_saved_activations, hidden_states)
        elif cfg.recompute_method == "block":
            for i in range(n_layers):
                if i < n:
                    hidden_states = tensor_parallel.checkpoint(run(i, i + 1), cfg.distribute_saved_activations,
                                                               hidden_states)
                else:
                    hidden_states = run(i, i + 1)(hidden_states)
        else:
            raise ValueError(f"--recompute-method must be uniform or block, got {cfg.recompute_method!r}")
        return hidden_states


class GLM5MTPLayer(MultiTokenPredictionLayer):
    """megatron-core's MTP layer; its full recomputation checkpoints tensors only (see the module doc), and each
    application gets its own copy of the AttentionInputs with its step number (the IndexShare store is shared),
    so later steps of a repeated MTP layer can reuse the first step's top-k (index_share_for_mtp_iteration)."""

    def forward(self, *args, **kwargs):
        inputs = kwargs.get("rotary_pos_emb")
        if inputs is not None:
            step = inputs.mtp_counter[0]
            inputs.mtp_counter[0] += 1
            kwargs["rotary_pos_emb"] = dataclasses.replace(inputs, mtp_step=step)
        return super().forward(*args, **kwargs)

    def _checkpointed_forward(self, hidden_states, decoder_input, attention_mask=None, padding_mask=None,
                              context=None, context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                              rotary_pos_sin=None, attention_bias=None, inference_params=None,
                              packed_seq_params=None, sequence_len_offset=None):
        def forward(h, e):
            return self._proj_and_transformer_layer(
                hidden_states=h, decoder_input=e, attention_mask=attention_mask, padding_mask=padding_mask,
                context=context, context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                inference_params=inference_params, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset)

        return tensor_parallel.checkpoint(forward, self.config.distribute_saved_activations, hidden_states,
                                          decoder_input)
