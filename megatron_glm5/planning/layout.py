"""The parallel layout of a run, from the training scripts' validated flags: group sizes, and per pipeline rank
its model chunks (which layers, embedding, output head, MTP), as megatron-core splits them.

The layer split is megatron-core's own (``model.pipeline_topk.stage_layers``: get_transformer_layer_offset /
get_num_layers_to_build on the run's GLM5TransformerConfig), so uneven first/last stages and virtual stages come out
exactly as training builds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megatron_glm5.planning.inventory import Split, Tensor, chunk_tensors


@dataclass(frozen=True)
class Chunk:
    pp_rank: int
    vp_stage: int
    layers: range  # HF layer indices
    pre_process: bool
    post_process: bool
    mtp: bool
    tensors: Tuple[Tensor, ...]


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    vpp: int  # 1 without virtual stages
    cp: int
    ep: int
    etp: int
    dp: int  # dense data-parallel size (the distributed optimizer shards dense state over dp x cp)
    edp: int  # expert data-parallel size
    chunks: Tuple[Tuple[Chunk, ...], ...]  # [pp_rank][vp_stage]

    @property
    def dense_shards(self) -> int:
        return self.dp * self.cp

    def stage_layers(self, pp_rank: int) -> List[int]:
        return [i for c in self.chunks[pp_rank] for i in c.layers]


def transformer_config(args):
    """The run's GLM5TransformerConfig (megatron-core's config object; no model is built)."""
    from megatron_glm5.arguments import args_to_overrides

    return args.model_config.to_transformer_config(**args_to_overrides(args))


def build_layout(args) -> Layout:
    """The layout of validated ``args`` (megatron_glm5.arguments.validate_args)."""
    from megatron_glm5.model.pipeline_topk import stage_layers

    tcfg = transformer_config(args)
    cfg = args.model_config
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    split = Split(tp=tp, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    mtp = bool(args.mtp) and bool(tcfg.mtp_num_layers)
    chunks = []
    for r in range(pp):
        row = []
        for v in range(vpp):
            offset, n = stage_layers(tcfg, v if vpp > 1 else None, r)
            pre = r == 0 and v == 0
            post = r == pp - 1 and v == vpp - 1
            has_mtp = mtp and post
            shared = pp > 1 and mtp and ((pre and not post) or (has_mtp and not pre))
            tensors = chunk_tensors(cfg, range(offset, offset + n), split, pre_process=pre, post_process=post,
                                    mtp=has_mtp, shared_embedding=shared)
            row.append(Chunk(r, v, range(offset, offset + n), pre, post, has_mtp, tuple(tensors)))
        chunks.append(tuple(row))
    return Layout(world=args.world_size, tp=tp, pp=pp, vpp=vpp, cp=args.context_parallel_size,
                  ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                  dp=args.data_parallel_size, edp=args.expert_data_parallel_size, chunks=tuple(chunks))
