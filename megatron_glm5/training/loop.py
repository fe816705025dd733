"""The training loop behind pretrain_glm5.py and finetune_glm5.py (megatron-core, not megatron.training).

    setup: process groups -> tokenizer -> model chunks (this rank's pipeline stages) -> DDP -> optimizer ->
           LR schedule -> checkpoint -> data streams
    each iteration: get_forward_backward_func() runs the pipeline schedule over num_microbatches micro-batches
           (loss summed over tokens, normalised by the token count across micro-batches and data-parallel ranks
           in finalize_model_grads, which also updates the routers' expert biases) -> optimizer.step() (skipped
           when a loss or gradient is not finite on any rank: numerics.py) -> scheduler.step(global batch) ->
           log (loss spikes too) / evaluate / save / exit checks; at the end, the bad samples skipped per file
"""
from __future__ import annotations

import itertools
import logging
import signal
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_glm5 import platform
from megatron_glm5.training import fault_hooks, manual_gc, memory_options, muon_flags, numerics
from megatron_glm5.training.device import current_device
from megatron_glm5.training.metrics import StepLogger, TrainingMetrics, check_tensorboard_dir

log = logging.getLogger("megatron_glm5.train")


class _ExitSignal:
    """Turns the exit signal (SIGTERM, or SLURM's SIGUSR1 warning) into 'save at the end of this step, exit 0'.

    Ctrl-C (SIGINT) does the same the first time; a second Ctrl-C stops at once (KeyboardInterrupt, exit status
    130, no checkpoint of the unfinished step). ``restore()`` puts the previous handlers back at the end of a run;
    ``hold()`` instead, when the run ends on a lost rank, keeps both signals recorded and nothing more."""

    def __init__(self, name: str):
        self.received = False
        self.holding = False
        self._interrupts = 0
        self._previous = {}
        for signum in {getattr(signal, name), signal.SIGINT}:
            self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum, frame):
        if self.holding:
            self.received = True
            return
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
            log.warning("received SIGINT (Ctrl-C): finishing this step, saving, exiting; Ctrl-C again stops at once")
        else:
            log.warning("received %s: finishing this step, saving, exiting", signal.Signals(signum).name)
        self.received = True

    def hold(self) -> None:
        """The run ends on a lost rank (watchdog.JobFailure): from here both signals are only recorded, and the
        handlers stay.  torchrun stops the surviving ranks with SIGTERM as soon as the lost one has exited; with the
        default action back, that SIGTERM could end this process before ``arguments.main_guard`` prints the line
        naming the lost rank and exits (status 3) -- seen once on a loaded 2-core machine."""
        self.holding = True

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def any_rank(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=current_device())
        if dist.is_initialized():
            dist.all_reduce(flag)
        return bool(flag.item() > 0)


def auto_attention_backend(args, overrides) -> str:
    """--attn auto in training: the installed backend measured fastest at this run's attention shape (local heads,
    widths, top-k, sequence bucket, dtype) on this GPU (ops/autotune.py, cached), decided on global rank 0 alone and
    broadcast, so that every rank of the job runs the same kernels (a near tie measured on each rank could
    otherwise pick different ones). Without CUDA: the fixed order (ops/registry.AUTO_PREFERENCE)."""
    from megatron_glm5.ops import get_backend
    from megatron_glm5.ops.autotune import shape_from_config

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    name = None
    if not several or dist.get_rank() == 0:
        shape = None
        if torch.cuda.is_available():
            tcfg = args.model_config.to_transformer_config(**dict(overrides, dsa_backend="torch"))
            shape = shape_from_config(tcfg, seq_length=args.seq_length)
        name = get_backend("auto", shape=shape).name
    if several:
        chosen = [name]
        dist.broadcast_object_list(chosen, src=0)
        name = chosen[0]
    return name


def build_model_chunks(args):
    from megatron_glm5.arguments import args_to_overrides
    from megatron_glm5.lora.apply import apply_lora
    from megatron_glm5.model.init import initialize_by_global_identity
    from megatron_glm5.model.model import build_model

    overrides = args_to_overrides(args)
    if overrides.get("dsa_backend") == "auto":
        overrides["dsa_backend"] = auto_attention_backend(args, overrides)
    warmup = args.dsa_stage == "dense-warmup"  # trains the indexers alone (args_to_overrides keeps the bias too)
    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        model = build_model(args.model_config, mtp=args.mtp, vp_stage=vp_stage,
                            base_precision=getattr(args, "base_precision", "bf16"), **overrides)
        if warmup:
            _train_only_indexers(model)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if not args.load:  # from scratch: the same --seed gives the same model at every layout (model/init.py)
            initialize_by_global_identity(model, args.seed)
        if getattr(args, "lora", None) is not None:  # adapters on a frozen base (megatron_glm5/lora/)
            apply_lora(model, args.lora, args.seed)
        chunks.append(model)
    return chunks


