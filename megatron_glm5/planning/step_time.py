"""Step time of a layout: per-stage compute of one micro-batch, the communication on its critical path, the
pipeline bubble, the data-parallel gradient/parameter collectives and the optimizer step.

Compute: a calibration row (calibration.py: measured forward+backward of one layer on the GPU, recompute
included) when one covers the layer's token count and local-expert count; otherwise the model FLOPs of
``training/flops.py`` (the same count the trainer's MFU uses) x (4 with full recompute, else 3) / (datasheet dense
bf16 rate x DEFAULT_EFFICIENCY), which is an ESTIMATE.  Communication (comm.py): sequence-parallel TP all-gather /
reduce-scatter around attention and MLP (2 + 2 per layer forward, the same in backward and in a recompute), the
context-parallel all-gather of the shared key, the EP all-to-all (dispatch + combine, forward, backward and
recompute), PP send/recv of the layer boundary; none of these overlap compute in this code (no TP-comm overlap,
no MoE-comm overlap).  Data parallel: reduce-scatter of the fp32 gradients (all-reduce without the distributed
optimizer) and all-gather of the bf16 parameters; --overlap-grad-reduce hides the reduce-scatter behind the last
micro-batch's backward and --overlap-param-gather the all-gather behind the first micro-batch's forward (what is
longer than that window stays exposed).  Optimizer step: the rank's owned elements x the calibration table's
measured time per element, else OPTIMIZER_BYTES_PER_ELEMENT at the datasheet HBM bandwidth.  Pipeline: (M - 1) x the slowest stage + the sum of all stages (fill and
drain), the stages' sum divided by V with the interleaved schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_glm5.planning import comm
from megatron_glm5.training.flops import layer_forward_flops, training_flops_per_token

DEFAULT_EFFICIENCY = 0.35  # assumed fraction of the datasheet dense bf16 rate a whole layer reaches
# Bytes the optimizer step moves per owned element without a fused Adam (torch AdamW foreach, megatron-core's
# fallback without TE/Apex): weight decay 8, lerp of m 12, m^2 update 20, sqrt / divide / add eps 24, addcdiv 16,
# gradient norm 4, clipping 8, copy to the bf16 weights 6 -- about 100.  A calibration table's measured optimizer
# step replaces it.
OPTIMIZER_BYTES_PER_ELEMENT = 100
# --optimizer-cpu-offload: per offloaded element, the gradient to the host and the weight back (4 + 4 bytes over
# PCIe), and torch's fused CPU AdamW reading the fp32 weight, gradient and moments and writing weight and moments
# (16 + 12 bytes of host memory traffic).  ESTIMATES from the data sizes, not measured.
OFFLOAD_PCIE_BYTES_PER_ELEMENT = 8
OFFLOAD_CPU_BYTES_PER_ELEMENT = 28
BF16 = 2


@dataclass
class StageTime:
    compute_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    pp_s: float
    measured_layers: int
    estimated_layers: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_s + self.cp_s + self.ep_s + self.pp_s


@dataclass
class StepTime:
    stages: List[StageTime]
    pipeline_s: float
    bubble_s: float
    dp_exposed_s: float
    dp_total_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    basis: str


def _layer_compute_s(args, layout, gpu, i, moe: bool, full: bool, recompute: bool, tokens: float, calibration,
                     efficiency: float, notes: set):
    """(seconds, measured?) of one layer's forward + backward of one micro-batch on one rank.  The calibration
    was measured at TP1 / CP1 (one GPU): other layouts use the estimate."""
    cfg = args.model_config
    if calibration is not None and layout.tp == 1 and layout.cp == 1:
        local = cfg.n_routed_experts // layout.ep
        got = calibration.layer_ms("moe" if moe else "dense", tokens, local, recompute, cfg.hidden_size)
        if got is not None:
            if got[1]:
                notes.add(got[1])
            return got[0] / 1e3, True
    sparse = args.dsa_stage == "sparse"
    f = layer_forward_flops(cfg, i, args.seq_length, sparse, moe=moe, full_indexer=full) * tokens / layout.tp
    passes = 4 if recompute else 3
    return passes * f / (gpu.bf16_dense_tflops * 1e12 * efficiency), False


def stage_time(args, layout, gpu, pp_rank: int, calibration, efficiency: float, notes: set) -> StageTime:
    from megatron_glm5.planning.activations import recomputed_layers

    cfg = args.model_config
    tp, cp, ep, etp = layout.tp, layout.cp, layout.ep, layout.etp
    tokens = args.seq_length * args.micro_batch_size / cp
    h = cfg.hidden_size
    layers = layout.stage_layers(pp_rank)
    chunks = layout.chunks[pp_rank]
    covered = list(recomputed_layers(len(layers), args.recompute_granularity, args.recompute_method,
                                     args.recompute_num_layers or 1))
    items = [(i, cfg.is_moe_layer(i), cfg.is_full_indexer_layer(i), rc) for i, rc in zip(layers, covered)]
    if any(c.mtp for c in chunks):
        items += [(None, True, True, args.recompute_granularity == "full")] * args.mtp_steps
    compute = tp_s = cp_s = ep_s = 0.0
    measured = estimated = 0
    for i, moe, full, rc in items:
        s, m = _layer_compute_s(args, layout, gpu, 0 if i is None else i, moe, full, rc, tokens, calibration,
                                efficiency, notes)
        compute += s
        measured += m
        estimated += not m
        forwards = 2 if rc else 1  # a recomputed layer runs its forward (and its collectives) twice
        passes = forwards + 1
        tp_s += passes * 4 * comm.ring(tokens * h * BF16, tp, 1, gpu)
        cp_s += passes * comm.ring(tokens * cp * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16, cp, tp, gpu)
        if moe:
            routed = tokens / tp * cfg.num_experts_per_tok * h * BF16
            ep_s += passes * 2 * comm.all_to_all(routed, ep, etp, gpu)
    if any(c.post_process for c in chunks):  # LM head (+ MTP heads): 2*h*V FLOPs per token, x3 for training
        heads = 1 + (args.mtp_steps if any(c.mtp for c in chunks) else 0)
        compute += heads * 3 * 2 * h * cfg.vocab_size * tokens / tp / (gpu.bf16_dense_tflops * 1e12 * efficiency)
    pp_s = 0.0
    if layout.pp > 1:
        across = layout.world // layout.pp >= gpu.gpus_per_node
        boundaries = 2 if 0 < pp_rank < layout.pp - 1 else 1
        pp_s = 2 * boundaries * len(chunks) * comm.p2p(tokens * h * BF16 / tp, across, gpu)
    return StageTime(compute, tp_s, cp_s, ep_s, pp_s, measured, estimated)


def dp_time(args, layout, gpu, static) -> float:
    """Seconds of this rank's data-parallel gradient + parameter collectives (ring, per bucket)."""
    t = 0.0
    dtype = 2 if args.bf16 else 4
    for name, n in static.buckets:
        size, stride = (layout.edp, layout.ep * layout.etp) if name == "experts" else \
            (layout.dense_shards, layout.tp)
        grad = static.grad_dtype_bytes  # --grad-reduce-dtype
        if args.use_distributed_optimizer:
            t += comm.ring(n * grad, size, stride, gpu) + comm.ring(n * dtype, size, stride, gpu)
        else:
            t += 2 * comm.ring(n * grad, size, stride, gpu)
    return t


