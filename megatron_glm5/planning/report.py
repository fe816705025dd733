"""The plan as text: layout, per pipeline stage its parameters by kind and memory breakdown (its worst rank), the
step time and the verdict."""
from __future__ import annotations

import os
from typing import List

from megatron_glm5.planning.gpus import HOST_USABLE
from megatron_glm5.planning.memory import CONTEXT_BYTES, FRAGMENTATION, GIB


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B"


def _g(n: float) -> str:
    return f"{n / GIB:6.2f}"


def verdict(plan) -> str:
    host = ""
    if plan.host_memory_gib:
        room = plan.gpu.host_gib_per_gpu
        host = (f"; host memory {plan.host_memory_gib:.1f} GiB per rank for the offloaded optimizer "
                f"{'fits' if plan.host_fits else 'DOES NOT FIT'} its share of a node ({room:.0f} GiB: "
                f"{HOST_USABLE:.0%} of {plan.gpu.host_ram_gib:.0f} GiB / {plan.gpu.gpus_per_node} GPUs)")
    gpu = _gpu_verdict(plan)
    if plan.peak_memory_gib <= plan.gpu.memory_gib and not plan.host_fits:
        gpu = "DOES NOT FIT (host memory): " + gpu[len("FITS: "):]
    return gpu + host


def _gpu_verdict(plan) -> str:
    gap = plan.gpu.memory_gib - plan.peak_memory_gib
    worst = plan.worst
    where = f"rank {worst.rank} (pipeline stage {worst.pp_rank})"
    if gap >= 0:
        return (f"FITS: peak {plan.peak_memory_gib:.1f} GiB on {where}, {gap:.1f} GiB below the "
                f"{plan.gpu.memory_gib:.1f} GiB of one {plan.gpu.name}")
    return (f"DOES NOT FIT: peak {plan.peak_memory_gib:.1f} GiB on {where} is {-gap:.1f} GiB over the "
            f"{plan.gpu.memory_gib:.1f} GiB of one {plan.gpu.name}")


def render(plan) -> str:
    a, lay, t = plan.args, plan.layout, plan.time
    out: List[str] = []
    cfg = a.model_config
    out.append(f"GLM-5 layout plan: {plan.total_params / 1e9:.1f}B parameters "
               f"({cfg.num_hidden_layers} layers{', + MTP' if a.mtp else ''}) on {lay.world} x {plan.gpu.name}")
    out.append(f"  TP{lay.tp} PP{lay.pp}{f' VPP{lay.vpp}' if lay.vpp > 1 else ''} CP{lay.cp} EP{lay.ep} "
               f"ETP{lay.etp} -> DP{lay.dp}, expert DP{lay.edp}; seq {a.seq_length}, micro-batch "
               f"{a.micro_batch_size}, global batch {a.global_batch_size} ({a.num_microbatches} micro-batches per "
               f"pipeline); {'bf16' if a.bf16 else 'fp32'}, recompute {a.recompute_granularity or 'none'}"
               f"{', distributed optimizer' if a.use_distributed_optimizer else ''}")
    out.append("")
    out.append("per pipeline stage (its worst rank; ranks of a stage differ only in their optimizer shard):")
    head = ("stage", "layers", "dense", "experts", "emb/head", "MTP", "weights", "grads", "optim", "activ",
            "working", "opt-step", "ctx+margin", "total GiB")
    out.append("  " + " ".join(f"{h:>9}" for h in head))
    for r in range(lay.pp):
        w = plan.stage_worst(r)
        m, s = w.memory, w.memory.static
        layers = lay.stage_layers(r)
        cells = (str(r), f"{layers[0]}-{layers[-1]}" if layers else "-", _b(s.params["dense"]),
                 _b(s.params["experts"]), _b(s.params["embedding"]), _b(s.params["mtp"]), _g(s.weight_bytes),
                 _g(s.grad_bytes), _g(s.optimizer_bytes), _g(m.activation_bytes), _g(m.working_bytes),
                 _g(m.optimizer_step_bytes), _g(m.context_bytes + m.margin_bytes), _g(m.total_bytes))
        out.append("  " + " ".join(f"{c:>9}" for c in cells))
    grad_dtype = "bf16 (--grad-reduce-dtype bf16)" if plan.worst.memory.static.grad_dtype_bytes == 2 else \
        "fp32 (grad_reduce_in_fp32)"
    out.append(f"  weights: bf16 parameters (padded DDP parameter buffer under the distributed optimizer); grads: "
               f"{grad_dtype}; optim: fp32 main copy + Adam m, v of the rank's shard on the GPU (dense over DP x CP,")
    out.append(f"  experts over expert DP); activ: kept for backward x micro-batches in flight (1F1B: PP - stage); "
               f"working: the recomputed layer + MoE dispatch buffers + our sparse backward's P / dS buffers, or the "
               f"logits/loss on the last stage; "
               f"opt-step: torch AdamW's foreach temporary during the optimizer step; total = weights + grads + "
               f"optim + max(activ + working, opt-step) + ctx+margin (CUDA context/NCCL {CONTEXT_BYTES / GIB:g} GiB + "
               f"{FRAGMENTATION:.0%} allocator margin: assumptions). Activations are an ESTIMATE "
               f"(planning/activations.py; within 1% of 8 one-GPU runs, docs/performance.md).")
    host = plan.worst.memory.static
    if host.offload_fraction:
        out.append(f"  --optimizer-cpu-offload: {100 * host.offload_fraction:.0f}% of each optimizer's fp32 master copies "
                   f"and moments (+ gradient copies) in pinned host memory, {host.host_optimizer_bytes / GIB:.2f} GiB for rank "
                   f"{plan.worst.rank} ({host.offloaded_elements / 1e9:.2f}B elements stepped on the CPU)")
    out.append("")
    out.append(f"step time {t.step_s:.2f} s  (pipeline {t.pipeline_s:.2f} s of which bubble {t.bubble_s:.2f} s; "
               f"data-parallel collectives {t.dp_total_s:.2f} s, exposed {t.dp_exposed_s:.2f} s; optimizer "
               f"{t.optimizer_s:.3f} s)")
    for r, s in enumerate(t.stages):
        out.append(f"  stage {r}: one micro-batch {s.total_s * 1e3:.0f} ms = compute {s.compute_s * 1e3:.0f} + TP "
                   f"{s.tp_s * 1e3:.0f} + CP {s.cp_s * 1e3:.0f} + EP all-to-all {s.ep_s * 1e3:.0f} + PP "
                   f"{s.pp_s * 1e3:.0f} ms")
    out.append(f"tokens/s/GPU {t.tokens_per_s_per_gpu:.0f}, MFU {100 * t.mfu:.1f}% of {plan.gpu.bf16_dense_tflops:g} "
               f"TFLOP/s")
    out.append(f"  basis: {t.basis}")
    if plan.calibration is not None:
        c = plan.calibration
        out.append(f"  calibration: {os.path.relpath(c.path)} ({c.date}, {c.device})")
    out.append("")
    out.append(verdict(plan))
    return "\n".join(out)