def _train_only_indexers(model):
    """--dsa-stage dense-warmup: freeze everything but the lightning indexers (trained by their KL loss alone),
    before DDP and the optimizer collect the trainable parameters."""
    from megatron_glm5.model.dsa import GLM5Indexer

    keep = {id(p) for m in model.modules() if isinstance(m, GLM5Indexer) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def wrap_ddp(args, chunks):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        **memory_options.ddp_config_values(args), overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=muon_flags.ddp_shards_grads(args),
        check_for_nan_in_grad=False, bucket_size=None)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_cfg, module=m,
                                    disable_bucketing=(i > 0)) for i, m in enumerate(chunks)]


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    n = mask.sum()
    return loss, n.to(torch.int), {"lm loss": torch.stack([loss.detach(), n.detach()])}


def _forward_step(data_iterator, model):
    from megatron_glm5.data.packing import make_packed_seq_params
    from megatron_glm5.training.data import batch_for_this_cp_rank

    batch = next(data_iterator)
    device = current_device()
    packed = None
    if "cu_seqlens" in batch:
        packed = make_packed_seq_params(batch["cu_seqlens"].to(device), batch["tokens"].shape[1])
    batch = batch_for_this_cp_rank(batch)
    tokens = batch["tokens"].to(device)
    output = model(tokens, batch["position_ids"].to(device), None, labels=batch["labels"].to(device),
                   loss_mask=batch["loss_mask"].to(device), packed_seq_params=packed)
    return output, partial(_loss_func, batch["loss_mask"].to(device))


def _schedule_shape(args):
    """(seq_length, micro_batch_size) as the pipeline schedule sees activations: packed micro-batches are one
    THD row of micro_batch_size * seq_length tokens."""
    if args.mode == "finetune" and args.packing:
        return args.seq_length * args.micro_batch_size, 1
    return args.seq_length, args.micro_batch_size


