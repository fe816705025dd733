"""Peak memory of one rank: weights, gradients, optimizer state (buffers.py) plus activations, the loss, the MoE
dispatch buffers and the allocator's margin.

Activations in flight follow the pipeline schedule megatron-core runs: 1F1B keeps min(PP - p, M) micro-batches of
stage p's layers (the first stage holds PP of them); the interleaved schedule (--vpp V) keeps
``min(M*V, 2*(PP - p - 1) + (V - 1)*PP + 1)`` model chunks' worth (megatron-core's warm-up count plus the one in
its steady state), each chunk 1/V of the stage's layers.  Under full recompute a covered layer keeps only its input;
the layer being recomputed in backward materialises everything once (the working set).

The optimizer step has a transient of its own: without Transformer Engine or Apex megatron-core steps with torch's
AdamW (foreach), whose ``_foreach_sqrt(exp_avg_sq)`` allocates an fp32 copy of every parameter of a param group
at once; the dense and the expert parameters are two chained optimizers, so the transient is 4 bytes x the larger
of the two on this rank.  The peak is the weights, gradients and optimizer state plus the larger of the
forward/backward dynamic memory and that transient (a fused Adam, with TE or Apex, has no such transient).
The memory options (training/memory_options.py) change the static part (buffers.py) and this transient
(``optimizer_step_transient_bytes``).

Our sparse-MLA backward (``--attn`` triton, tilelang, flashmla, or auto, which may pick one of them; the sparse stage)
holds its P / dS buffers while a layer's backward runs (``ops/sparse_bwd_budget.backward_buffer_bytes``: up to
2 GiB, 3 GiB in deterministic "slots" past 20 keys per top-k slot), counted in the working set; where it keeps its
buffer zero between backwards (ZEROS "restore", long sequences; with ``--attn tilelang`` or auto, also the dense
prefix's past 8 keys per top-k slot) that buffer also stays through the optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megatron_glm5.ops import sparse_bwd_budget
from megatron_glm5.planning import activations as act
from megatron_glm5.planning import lora_terms
from megatron_glm5.planning.buffers import StaticMemory

GIB = 1024 ** 3
CONTEXT_BYTES = int(2.5 * GIB)  # CUDA context, cuBLAS/NCCL workspaces and communicator buffers: an assumption
FRAGMENTATION = 0.05  # the caching allocator's slack over what tensors hold: an assumption
OUR_SPARSE_BACKWARD = ("auto", "triton", "tilelang", "flashmla")  # --attn values whose sparse backward is ours
DENSE_PREFIX_BACKWARD = ("auto", "tilelang")  # ... and may be our TileLang one (BWD_CONFIG's DENSE_PREFIX)

# --recompute-modules (selective recompute): the activation terms each one stops keeping
_SELECTIVE_DROPS = {
    "core_attn": ("out_lat, out, lse",),
    "moe_act": ("expert fc1 out, act out",),
    "mlp": ("fc1 out, act out, fc2 out",),
    "moe": ("router logits, scores, top-k", "dispatched tokens (fc1 in)", "expert fc1 out, act out",
            "expert fc2 out, combine", "shared expert fc1 out, act out, out"),
    "shared_experts": ("shared expert fc1 out, act out, out",),
    "layernorm": ("input_layernorm in/out", "pre_mlp_layernorm in/out"),
}


def optimizer_step_transient_bytes(s: StaticMemory) -> int:
    """The GPU temporaries of optimizer.step(): torch AdamW's foreach fp32 copy of the larger of the dense and the
    expert optimizer's GPU-resident elements; with bf16 gradient buffers also the fp32 gradients megatron-core
    hands the optimizer (``main_grad.float()`` of every GPU-resident owned element, all optimizers prepared before
    any steps).  Offloaded elements (--optimizer-cpu-offload) step in host memory."""
    dense, expert = s.gpu_optimizer_elements()
    transient = 4 * max(dense, expert)
    if s.grad_dtype_bytes < 4:
        transient += 4 * (dense + expert)
    return transient


def micro_batches_in_flight(pp: int, pp_rank: int, vpp: int, num_microbatches: int) -> float:
    """Stage-equivalents of activations kept at once on pipeline rank ``pp_rank`` (a stage's layers = 1)."""
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - pp_rank, num_microbatches))
    chunks = min(num_microbatches * vpp, 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1)
    return chunks / vpp


def layer_kept_bytes_per_token(cfg, i, tp, etp, recompute: bool, modules) -> float:
    """What layer ``i`` keeps per token between its forward and its backward."""
    if recompute:
        return act.layer_input_bytes_per_token(cfg, tp)
    terms = dict(act.attention_terms(cfg, tp, cfg.is_full_indexer_layer(i)))
    terms.update(act.mlp_terms(cfg, tp, etp, cfg.is_moe_layer(i)))
    for m in modules or ():
        for name in _SELECTIVE_DROPS.get(m, ()):
            terms.pop(name, None)
    return sum(terms.values())


