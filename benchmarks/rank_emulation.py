"""One rank of a real layout on one GPU: the layers of one pipeline stage at full width, a training step with that
rank's optimizer state, peak memory and step time measured beside the layout planner's prediction for that rank.

    python benchmarks/rank_emulation.py --rank 64 --json out.json -- \\
        --config examples/recipes/glm5.3_sft_32x8.yaml --attn triton

Everything after ``--`` is the training scripts' own flags (``--config`` included); ``--world-size`` (default 256,
the recipe's) and ``--rank`` (default: the first rank of the middle pipeline stage) pick the rank emulated.

How one process stands for rank R of a world of N:

* torch.distributed runs on torch's *fake* process group (``torch.testing._internal.distributed.fake_pg``) of
  world size N as rank R: megatron-core's parallel state, model, DistributedDataParallel and distributed optimizer
  are built exactly as on that rank (same pipeline stage, same E/EP local experts, same DDP buffers and buckets,
  the distributed optimizer's shard of the dense part over DP x CP and of the experts over expert DP), through
  the project's own ``training/loop.py`` (build_model_chunks, wrap_ddp) and ``training/optim.py``
  (build_optimizer).  Every collective is a no-op (it moves no data and takes no time); ``all_gather_object``,
  which the model builder uses only to list the groups of every rank, is answered with this rank's own object
  for every rank (each rank then builds the groups its own pipeline / expert group needs); the gloo groups
  megatron-core creates for the distributed optimizer's checkpointing are fake groups too.
* Dispatch: each MoE layer's token dispatcher is replaced by :class:`LocalPermutationDispatcher`: it gathers
  ``rows_per_expert`` rows for each local expert from this rank's own tokens (row j is the token j mod T of its
  k-th choice, k = (j div T) mod top-k, weighted by the router's combine weight of that choice, T the micro-batch's
  tokens; local expert e takes rows e*R .. (e+1)*R - 1), runs the real grouped-GEMM experts on them and sums the
  rows back per token (fp32 index_add).  With the layout's average load R = T x top-k x EP / E, exactly the rows
  the all-to-all would deliver on a balanced step.  Left out: the all-to-all's time and its buffers (the
  dispatcher's send and receive copies of the routed rows, the planner's ``dispatch_bytes``), and the router's
  imbalance (its choice of experts sets only the combine weights here).
* Pipeline: the stage runs megatron-core's 1F1B order itself (PP - p - 1 warm-up forwards, then one forward and
  one backward per micro-batch, then the cool-down backwards; num_microbatches per step), the received
  activation of each micro-batch a fresh random [s, b, h] tensor and the received output gradient a random one
  (the p2p send / receive of activations and their time are left out; the IndexShare top-k a stage sends to
  the next one is posted on the fake group, moving nothing, and held until the step's end as in training).  The first
  stage's embedding and the last stage's head and loss run as in training (their stage builds them); one
  sequence of ``--seq-length`` tokens per micro-batch (no packing).
* Step: zero the DDP buffers, the micro-batches, megatron-core's ``finalize_model_grads`` (given the global
  batch's token count, which the last stage would broadcast), ``optimizer.step()``.  CUDA events time each
  forward, backward and optimizer step; the step's median after ``--warmup`` steps.  Memory: the peak
  allocation during forward/backward and during the optimizer step (torch.cuda.max_memory_allocated, reset
  between them), max_memory_reserved, and the allocation after each build phase.

The planner's figures come from its API for the same rank (planning.plan.plan_rank / make_plan).  On a CPU (tests)
the same runs with host timing and no allocator statistics.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher  # noqa: E402

from megatron_glm5.arguments import ArgumentError, main_guard  # noqa: E402

GIB = 1024 ** 3


class LocalPermutationDispatcher(MoETokenDispatcher):
    """Stand-in for the EP token dispatcher: ``rows_per_expert`` rows for each of the ``num_local_experts``
    experts, gathered from this rank's own tokens (see the module docstring), summed back per token."""

    def __init__(self, num_local_experts: int, rows_per_expert: int, config, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts, self.rows_per_expert = num_local_experts, rows_per_expert
        self.routed_counts = []  # tokens_per_expert of every dispatch (the test reads it)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        tokens = x.shape[0]
        token, expert = routing_map.nonzero(as_tuple=True)  # token-major, top-k per token
        topk = token.numel() // tokens
        if topk * tokens != token.numel():
            raise RuntimeError("LocalPermutationDispatcher: the router chose a varying number of experts per token "
                               "(token dropping is not emulated)")
        choice_probs = probs[token, expert].view(tokens, topk)
        rows = torch.arange(self.num_local_experts * self.rows_per_expert, device=x.device)
        self._source = rows % tokens
        k = (rows // tokens) % topk
        return x.index_select(0, self._source), choice_probs[self._source, k]

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs  # the all-to-all would run here

    def dispatch_postprocess(self, hidden_states, probs):
        counts = torch.full((self.num_local_experts,), self.rows_per_expert, dtype=torch.long)
        self.routed_counts.append(counts.tolist())
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return hidden_states  # the all-to-all back would run here

    def combine_postprocess(self, hidden_states):
        tokens = self.hidden_shape[:-1].numel()
        out = torch.zeros(tokens, hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
        out = out.index_add(0, self._source, hidden_states.float())
        return out.to(hidden_states.dtype).view(self.hidden_shape)


def rows_per_local_expert(args) -> int:
    """The layout's average rows per local expert: micro-batch tokens x top-k x EP / E (an integer, else error)."""
    cfg = args.model_config
    tokens = args.seq_length * args.micro_batch_size // args.context_parallel_size
    n = tokens * cfg.num_experts_per_tok * args.expert_model_parallel_size
    if n % cfg.n_routed_experts:
        raise ArgumentError(f"--seq-length {args.seq_length}: {tokens} tokens x top-{cfg.num_experts_per_tok} x "
                            f"--ep {args.expert_model_parallel_size} is not a multiple of {cfg.n_routed_experts} "
                            "experts, so the local experts cannot get equal rows; choose --seq-length / "
                            "--micro-batch-size so that it is", flag="--seq-length")
    return n // cfg.n_routed_experts


def install_standins(model_chunks, rows_per_expert: int):
    """Replace every MoE layer's token dispatcher by the stand-in; the list of stand-ins."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    out = []
    for chunk in model_chunks:
        for m in chunk.modules():
            if isinstance(m, MoELayer):
                d = LocalPermutationDispatcher(m.num_local_experts, rows_per_expert, m.token_dispatcher.config,
                                               get_default_pg_collection())
                if m.shared_experts is not None and m.shared_expert_overlap:
                    d.set_shared_experts(m.shared_experts)
                m.token_dispatcher = d
                out.append(d)
    return out


def init_fake_world(world: int, rank: int) -> None:
    """torch.distributed on the fake process group as ``rank`` of ``world`` (see the module docstring)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    def all_gather_object(object_list, obj, group=None):  # every rank is this rank
        for i in range(len(object_list)):
            object_list[i] = obj

    new_group = dist.new_group

    def fake_new_group(*a, **kw):  # megatron-core's gloo groups (optimizer checkpointing) are fake groups too
        kw.pop("backend", None)
        return new_group(*a, **kw)

    dist.all_gather_object = all_gather_object
    dist.new_group = fake_new_group


def init_parallel_state(args) -> None:
    """megatron-core's parallel state for the flags' sizes, through the project's platform layer."""
    from megatron_glm5 import platform

    platform.initialize_model_parallel(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
        cp=args.context_parallel_size, vpp=args.virtual_pipeline_model_parallel_size, seed=args.seed)


class Clock:
    """CUDA events on a GPU, the host clock on a CPU; ``ms(a, b)`` after ``sync()``."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def one_step(args, model, optimizer, clock: Clock, pp_rank: int, device) -> dict:
    """One training step of this stage (1F1B order, random received activations / gradients)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_glm5.model import pipeline_topk

    cfg = args.model_config
    seq, mbs, m = args.seq_length // args.context_parallel_size, args.micro_batch_size, args.num_microbatches
    first = pp_rank == 0
    last = pp_rank == args.pipeline_model_parallel_size - 1
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq)
    set_input = get_attr_wrapped_model(model[0], "set_input_tensor")
    for d in model:
        d.zero_grad_buffer()
    optimizer.zero_grad()
    if torch.cuda.is_available():
        clock.sync()
        torch.cuda.reset_peak_memory_stats()
    fwd_ms, bwd_ms, pending = [], [], []

    def forward():
        ids = torch.randint(1, cfg.vocab_size, (mbs, seq + 1), device=device)
        x = None
        if not first:  # what recv_forward would deliver
            x = torch.randn(seq, mbs, cfg.hidden_size, device=device, dtype=dtype).requires_grad_()
            set_input(x)
        a = clock.mark()
        out = model[0](ids[:, :-1], position_ids, None, labels=ids[:, 1:] if last else None)
        if last:
            out = out.float().sum() / (seq * mbs)
        fwd_ms.append((a, clock.mark()))
        pending.append(out)

    def backward():
        out = pending.pop(0)
        a = clock.mark()
        grad = None if last else torch.randn_like(out) * 1e-3  # what recv_backward would deliver
        torch.autograd.backward(out, grad)
        bwd_ms.append((a, clock.mark()))

    warmup = min(args.pipeline_model_parallel_size - pp_rank - 1, m)
    t0 = clock.mark()
    for _ in range(warmup):
        forward()
    for _ in range(m - warmup):
        forward()
        backward()
    for _ in range(warmup):
        backward()
    pipeline_topk.wait_pending_sends()  # as training/loop.py does: the IndexShare top-k sent to the next stage
    finalize_model_grads(model, num_tokens=torch.tensor(args.global_batch_size * args.seq_length, device=device))
    t1 = clock.mark()
    clock.sync()
    fb_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ok, grad_norm, _ = optimizer.step()
    t2 = clock.mark()
    clock.sync()
    opt_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    f = [clock.ms(a, b) for a, b in fwd_ms]
    b = [clock.ms(a, b) for a, b in bwd_ms]
    return {"step_ms": clock.ms(t0, t2), "microbatches_ms": clock.ms(t0, t1), "optimizer_ms": clock.ms(t1, t2),
            "forward_ms": f, "backward_ms": b, "microbatch_fwd_bwd_ms": [x + y for x, y in zip(f, b)],
            "peak_fwd_bwd_bytes": fb_peak, "peak_optimizer_step_bytes": opt_peak,
            "update_applied": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm)}


def prediction(args, rank: int, gpu_name: str) -> dict:
    """The planner's figures for ``rank`` of this layout."""
    from megatron_glm5.planning.gpus import get_gpu
    from megatron_glm5.planning.plan import make_plan

    plan = make_plan(args, get_gpu(gpu_name))
    r = plan.ranks[rank]
    mem = r.memory
    s = mem.static
    static = s.weight_bytes + s.grad_bytes + s.optimizer_bytes
    stage = plan.time.stages[r.pp_rank]
    m = args.num_microbatches
    return {
        "gpu": gpu_name, "rank": rank, "pp_rank": r.pp_rank, "dense_shard": r.dense_shard,
        "expert_shard": r.expert_shard, "params": dict(s.params), "memory_bytes": mem.breakdown(),
        "dispatch_bytes": mem.dispatch_bytes, "static_bytes": static,
        "fwd_bwd_peak_bytes": static + mem.activation_bytes + mem.working_bytes,
        "fwd_bwd_peak_without_dispatch_bytes": static + mem.activation_bytes + mem.working_bytes - mem.dispatch_bytes,
        "optimizer_step_peak_bytes": static + mem.optimizer_step_bytes,
        "tensor_memory_gib": mem.tensor_bytes / GIB, "peak_memory_gib": mem.total_bytes / GIB,
        "stage_microbatch_compute_s": stage.compute_s, "stage_microbatch_comm_s": stage.total_s - stage.compute_s,
        "optimizer_s": plan.time.optimizer_s,
        "emulated_step_s": m * stage.compute_s + plan.time.optimizer_s,
        "layout_step_time_s": plan.time.step_s, "time_basis": plan.time.basis,
    }


def _median_after(steps, key, warmup):
    vals = [s[key] for s in steps[warmup:]]
    return statistics.median(vals) if vals else None


@main_guard
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=None, help="global rank to emulate (default: the first rank of the "
                   "middle pipeline stage, PP // 2)")
    p.add_argument("--world-size", type=int, default=256)
    p.add_argument("--mode", choices=("finetune", "pretrain"), default="finetune")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gpu", default="h200-141gb", help="the planner's GPU for the prediction")
    p.add_argument("--json", default=None, help="write everything here")
    opts = p.parse_args(argv[:split])
    flags = argv[split + 1:]

    from megatron_glm5.arguments import parse_args, validate_args
    from megatron_glm5.planning.plan import rank_coordinates
    from megatron_glm5.planning.layout import build_layout

    args = validate_args(parse_args(flags, mode=opts.mode), world_size=opts.world_size, check_device=False)
    layout = build_layout(args)
    per_stage = layout.world // layout.pp
    rank = opts.rank if opts.rank is not None else (layout.pp // 2) * per_stage
    if not 0 <= rank < layout.world:
        raise ArgumentError(f"--rank {rank} is outside the world of {layout.world} ranks; use 0..{layout.world - 1}",
                            flag="--rank")
    pp_rank = rank_coordinates(layout, rank)[0]
    predicted = prediction(args, rank, opts.gpu)
    rows = rows_per_local_expert(args)

    init_fake_world(layout.world, rank)
    init_parallel_state(args)
    from megatron_glm5.mcore_patches import registry as mcore_patches
    from megatron_glm5.mcore_patches.record import Phase
    from megatron_glm5.training.loop import build_model_chunks, wrap_ddp
    from megatron_glm5.training.optim import build_optimizer

    mcore_patches.apply_phase(Phase.TRAINING)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t_build = time.perf_counter()
    chunks = build_model_chunks(args)
    after_build = _allocated()
    standins = install_standins(chunks, rows)
    model = wrap_ddp(args, chunks)
    after_ddp = _allocated()
    optimizer = build_optimizer(args, model)
    after_optimizer = _allocated()
    build_s = time.perf_counter() - t_build
    for d in model:
        d.train()
    local_experts = standins[0].num_local_experts if standins else 0
    print(f"rank {rank} of {layout.world}: pipeline stage {pp_rank}, layers {layout.stage_layers(pp_rank)[0]}-"
          f"{layout.stage_layers(pp_rank)[-1]}, {len(standins)} MoE layers x {local_experts} local experts x "
          f"{rows} rows; built in {build_s:.1f} s, {after_ddp / GIB:.2f} GiB allocated after DDP", flush=True)

    clock = Clock()
    steps = []
    for i in range(opts.warmup + opts.steps):
        s = one_step(args, model, optimizer, clock, pp_rank, device)
        s["allocated_after_bytes"] = _allocated()
        steps.append(s)
        print(f"step {i + 1}{' (warm-up)' if i < opts.warmup else ''}: {s['step_ms'] / 1e3:.3f} s (micro-batches "
              f"{s['microbatches_ms'] / 1e3:.3f} s, optimizer {s['optimizer_ms']:.1f} ms); peak fwd/bwd "
              f"{s['peak_fwd_bwd_bytes'] / GIB:.2f} GiB, optimizer step {s['peak_optimizer_step_bytes'] / GIB:.2f} "
              f"GiB", flush=True)
    timed = steps[opts.warmup:] or steps
    mb = [x for s in timed for x in s["microbatch_fwd_bwd_ms"]]
    cuda = torch.cuda.is_available()
    measured = {
        "allocated_after_build_bytes": after_build, "allocated_after_ddp_bytes": after_ddp,
        "allocated_after_optimizer_build_bytes": after_optimizer,
        "allocated_after_steps_bytes": steps[-1]["allocated_after_bytes"],
        "peak_fwd_bwd_bytes": max(s["peak_fwd_bwd_bytes"] for s in timed),
        "peak_optimizer_step_bytes": max(s["peak_optimizer_step_bytes"] for s in timed),
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        "step_s": statistics.median(s["step_ms"] for s in timed) / 1e3,
        "microbatch_fwd_bwd_ms": statistics.median(mb) if mb else None,
        "forward_ms": statistics.median(x for s in timed for x in s["forward_ms"]),
        "backward_ms": statistics.median(x for s in timed for x in s["backward_ms"]),
        "optimizer_ms": statistics.median(s["optimizer_ms"] for s in timed),
        "steps": steps,
    }
    measured["peak_bytes"] = max(measured["peak_fwd_bwd_bytes"], measured["peak_optimizer_step_bytes"])
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "command": "python benchmarks/rank_emulation.py " + " ".join(map(shlex.quote, argv)),
        "rank": rank, "world_size": layout.world, "pp_rank": pp_rank, "stage_layers": layout.stage_layers(pp_rank),
        "moe_layers": len(standins), "local_experts": local_experts, "rows_per_local_expert": rows,
        "routed_counts": [d.routed_counts for d in standins],
        "num_microbatches": args.num_microbatches, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "build_s": build_s,
        "measured": measured, "predicted": predicted,
    }
    pr = predicted
    print("\n| quantity | measured | planner |\n| --- | --- | --- |")
    for name, got, want in (
            ("peak, forward/backward (GiB)", measured["peak_fwd_bwd_bytes"] / GIB,
             pr["fwd_bwd_peak_without_dispatch_bytes"] / GIB),
            ("peak, optimizer step (GiB)", measured["peak_optimizer_step_bytes"] / GIB,
             pr["optimizer_step_peak_bytes"] / GIB),
            ("weights + gradients + optimizer state (GiB)", steps[-1]["allocated_after_bytes"] / GIB,
             pr["static_bytes"] / GIB),
            ("one micro-batch forward + backward (ms)", measured["microbatch_fwd_bwd_ms"],
             pr["stage_microbatch_compute_s"] * 1e3),
            ("optimizer step (ms)", measured["optimizer_ms"], pr["optimizer_s"] * 1e3),
            ("step of this rank, no communication (s)", measured["step_s"], pr["emulated_step_s"])):
        print(f"| {name} | {got:.3f} | {want:.3f} |")
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
