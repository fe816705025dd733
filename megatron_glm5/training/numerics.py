"""Numerical faults during training: skipped non-finite steps and loss spikes.

Non-finite steps (:class:`NonFiniteGuard`).  megatron-core's optimizers report an overflow (``found_inf``) only
with fp16 loss scaling; in bf16 and fp32 a NaN/Inf gradient would reach Adam and poison the weights and the
optimizer state for good.  The guard hooks the optimizer's ``prepare_grads`` -- the step that makes the main
gradients ready and whose ``True`` answer makes ``optimizer.step()`` return ``(False, None, None)`` without
touching anything -- and answers ``True`` when this step's local LM loss or any local main gradient is not
finite on *any* rank (the per-rank flags are all-gathered over the world, so every rank skips together and the
log names the ranks that saw it).  What a skipped step does:

* parameters, Adam moments and Adam's step count are left as they were (the update is not applied);
* the LR schedule does not advance (``scheduler.step`` follows applied updates, as Megatron-LM does for fp16
  overflows);
* the step's micro-batches are consumed and the iteration counter advances (the data position, saved in
  checkpoints, keeps counting samples, so a resumed run sees the samples it would have seen; the batch that
  produced the NaN is not retried);
* the routers' expert-bias update, which runs on the token counts before the optimizer step, still happens.

``--max-skipped-steps N`` consecutive skips stop the run with one line naming the iteration (exit status 2).

Loss spikes (:class:`LossSpikeDetector`): an LM loss above ``mean + K * std`` of the last ``--loss-spike-window``
finite losses (``K = --loss-spike-threshold``; the std is at least 1% of the mean) is logged as a warning and
written to TensorBoard (``loss-spike`` at that iteration, ``loss-spikes`` counted in the regular scalars).

Tests inject such faults with ``$MEGATRON_GLM5_INJECT_FAULT`` (training/fault_hooks.py).
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_glm5.errors import UserError
from megatron_glm5.training.device import current_device

__all__ = ["NonFiniteGuard", "NonFiniteTrainingError", "LossSpikeDetector"]

log = logging.getLogger("megatron_glm5.train")


class NonFiniteTrainingError(UserError):
    """Too many consecutive steps had a non-finite loss or gradient (``--max-skipped-steps``)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------------------------------------ non-finite steps


@dataclass
class StepFault:
    iteration: int
    loss_ranks: List[int]
    grad_ranks: List[int]

    def describe(self) -> str:
        parts = []
        if self.loss_ranks:
            parts.append(f"loss on rank{'s' if len(self.loss_ranks) > 1 else ''} "
                         f"{','.join(map(str, self.loss_ranks))}")
        if self.grad_ranks:
            parts.append(f"gradient on rank{'s' if len(self.grad_ranks) > 1 else ''} "
                         f"{','.join(map(str, self.grad_ranks))}")
        return "non-finite " + " and ".join(parts)


def _local_grads(optimizer) -> List[torch.Tensor]:
    grads = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        for p in opt.get_parameters():
            g = getattr(p, "decoupled_grad", None)
            g = g if g is not None else p.grad
            if g is not None:
                grads.append(g.detach())
    return grads


def _all_finite(tensors: List[torch.Tensor]) -> bool:
    if not tensors:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors)).item())


class NonFiniteGuard:
    """Skips the optimizer update of a step whose loss or gradients are not finite on any rank (module doc).

        guard = NonFiniteGuard(max_consecutive=10).install(optimizer)
        guard.note_loss(iteration, outputs)       # the step's micro-batch outputs ({"lm loss": [sum, count]})
        ok, grad_norm, _ = optimizer.step()       # (False, None, None) when skipped
        guard.after_step(iteration, ok)           # logs; raises NonFiniteTrainingError after too many in a row
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.total = 0
        self.fault: Optional[StepFault] = None
        self._iteration = 0
        self._loss_bad = False

    def install(self, optimizer) -> "NonFiniteGuard":
        inner = optimizer.prepare_grads

        def prepare_grads() -> bool:
            found_inf = inner()
            return self._check(optimizer) or bool(found_inf)

        optimizer.prepare_grads = prepare_grads
        return self

    def note_loss(self, iteration: int, outputs) -> None:
        """Record whether this rank's loss of the step is finite (``outputs``: the schedule's loss dicts; empty
        on pipeline stages other than the last)."""
        self._iteration = iteration
        self._loss_bad = any(not bool(torch.isfinite(o["lm loss"]).all()) for o in outputs or [])

    def _check(self, optimizer) -> bool:
        grad_bad = not _all_finite(_local_grads(optimizer))
        flags = torch.tensor([float(self._loss_bad), float(grad_bad)], device=current_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flags)
        else:
            gathered = [flags]
        table = torch.stack(gathered).cpu()
        loss_ranks = [r for r in range(len(gathered)) if table[r, 0] > 0]
        grad_ranks = [r for r in range(len(gathered)) if table[r, 1] > 0]
        self.fault = StepFault(self._iteration, loss_ranks, grad_ranks) if loss_ranks or grad_ranks else None
        self._loss_bad = False
        return self.fault is not None

    def after_step(self, iteration: int, update_ok: bool) -> None:
        if update_ok:
            self.consecutive = 0
            self.fault = None
            return
        self.consecutive += 1
        self.total += 1
        what = self.fault.describe() if self.fault is not None else "overflow reported by the optimizer"
        if _rank() == 0:
            log.warning("iteration %d: skipped the optimizer update: %s (%d in a row; --max-skipped-steps %d)",
                        iteration, what, self.consecutive, self.max_consecutive)
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteTrainingError(
                f"iteration {iteration}: {self.consecutive} consecutive steps skipped for a non-finite loss or "
                f"gradient (--max-skipped-steps {self.max_consecutive}); last: {what}. Lower --lr, check the data "
                f"of these steps, or resume from an earlier checkpoint")
        self.fault = None


# ------------------------------------------------------------------------------------------------ loss spikes


class LossSpikeDetector:
    """Flags a loss above ``mean + threshold * std`` of the last ``window`` finite losses (std >= 1% of the mean),
    once at least ``min(window, 10)`` losses are known.  ``threshold`` 0 turns it off."""

    MIN_HISTORY = 10
    MIN_RELATIVE_STD = 0.01

    def __init__(self, threshold: float, window: int):
        self.threshold, self.window = float(threshold), int(window)
        self.history = deque(maxlen=self.window)
        self.count = 0

    def update(self, iteration: int, loss: Optional[float]) -> Optional[str]:
        """Add this step's loss; a one-line description when it is a spike, else None."""
        if loss is None or not math.isfinite(loss) or self.threshold <= 0:
            return None
        message = None
        if len(self.history) >= min(self.window, self.MIN_HISTORY):
            mean = statistics.fmean(self.history)
            std = max(statistics.pstdev(self.history, mean), self.MIN_RELATIVE_STD * abs(mean))
            if loss > mean + self.threshold * std:
                self.count += 1
                message = (f"loss spike at iteration {iteration}: lm loss {loss:.4f} > mean {mean:.4f} + "
                           f"{self.threshold:g} x std {std:.4f} of the last {len(self.history)} steps "
                           f"(--loss-spike-threshold)")
        self.history.append(loss)
        return message
