"""A layout plan: per rank its parameters, memory and verdict, and the step time of the whole layout.

    args = validate_args(parse_args(argv), world_size=N, check_device=False)
    plan = make_plan(args, get_gpu("h200-141gb"))
    plan.fits, plan.peak_memory_gib, plan.to_json()

Ranks are enumerated in megatron-core's order (dense groups tp-cp-ep-dp-pp, expert groups etp-ep-edp-pp): a rank's
pipeline rank is ``rank // (world / PP)``, its shard of the dense data-parallel x context-parallel group
``(rank % (world / PP)) // TP`` and its expert data-parallel shard ``(rank % (world / PP)) // (ETP x EP)``.  Ranks
of one pipeline stage differ only in which optimizer shard they own; the text report shows each stage's worst.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_glm5.planning import calibration as calib
from megatron_glm5.planning.buffers import rank_buffers, static_memory
from megatron_glm5.training import memory_options
from megatron_glm5.planning.inventory import total_parameters
from megatron_glm5.planning.layout import Layout, build_layout
from megatron_glm5.planning.memory import GIB, RankMemory, rank_memory
from megatron_glm5.planning.step_time import DEFAULT_EFFICIENCY, StepTime, step_time


@dataclass
class RankPlan:
    rank: int
    pp_rank: int
    dense_shard: int
    expert_shard: int
    memory: RankMemory

    def to_json(self) -> Dict:
        s = self.memory.static
        return {"rank": self.rank, "pp_rank": self.pp_rank, "dense_shard": self.dense_shard,
                "expert_shard": self.expert_shard, "params": dict(s.params),
                "param_bytes": s.param_bytes, "weight_bytes": s.weight_bytes, "grad_bytes": s.grad_bytes,
                "optimizer_bytes": s.optimizer_bytes, "host_optimizer_bytes": s.host_optimizer_bytes,
                "memory_bytes": self.memory.breakdown(),
                "tensor_memory_gib": self.memory.tensor_bytes / GIB, "peak_memory_gib": self.memory.total_bytes / GIB}


@dataclass
class Plan:
    args: object
    gpu: object
    layout: Layout
    ranks: List[RankPlan]
    time: StepTime
    calibration: Optional[calib.Calibration]
    efficiency: float

    @property
    def total_params(self) -> int:
        return total_parameters(self.args.model_config, bool(self.args.mtp))

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.memory.total_bytes)

    @property
    def peak_memory_gib(self) -> float:
        return self.worst.memory.total_bytes / GIB

    @property
    def host_memory_gib(self) -> float:
        """The largest host memory one rank's offloaded optimizer state takes (--optimizer-cpu-offload; else 0)."""
        return max(r.memory.static.host_optimizer_bytes for r in self.ranks) / GIB

    @property
    def host_fits(self) -> bool:
        return self.host_memory_gib <= self.gpu.host_gib_per_gpu

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib <= self.gpu.memory_gib and self.host_fits

    def stage_worst(self, pp_rank: int) -> RankPlan:
        return max((r for r in self.ranks if r.pp_rank == pp_rank), key=lambda r: r.memory.total_bytes)

    def to_json(self) -> Dict:
        a, lay = self.args, self.layout
        return {
            "gpu": self.gpu.name, "gpu_memory_gib": self.gpu.memory_gib, "world_size": lay.world,
            "layout": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
                       "dp": lay.dp, "expert_dp": lay.edp, "stage_layers": [len(lay.stage_layers(r))
                                                                             for r in range(lay.pp)]},
            "batch": {"seq_length": a.seq_length, "micro_batch_size": a.micro_batch_size,
                      "global_batch_size": a.global_batch_size, "num_microbatches": a.num_microbatches},
            "total_params": self.total_params,
            "peak_memory_gib": self.peak_memory_gib,
            "fits": self.fits,
            "host_memory_gib": self.host_memory_gib, "host_fits": self.host_fits,
            "margin_gib": self.gpu.memory_gib - self.peak_memory_gib,
            "step_time_s": self.time.step_s,
            "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu,
            "mfu": self.time.mfu,
            "time_basis": self.time.basis,
            "efficiency_assumed": self.efficiency,
            "calibration": None if self.calibration is None else {
                "path": self.calibration.path, "date": self.calibration.date, "device": self.calibration.device},
            "pipeline": {"pipeline_s": self.time.pipeline_s, "bubble_s": self.time.bubble_s,
                         "dp_exposed_s": self.time.dp_exposed_s, "dp_total_s": self.time.dp_total_s,
                         "optimizer_s": self.time.optimizer_s,
                         "stage_microbatch_s": [s.total_s for s in self.time.stages]},
            "per_rank": [r.to_json() for r in self.ranks],
        }


def memory_option_values(args) -> Dict:
    """static_memory's keyword arguments for the memory options (training/memory_options.py)."""
    return {"grad_bytes": memory_options.grad_bytes(args), "offload_fraction": memory_options.offload_fraction(args)}


def rank_coordinates(layout: Layout, rank: int):
    """(pipeline rank, dense data-parallel shard, expert data-parallel shard) of global ``rank``."""
    per_stage = layout.world // layout.pp
    within = rank % per_stage
    return rank // per_stage, within // layout.tp, within // (layout.etp * layout.ep)


def _buffers(args, layout: Layout, pp_rank: int):
    return rank_buffers(layout.chunks[pp_rank], pp_rank=pp_rank, dense_shards=layout.dense_shards,
                        expert_shards=layout.edp, distributed_optimizer=args.use_distributed_optimizer,
                        overlap_grad_reduce=args.overlap_grad_reduce)


def plan_rank(args, rank: int) -> RankPlan:
    """The memory of one rank of validated ``args`` (no step time, no GPU needed)."""
    layout = build_layout(args)
    p, d, e = rank_coordinates(layout, rank)
    st = static_memory(_buffers(args, layout, p), dense_index=d, expert_index=e, bf16=bool(args.bf16),
                       distributed_optimizer=args.use_distributed_optimizer, optimizer=args.optimizer,
                       **memory_option_values(args))
    return RankPlan(rank, p, d, e, rank_memory(args, layout, layout.chunks[p], p, st))


def make_plan(args, gpu, efficiency: float = DEFAULT_EFFICIENCY) -> Plan:
    """The plan of validated ``args`` on ``gpu`` (gpus.GPU)."""
    layout = build_layout(args)
    table = calib.load(gpu.name)
    buffers = [_buffers(args, layout, r) for r in range(layout.pp)]
    cache: Dict = {}
    ranks = []
    for rank in range(layout.world):
        p, d, e = rank_coordinates(layout, rank)
        key = (p, d, e)
        if key not in cache:
            st = static_memory(buffers[p], dense_index=d, expert_index=e, bf16=bool(args.bf16),
                               distributed_optimizer=args.use_distributed_optimizer, optimizer=args.optimizer,
                               **memory_option_values(args))
            cache[key] = rank_memory(args, layout, layout.chunks[p], p, st)
        ranks.append(RankPlan(rank, p, d, e, cache[key]))
    statics = [max((r.memory.static for r in ranks if r.pp_rank == p), key=lambda s: s.optimizer_bytes)
               for p in range(layout.pp)]
    t = step_time(args, layout, gpu, statics, table, efficiency)
    return Plan(args=args, gpu=gpu, layout=layout, ranks=ranks, time=t, calibration=table, efficiency=efficiency)
