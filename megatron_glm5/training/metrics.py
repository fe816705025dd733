"""What a step reports: console line, TensorBoard scalars, and the run summary at start.

Scalars (TensorBoard tag: meaning): lm-loss, indexer-kl-loss (mean KL of the DSA indexers), mtp-loss,
moe-aux-loss (when an aux loss is on), expert-load-imbalance (max/mean tokens per expert, averaged over MoE
layers), learning-rate, grad-norm, params-norm, tokens-per-second, tflops-per-gpu, mfu (against --peak-tflops),
memory-gib (peak GPU memory, or peak RSS on CPU), skipped-steps (updates skipped for a non-finite loss or
gradient, in all), loss-spikes (in all), and validation/lm-loss; loss-spike (the LM loss) at the iteration of each
spike (numerics.py).
"""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import time

import torch
import torch.distributed as dist

from megatron_glm5.errors import UserError
from megatron_glm5.training.device import current_device
from megatron_glm5.training.flops import training_flops_per_token

log = logging.getLogger("megatron_glm5.train")


def _is_logging_rank() -> bool:
    """The last pipeline stage's first tensor/data-parallel rank holds the loss: it logs."""
    from megatron.core import parallel_state as ps
    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


class TrainingMetrics:
    """Collects per-step statistics from the model chunks (indexer KL, expert load) and the trackers of
    megatron-core (MTP loss, MoE aux losses)."""

    def __init__(self, args, model_chunks):
        from megatron_glm5.model.dsa import GLM5SparseAttention
        from megatron_glm5.model.moe import GLM5Router

        self.args = args
        self.chunks = model_chunks
        self.attn = [m for c in model_chunks for m in c.modules() if isinstance(m, GLM5SparseAttention)
                     and m.indexer is not None]
        self.routers = [m for c in model_chunks for m in c.modules() if isinstance(m, GLM5Router)]
        self._load = []  # per-step expert load imbalance since the last report
        self.steps = 0  # steps since the last report (trackers accumulate over them)
        self._installed = False

    def install(self):
        """Snapshot routers' token counts just before finalize_model_grads consumes them (bias update)."""
        if self._installed:
            return
        cfg = self.chunks[0].module.config
        inner = cfg.finalize_model_grads_func

        def finalize_with_stats(*a, **kw):
            self._snapshot_expert_load()
            return inner(*a, **kw)
        cfg.finalize_model_grads_func = finalize_with_stats
        self._installed = True

    def before_step(self):
        self.steps += 1

    def _snapshot_expert_load(self):
        from megatron.core import parallel_state as ps
        counts = [r.local_tokens_per_expert.detach().clone() for r in self.routers
                  if getattr(r, "local_tokens_per_expert", None) is not None]
        if not counts:
            return
        c = torch.stack(counts).float()
        dist.all_reduce(c, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        self._load.append((c.max(dim=1).values / c.mean(dim=1).clamp(min=1e-9)).mean())

    def indexer_kl(self):
        dev = current_device()
        t = torch.zeros(2, device=dev)
        for m in self.attn:
            if m.kl_log[1]:
                t[0] += torch.as_tensor(m.kl_log[0], device=dev).float()
                t[1] += m.kl_log[1]
            m.kl_log = [0.0, 0]
        dist.all_reduce(t)
        return (t[0] / t[1]).item() if t[1] > 0 else None

    def expert_load_imbalance(self):
        from megatron.core import parallel_state as ps
        t = torch.zeros(2, device=current_device())
        if self._load:
            t[0], t[1] = torch.stack(self._load).mean(), 1
        self._load = []
        dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        return (t[0] / t[1]).item() if t[1] > 0 else None

    def mtp_loss(self):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return None
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
        value = (tracker["loss_values"].float().mean() / (self.args.num_microbatches * max(self.steps, 1))).item()
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        return value

    def moe_aux_loss(self):
        if not self.args.moe_aux_loss_coeff:
            return None
        from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker
        tracker = get_moe_metrics_tracker()
        names = list(tracker.metrics.keys())
        if not names:
            return None
        tracker._sync_metrics(names, None)
        total = sum(float(tracker.metrics[n].values.sum()) for n in names) / (self.args.num_microbatches * max(self.steps, 1))
        tracker.clear()
        return total

    def params_norm(self):
        from megatron.core import parallel_state as ps
        sq = torch.zeros(1, device=current_device())
        for c in self.chunks:
            for p in c.module.parameters():
                replicated_tp = not getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_rank() > 0
                if replicated_tp:
                    continue
                sq += p.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return math.sqrt(sq.item())


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class StepLogger:
    def __init__(self, args, metrics: TrainingMetrics):
        self.args, self.metrics = args, metrics
        self.is_logger = _is_logging_rank()
        self.writer = None
        self.jsonl = None
        if self.is_logger and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir)
            # the same scalars at full precision, one JSON object per report (tests and scripts read this)
            self.jsonl = MetricsFile(os.path.join(args.tensorboard_dir, "metrics.jsonl"))
        tokens = args.global_batch_size * args.seq_length
        mtp = args.mtp_steps if args.mtp and args.model_config.num_nextn_predict_layers else 0
        self.tokens_per_step = tokens
        self.flops_per_step = training_flops_per_token(args.model_config, args.seq_length,
                                                       sparse=args.dsa_stage == "sparse", mtp_layers=mtp) * tokens
        self.window = []
        self.skipped = 0
        self.spikes = 0
        self.start = time.time()
        self.start_iteration = None
        metrics.install()

    def summary(self, model_chunks):
        from megatron.core import parallel_state as ps
        cfg = self.args.model_config
        total = cfg.count_parameters(include_mtp=bool(self.args.mtp))
        moe_layers = cfg.num_moe_layers + (cfg.num_nextn_predict_layers if self.args.mtp else 0)
        active = total - moe_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * (cfg.n_routed_experts - cfg.num_experts_per_tok)
        local = sum(p.numel() for c in model_chunks for p in c.module.parameters())
        a = self.args
        layout = (f"world {dist.get_world_size()} = TP{a.tensor_model_parallel_size} x PP{a.pipeline_model_parallel_size}"
                  f" x CP{a.context_parallel_size} x DP{a.data_parallel_size} (EP{a.expert_model_parallel_size}, "
                  f"ETP{a.expert_tensor_parallel_size}{', VPP' + str(a.virtual_pipeline_model_parallel_size) if a.virtual_pipeline_model_parallel_size else ''})")
        if self.is_logger:
            log.info("model %s: %s parameters (%s active per token: %d of %d routed experts + %d shared); this rank "
                     "holds %s", a.hf_config or a.preset, _count(total), _count(active), cfg.num_experts_per_tok,
                     cfg.n_routed_experts, cfg.n_shared_experts, _count(local))
            log.info("layout %s; global batch %d = %d micro-batches x %d x DP%d; seq %d; %s attention, DSA %s",
                     layout, a.global_batch_size, a.num_microbatches, a.micro_batch_size, a.data_parallel_size,
                     a.seq_length, model_chunks[0].module.config.dsa_backend, a.dsa_stage)
        del ps

    def step(self, iteration, lm_loss, grad_norm, update_ok, seconds, optimizer, lr=None):
        """``lr``: the learning rate this step's update used (the optimizer's current one, after the scheduler
        stepped, is the next step's)."""
        if self.start_iteration is None:
            self.start_iteration = iteration - 1
        if not update_ok:
            self.skipped += 1
        self.window.append(seconds)
        if iteration % self.args.log_interval and iteration != self.args.train_iters:
            return
        m = self.metrics
        kl, load, mtp, aux = m.indexer_kl(), m.expert_load_imbalance(), m.mtp_loss(), m.moe_aux_loss()
        pnorm = m.params_norm()
        m.steps = 0
        secs = sum(self.window) / len(self.window)
        self.window = []
        tok_s = self.tokens_per_step / secs
        world = dist.get_world_size()
        tflops = self.flops_per_step / secs / world / 1e12
        lr = optimizer.param_groups[0]["lr"] if lr is None else lr
        left = (self.args.train_iters - iteration) * secs
        if not self.is_logger:
            return
        mfu = tflops / self.args.peak_tflops if self.args.peak_tflops else None
        parts = [f"iter {iteration}/{self.args.train_iters}", f"lm loss {lm_loss:.4f}" if lm_loss is not None else None,
                 f"indexer kl {kl:.4f}" if kl is not None else None, f"mtp {mtp:.4f}" if mtp is not None else None,
                 f"moe aux {aux:.4g}" if aux is not None else None,
                 f"expert load {load:.2f}" if load is not None else None, f"lr {lr:.3e}",
                 f"grad norm {float(grad_norm):.3f}" if grad_norm is not None else None,
                 f"{secs * 1e3:.0f} ms/step", f"{tok_s:,.0f} tok/s", f"{tflops:.2f} TFLOP/s/GPU",
                 f"MFU {100 * mfu:.1f}%" if mfu is not None else None, f"mem {_memory_gib():.2f} GiB",
                 f"skipped {self.skipped}" if self.skipped else None, f"ETA {_fmt_eta(left)}"]
        log.info(" | ".join(p for p in parts if p))
        if self.writer:
            scalars = {"lm-loss": lm_loss, "indexer-kl-loss": kl, "mtp-loss": mtp, "moe-aux-loss": aux,
                       "expert-load-imbalance": load, "learning-rate": lr,
                       "grad-norm": float(grad_norm) if grad_norm is not None else None, "params-norm": pnorm,
                       "tokens-per-second": tok_s, "tflops-per-gpu": tflops, "mfu": mfu, "memory-gib": _memory_gib(),
                       "skipped-steps": self.skipped, "loss-spikes": self.spikes}
            for tag, value in scalars.items():
                if value is not None:
                    self.writer.add_scalar(tag, value, iteration)
            self.writer.flush()
            self._jsonl({"iteration": iteration, **{k: v for k, v in scalars.items() if v is not None}})

    def loss_spike(self, iteration, lm_loss, message):
        """Report a loss spike (``message`` from numerics.LossSpikeDetector; None: not a spike)."""
        if message is None:
            return
        self.spikes += 1
        if not self.is_logger:
            return
        log.warning("%s", message)
        if self.writer:
            self.writer.add_scalar("loss-spike", lm_loss, iteration)
            self.writer.flush()
            self._jsonl({"iteration": iteration, "loss-spike": lm_loss})

    def eval(self, iteration, loss):
        if loss is None or not self.is_logger:
            return
        log.info("validation at iter %d | lm loss %.4f | ppl %.2f", iteration, loss, math.exp(min(loss, 50)))
        if self.writer:
            self.writer.add_scalar("validation/lm-loss", loss, iteration)
            self.writer.flush()
            self._jsonl({"iteration": iteration, "validation/lm-loss": loss})

    def _jsonl(self, record):
        if self.jsonl:
            self.jsonl.append(record)

    def close(self):
        if self.writer:
            self.writer.close()
        if self.jsonl:
            self.jsonl.close()