@dataclass
class RankMemory:
    static: StaticMemory
    activation_bytes: int
    working_bytes: int  # the largest transient of forward/backward: a recomputed layer + dispatch buffers, or the loss
    optimizer_step_bytes: int  # torch AdamW's foreach temporary during optimizer.step() (+ a kept sparse buffer)
    loss_bytes: int
    dispatch_bytes: int
    context_bytes: int
    margin_bytes: int
    in_flight: float

    @property
    def dynamic_bytes(self) -> int:
        """Above the weights, gradients and optimizer state at the peak: forward/backward or the optimizer step."""
        return max(self.activation_bytes + self.working_bytes, self.optimizer_step_bytes)

    @property
    def tensor_bytes(self) -> int:
        """What tensors hold at the peak (comparable with torch.cuda.max_memory_allocated)."""
        s = self.static
        return s.weight_bytes + s.grad_bytes + s.optimizer_bytes + self.dynamic_bytes

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes + self.context_bytes + self.margin_bytes

    def breakdown(self) -> Dict[str, int]:
        s = self.static
        return {"weights": s.weight_bytes, "gradients": s.grad_bytes, "optimizer_main_params": s.optimizer_main_bytes,
                "optimizer_moments": s.optimizer_moment_bytes, "activations": self.activation_bytes,
                "working_set": self.working_bytes, "optimizer_step_transient": self.optimizer_step_bytes,
                "peak_dynamic": self.dynamic_bytes, "cuda_context": self.context_bytes,
                "allocator_margin": self.margin_bytes}


def sparse_backward_bytes(args, layout) -> tuple:
    """(bytes our sparse-MLA backward holds while it runs, of which kept between backwards) on one rank: its P / dS
    buffers for the micro-batch's local queries against all its keys and this rank's heads (module docstring)."""
    cfg = args.model_config
    if getattr(args, "dsa_stage", "sparse") != "sparse" or getattr(args, "attn", "auto") not in OUR_SPARSE_BACKWARD:
        return 0, 0
    n_keys = args.seq_length * args.micro_batch_size  # every key row of the micro-batch (CP gathers them)
    n_q, heads, topk = n_keys // layout.cp, max(1, cfg.num_attention_heads // layout.tp), cfg.index_topk
    prefix = getattr(args, "attn", "auto") in DENSE_PREFIX_BACKWARD
    held = sparse_bwd_budget.backward_buffer_bytes(n_q, n_keys, heads, topk,
                                                   d_qk=cfg.kv_lora_rank + cfg.qk_rope_head_dim, dense_prefix=prefix)
    return held, sparse_bwd_budget.kept_buffer_bytes(n_q, n_keys, heads, topk, dense_prefix=prefix)


def rank_memory(args, layout, chunks, pp_rank: int, static: StaticMemory) -> RankMemory:
    """The peak of one rank of pipeline rank ``pp_rank`` (``chunks``: its model chunks)."""
    cfg = args.model_config
    tp, etp = layout.tp, layout.etp
    tokens = args.seq_length * args.micro_batch_size / layout.cp  # per micro-batch on this rank
    gran, method, nrec = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    modules = args.recompute_modules if gran == "selective" else None
    layers = layout.stage_layers(pp_rank)
    covered = list(act.recomputed_layers(len(layers), gran, method, nrec or 1))
    kept = sum(layer_kept_bytes_per_token(cfg, i, tp, etp, rc, modules) for i, rc in zip(layers, covered))
    mtp = any(c.mtp for c in chunks)
    if mtp:  # the MTP layer is a MoE layer with its own indexer; megatron-core recomputes it with the decoder's
        kept += act.layer_input_bytes_per_token(cfg, tp) * 2 if gran == "full" else \
            act.layer_bytes_per_token(cfg, tp, etp, True, True)
    in_flight = micro_batches_in_flight(layout.pp, pp_rank, layout.vpp, args.num_microbatches)
    activation = kept * tokens * in_flight
    moe_here = any(cfg.is_moe_layer(i) for i in layers) or mtp
    dispatch = act.dispatch_buffer_bytes_per_token(cfg, tp) * tokens if moe_here else 0.0
    recomputed = max((act.layer_bytes_per_token(cfg, tp, etp, cfg.is_moe_layer(i), cfg.is_full_indexer_layer(i))
                      for i, rc in zip(layers, covered) if rc), default=0.0) * tokens
    loss = 0.0
    if any(c.post_process for c in chunks):
        loss = act.loss_bytes_per_token(cfg, tp, 1 + (args.mtp_steps if mtp else 0)) * tokens
    attn_bwd, attn_kept = sparse_backward_bytes(args, layout)
    working = max(recomputed + dispatch + attn_bwd, loss + attn_kept)
    s = lora_terms.for_rank(args, layout, chunks, static)  # a LoRA run's frozen base (lora_terms.py)
    step_transient = optimizer_step_transient_bytes(s) + attn_kept
    m = RankMemory(static=s, activation_bytes=int(activation), working_bytes=int(working), loss_bytes=int(loss),
                   optimizer_step_bytes=int(step_transient), dispatch_bytes=int(dispatch),
                   context_bytes=CONTEXT_BYTES, margin_bytes=0, in_flight=in_flight)
    m.margin_bytes = int(FRAGMENTATION * m.tensor_bytes)
    return m