def optimizer_step_s(static, gpu, gpu_s_per_element: float, args) -> float:
    """One rank's optimizer step: its GPU-resident elements at ``gpu_s_per_element``; with --optimizer-cpu-offload
    the offloaded ones' gradients to the host and weights back over PCIe (4 bytes each way per element: fp32 on
    the host side) plus torch's CPU AdamW at the host memory bandwidth (OFFLOAD_CPU_BYTES_PER_ELEMENT), the two
    in sequence (or the longer of them with --overlap-cpu-optimizer-d2h-h2d); the GPU's part runs meanwhile."""
    on_gpu = sum(static.gpu_optimizer_elements()) * gpu_s_per_element
    n = static.offloaded_elements
    if not n:
        return on_gpu
    pcie = n * OFFLOAD_PCIE_BYTES_PER_ELEMENT / (gpu.pcie_gb_s * 1e9)
    cpu = n * OFFLOAD_CPU_BYTES_PER_ELEMENT / (gpu.host_memory_gb_s * 1e9)
    host = max(pcie, cpu) if getattr(args, "overlap_cpu_optimizer_d2h_h2d", False) else pcie + cpu
    return max(on_gpu, host)


def step_time(args, layout, gpu, statics, calibration, efficiency: float = DEFAULT_EFFICIENCY) -> StepTime:
    """``statics``: per pipeline rank, the StaticMemory of its worst rank (for the DP collectives and the
    optimizer step)."""
    m = args.num_microbatches
    notes: set = set()
    stages = [stage_time(args, layout, gpu, r, calibration, efficiency, notes) for r in range(layout.pp)]
    per_mb = [s.total_s for s in stages]
    slowest = max(per_mb)
    fill = sum(per_mb) / layout.vpp
    pipeline = (m - 1) * slowest + fill if layout.pp > 1 else m * slowest
    bubble = pipeline - m * slowest if layout.pp > 1 else 0.0
    dp_total = max(dp_time(args, layout, gpu, st) for st in statics)
    window = 0.0
    if args.overlap_grad_reduce:
        window += slowest * 2 / 3 / layout.vpp  # the last micro-batch's backward
    if args.overlap_param_gather:
        window += slowest / 3 / layout.vpp  # the first micro-batch's forward
    dp_exposed = max(0.0, dp_total - window)
    per_element = calibration.optimizer_s_per_element() if calibration is not None else None
    gpu_per_element = per_element if per_element is not None else OPTIMIZER_BYTES_PER_ELEMENT / (gpu.hbm_tb_s * 1e12)
    opt = max(optimizer_step_s(st, gpu, gpu_per_element, args) for st in statics)
    step = pipeline + dp_exposed + opt
    tokens = args.global_batch_size * args.seq_length
    tps = tokens / step / layout.world
    cfg = args.model_config
    mtp_layers = args.mtp_steps if args.mtp else 0
    flops = training_flops_per_token(cfg, args.seq_length, args.dsa_stage == "sparse", mtp_layers)
    mfu = flops * tps / (gpu.bf16_dense_tflops * 1e12)
    measured = sum(s.measured_layers for s in stages)
    estimated = sum(s.estimated_layers for s in stages)
    if estimated == 0:
        basis = "measured layer times (calibration table) + alpha-beta communication estimate"
    elif measured == 0:
        basis = (f"ESTIMATE: datasheet {gpu.bf16_dense_tflops:g} TFLOP/s dense bf16 x assumed efficiency "
                 f"{efficiency:g}, alpha-beta communication from datasheet bandwidths; nothing measured")
    else:
        basis = (f"partly measured: {measured} layer(s) from the calibration table, {estimated} estimated at "
                 f"{efficiency:g} x the datasheet rate")
    if per_element is not None:
        basis += "; optimizer step measured"
    if measured:
        attn = {r.get("attn") for r in calibration.rows}
        basis += f" (layers timed with --attn {', '.join(sorted(map(str, attn)))} on {calibration.device}, " \
                 f"{calibration.date}{'; ' + '; '.join(sorted(notes)) if notes else ''})"
    return StepTime(stages=stages, pipeline_s=pipeline, bubble_s=bubble, dp_exposed_s=dp_exposed,
                    dp_total_s=dp_total, optimizer_s=opt, step_s=step, tokens_per_s_per_gpu=tps, mfu=mfu,
                    basis=basis)