class MetricsWriteError(UserError, OSError):
    """metrics.jsonl could not take a record (disk full, quota, file-size limit, permissions)."""


class MetricsFile:
    """metrics.jsonl, appended one whole line at a time: each record is one ``os.write`` on a descriptor opened
    with O_APPEND; a write that fails or comes up short is cut back to the file's previous length, so the file
    always ends with a whole line, and the run stops with one line (MetricsWriteError)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise MetricsWriteError(self._message("opening", e)) from None

    def append(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        before = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            error = None if written == len(data) else f"wrote {written} of {len(data)} bytes"
        except OSError as e:
            error = e
        if error is None:
            return
        try:
            os.ftruncate(self.fd, before)
        except OSError:
            pass
        raise MetricsWriteError(self._message("writing", error))

    def _message(self, doing: str, error) -> str:
        import shutil

        reason = f"{error.strerror or error}" if isinstance(error, OSError) else error
        try:
            free = f"; free space there: {shutil.disk_usage(os.path.dirname(self.path) or '.').free / 2 ** 30:.1f} GiB"
        except OSError:
            free = ""
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            free += f"; file-size limit (ulimit -f): {limit} bytes"
        return (f"--tensorboard-dir {os.path.dirname(self.path)}: {doing} {os.path.basename(self.path)} failed "
                f"({reason}{free}); the file ends at its last whole record; free space (or give another "
                f"--tensorboard-dir) and resume with --load")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_tensorboard_dir(args) -> None:
    """A --tensorboard-dir the logging rank cannot write is refused at start (before the run claims --save),
    not at the first report; nothing is created. A directory under --save is --save's to check (run_dir.claim)."""
    path = getattr(args, "tensorboard_dir", None)
    save = getattr(args, "save", None)
    if not path or not _is_logging_rank():
        return
    if save and os.path.abspath(path).startswith(os.path.abspath(save) + os.sep):
        return
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    problem = None
    if not os.path.isdir(existing):
        problem = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable" + (" (a read-only file system)" if _read_only_fs(existing) else "")
    if problem:
        raise MetricsWriteError(f"--tensorboard-dir {path}: cannot write there: {problem}; give a writable "
                                f"directory")


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _fmt_eta(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"