def _run_microbatches(args, model, data_iter, forward_only: bool, num_microbatches: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_glm5.model import pipeline_topk

    seq, mbs = _schedule_shape(args)
    fwd_bwd = get_forward_backward_func()
    # with virtual pipeline stages every model chunk walks the same micro-batches through its own iterator
    iterators = data_iter if len(model) == 1 else list(itertools.tee(data_iter, len(model)))
    forward_step = fault_hooks.current().wrap_forward_step(_forward_step)  # itself unless a test injects faults
    out = fwd_bwd(forward_step_func=forward_step, data_iterator=iterators,
                  model=model, num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mbs,
                  forward_only=forward_only)
    pipeline_topk.wait_pending_sends()  # IndexShare top-k sent to the next pipeline stage (model/pipeline_topk.py)
    return out


def _reduce_lm_loss(outputs) -> float | None:
    """Token-weighted mean LM loss of this step over micro-batches and data-parallel ranks (last stage only)."""
    from megatron.core import parallel_state as ps

    if not outputs:
        return None
    total = torch.stack([o["lm loss"] for o in outputs]).sum(0)
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item()


def evaluate(args, model, valid):
    from megatron_glm5.training.data import valid_stream

    stream = valid_stream(valid, args)
    if stream is None:
        return None
    for m in model:
        m.eval()
    losses = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            out = _run_microbatches(args, model, stream, forward_only=True, num_microbatches=args.num_microbatches)
            losses.append(_reduce_lm_loss(out))
    for m in model:
        m.train()
    losses = [x for x in losses if x is not None]
    return sum(losses) / len(losses) if losses else None


def train(args) -> int:
    """Run training as configured by parsed and validated ``args``. Returns the process exit code."""
    session = _Session()
    try:
        return _train(args, session)
    except Exception as e:  # a collective that failed because a peer died or stopped: one line naming it
        failure = session.explain(e)
        if failure is None:
            raise
        session.end_on_lost_rank()
        raise failure from None
    finally:
        session.close()
        fault_hooks.end_run()


class _Session:
    """What a run holds while it lives and lets go of at its end, however it ends: its directory's lock and the
    watchdog thread."""

    def __init__(self):
        self.run = None
        self.watchdog = None
        self.exit_signal = None

    def beat(self, iteration: int, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(iteration, phase)

    def explain(self, exc: BaseException):
        """watchdog.JobFailure naming the lost rank when ``exc`` is a failed collective, else None."""
        return self.watchdog.explain(exc) if self.watchdog is not None else None

    def end_on_lost_rank(self) -> None:
        """The run ends on a lost rank (watchdog.JobFailure): the exit signal is held (``_ExitSignal.hold``), and
        ``close`` leaves it so."""
        if self.exit_signal is not None:
            self.exit_signal.hold()

    def close(self) -> None:
        if self.exit_signal is not None and not self.exit_signal.holding:
            self.exit_signal.restore()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.run is not None:
            self.run.release()


def _train(args, session: "_Session") -> int:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron_glm5.data.tokenizer import load_tokenizer
    from megatron_glm5.errors import UserError
    from megatron_glm5.training import checkpointing
    from megatron_glm5.data.jsonl import SKIPPED_SAMPLES
    from megatron_glm5.training.data import build_streams
    from megatron_glm5.training.optim import build_optimizer, build_scheduler
    from megatron_glm5.training import run_dir
    from megatron_glm5.training.run_summary import RunSummary
    from megatron_glm5.training.watchdog import Watchdog

    from megatron_glm5.mcore_patches import registry as mcore_patches
    from megatron_glm5.mcore_patches.record import Phase

    mcore_patches.apply_phase(Phase.TRAINING)
    start_time = time.time()
    exit_signal = session.exit_signal = _ExitSignal(args.exit_signal)
    platform.initialize_model_parallel(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
        cp=args.context_parallel_size, vpp=args.virtual_pipeline_model_parallel_size, seed=args.seed,
        timeout_minutes=args.distributed_timeout_minutes)
    if dist.get_world_size() > 1:  # a rank that stops progressing names the ranks it waits for (watchdog.py)
        session.watchdog = Watchdog(args.distributed_timeout_minutes * 60, dist.get_rank(), dist.get_world_size())
    if args.eval_only:
        args.save = None  # an evaluation writes nothing
        args.tensorboard_dir = None
    else:
        check_tensorboard_dir(args)  # a read-only --tensorboard-dir stops here, not at the first report
        session.run = run_dir.claim(args)  # this run's directory: fresh, or the run it continues (run_dir.py)

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except UserError as e:
        raise UserError(f"--tokenizer {args.tokenizer}: {e}") from None
    if tokenizer.vocab_size > args.model_config.vocab_size:
        raise UserError(f"--tokenizer {args.tokenizer}: vocabulary of {tokenizer.vocab_size} tokens is larger than "
                        f"the model's vocab_size {args.model_config.vocab_size}")

    model = wrap_ddp(args, build_model_chunks(args))
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    config = model[0].module.config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if args.overlap_grad_reduce and len(model) > 1:
        config.grad_sync_func = [m.start_grad_sync for m in model]

    iteration, data_state = 0, {}
    session.beat(0, "load")
    if getattr(args, "lora", None) is not None:  # the base's weights, then this run's adapters (lora/checkpoint.py)
        from megatron_glm5.lora import checkpoint as lora_checkpoint
        resumed = lora_checkpoint.load(args, [m.module for m in model], optimizer, scheduler)
        iteration, data_state = resumed["iteration"], resumed["data_state"]
    elif args.load:
        resumed = checkpointing.load_checkpoint(args.load, [m.module for m in model], optimizer, scheduler, args)
        iteration, data_state = resumed["iteration"], resumed["data_state"]
    SKIPPED_SAMPLES.clear()  # filled by the readers (--skip-bad-samples), reported at the end
    train_stream, valid = build_streams(args, tokenizer, consumed_train=data_state.get("consumed_train", 0))

    metrics = TrainingMetrics(args, model)
    logger = StepLogger(args, metrics)
    # a non-finite loss or gradient on any rank skips the update (numerics.py says what a skipped step does)
    guard = numerics.NonFiniteGuard(args.max_skipped_steps).install(optimizer)
    spikes = numerics.LossSpikeDetector(args.loss_spike_threshold, args.loss_spike_window)
    faults = fault_hooks.start_run()  # no-op hooks unless a test injects faults (fault_hooks.py)
    logger.summary(model)
    if args.eval_only:
        return _evaluate_only(args, model, valid, logger, iteration)
    summary = RunSummary(iteration, args.global_batch_size * args.seq_length)
    if iteration >= args.train_iters:
        log.warning("nothing to train: the checkpoint is at iteration %d and --train-iters is %d; raise "
                    "--train-iters to continue, or evaluate it with --eval-only", iteration, args.train_iters)
        logger.close()
        if logger.is_logger:
            _log_summary(args, summary, time.time() - start_time)
        return 0

    collector = manual_gc.ManualGC(args.manual_gc, args.manual_gc_interval)  # --manual-gc
    saver = checkpointing.CheckpointSaver(args)  # logs "saved checkpoint ..." once a checkpoint is complete

    def save(it):
        collector.before_sync_point()
        saver.save(it, [m.module for m in model], optimizer, scheduler, {"consumed_train": train_stream.consumed})

    def run_eval(it):
        collector.before_sync_point()
        session.beat(it, "eval")
        loss = evaluate(args, model, valid)
        logger.eval(it, loss)
        summary.note_eval(it, loss)

    if valid is not None and args.eval_interval and iteration == 0:
        run_eval(0)
    for m in model:
        m.train()
    exit_code = 0
    collector.start()
    try:
        while iteration < args.train_iters:
            t0 = time.time()
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            metrics.before_step()
            faults.start_step(iteration + 1)
            session.beat(iteration + 1, "step")
            outputs = _run_microbatches(args, model, train_stream, forward_only=False,
                                        num_microbatches=args.num_microbatches)
            faults.after_backward(model)
            guard.note_loss(iteration + 1, outputs)
            step_lr = optimizer.param_groups[0]["lr"]  # what this update uses (logged: the scheduler moves it on below)
            ok, grad_norm, _ = optimizer.step()
            if ok:  # the LR schedule follows applied updates; a skipped step still consumed its data
                scheduler.step(increment=args.global_batch_size)
            iteration += 1
            summary.note_iteration(iteration)
            lm_loss = _reduce_lm_loss(outputs) if ps.is_pipeline_last_stage(ignore_virtual=True) else None
            logger.loss_spike(iteration, lm_loss, spikes.update(iteration, lm_loss))
            logger.step(iteration, lm_loss, grad_norm, ok, time.time() - t0, optimizer, lr=step_lr)
            collector.after_step(iteration)
            saver.poll()  # --async-save: finalize a checkpoint whose files are written
            guard.after_step(iteration, ok)  # raises after --max-skipped-steps skips in a row

            if args.eval_interval and valid is not None and iteration % args.eval_interval == 0:
                run_eval(iteration)
            stop = exit_signal.any_rank()
            if args.exit_interval and iteration % args.exit_interval == 0:
                stop = True
            if args.exit_duration_in_mins:
                elapsed = torch.tensor([(time.time() - start_time) / 60], device=current_device())
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                stop = stop or elapsed.item() > args.exit_duration_in_mins
            if args.save and (stop or (args.save_interval and iteration % args.save_interval == 0)
                              or iteration == args.train_iters):
                session.beat(iteration, "save")
                save(iteration)
            if stop:
                log.info("exiting at iteration %d", iteration)
                break
    finally:
        collector.stop()
    session.beat(iteration, "save")
    saver.wait()  # --async-save: the pending checkpoint completes before exit
    if valid is not None and iteration == args.train_iters and args.eval_interval and iteration % args.eval_interval:
        run_eval(iteration)
    logger.close()
    SKIPPED_SAMPLES.log_summary()
    if logger.is_logger:
        _log_summary(args, summary, time.time() - start_time)
    return exit_code


def _log_summary(args, summary, seconds: float) -> None:
    from megatron_glm5.checkpoint import format as ckpt_format

    latest = ckpt_format.read_latest(args.save) if args.save else None
    if latest is not None:
        summary.note_checkpoint(ckpt_format.iteration_dir(args.save, latest))
    launcher = f"{args.mode}_glm5.py"
    if dist.is_initialized() and dist.get_world_size() > 1:
        launcher = f"-m torch.distributed.run --nproc-per-node {dist.get_world_size()} {launcher}"
    for line in summary.lines(seconds, args.save, args.tensorboard_dir, launcher):
        log.info("%s", line)


def _evaluate_only(args, model, valid, logger, iteration: int) -> int:
    """--eval-only: validation loss and perplexity of the loaded checkpoint, nothing written."""
    import math

    if valid is None:
        from megatron_glm5.errors import UserError
        raise UserError("--eval-only: no validation data (give --valid-data-path, or a --split with a "
                        "validation part)")
    loss = evaluate(args, model, valid)
    if logger.is_logger and loss is not None:
        log.info("evaluation of %s (iteration %d): lm loss %.4f | ppl %.2f | %d rounds of %d sequences",
                 args.load, iteration, loss, math.exp(min(loss, 50)), args.eval_iters, args.global_batch_size)
    logger.close()
    return 0
