"""Where tests inject faults into a training run: one hook object, a no-op unless a test installs one.

The training loop takes the hooks once per run (:func:`start_run`, :func:`end_run`) and calls them at fixed points of a step; the
checkpoint save calls :meth:`FaultHooks.save_point` at each of its steps. None of the loop's own computations
(the loss function, the optimizer step) call test code: a loss fault wraps the forward-step function that the
pipeline schedule is given, a gradient fault runs between backward and the optimizer step.

Two kinds are installed:

* ``$MEGATRON_GLM5_INJECT_FAULT=KIND:ITERATIONS[:RANK]`` (:class:`FaultInjection`, documented in
  docs/bad_input.md; also through torchrun): e.g. ``nan-grad:3`` (every gradient of iteration 3 is NaN),
  ``nan-loss:2-4:1`` (rank 1's loss is NaN on iterations 2 to 4), ``spike-loss:30`` (the loss of iteration 30 is
  multiplied by 1000). tests/test_numerical_faults.py.
* a subclass of :class:`FaultHooks` installed with :func:`install` before the run (tests/faults/harness.py
  kills or damages a save at its named points: "writing", "files-written", "manifest-written", "renamed",
  "pointer-updated").
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_glm5.errors import UserError

log = logging.getLogger("megatron_glm5.train")

INJECT_ENV = "MEGATRON_GLM5_INJECT_FAULT"
FAULT_KINDS = ("nan-loss", "nan-grad", "inf-grad", "spike-loss")
SPIKE_FACTOR = 1000.0


class FaultHooks:
    """The points a test may act at; every method does nothing here."""

    def wrap_forward_step(self, forward_step):
        """The forward-step function the pipeline schedule runs (each micro-batch, training and evaluation)."""
        return forward_step

    def start_step(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) is about to be computed."""

    def after_backward(self, model_chunks) -> None:
        """The step's gradients are reduced; the optimizer step follows."""

    def save_point(self, point: str, iteration: int) -> None:
        """A checkpoint save of ``iteration`` has reached ``point`` (module doc)."""


NO_FAULTS = FaultHooks()
_installed: Optional[FaultHooks] = None
_current: FaultHooks = NO_FAULTS


def install(hooks: Optional[FaultHooks]) -> None:
    """Use ``hooks`` in the runs of this process that start from now on (None: none)."""
    global _installed, _current
    _installed = hooks
    _current = hooks or NO_FAULTS


def current() -> FaultHooks:
    """The hooks of the run in progress (NO_FAULTS outside a run and in normal runs)."""
    return _current


def start_run() -> FaultHooks:
    """The hooks of a run that starts now: the installed ones, else $MEGATRON_GLM5_INJECT_FAULT's, else none."""
    global _current
    spec = FaultInjection.from_env() if _installed is None else None
    if spec is not None:
        log.warning("fault injection (%s): %s on iterations %s%s", INJECT_ENV, spec.kind,
                    ",".join(map(str, sorted(spec.iterations))), "" if spec.rank is None else f" of rank {spec.rank}")
    _current = _installed or (InjectedFaults(spec) if spec is not None else NO_FAULTS)
    return _current


def end_run() -> None:
    """The run is over: no hooks until the next :func:`start_run`."""
    global _current
    _current = NO_FAULTS


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass(frozen=True)
class FaultInjection:
    """A fault to inject, parsed from ``$MEGATRON_GLM5_INJECT_FAULT`` = ``KIND:ITERATIONS[:RANK]``.

    KIND: ``nan-loss`` / ``spike-loss`` (the loss of each micro-batch times NaN / 1000, before backward) or
    ``nan-grad`` / ``inf-grad`` (every main gradient of the rank set to NaN / Inf after backward and the
    data-parallel reduction, before the optimizer step).  ITERATIONS: ``3``, ``2-4`` or ``3,7,9`` (1-based, the
    iteration being computed).  RANK: the global rank (default: every rank).
    """

    kind: str
    iterations: frozenset
    rank: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> "FaultInjection":
        def bad(why: str):
            raise UserError(f"${INJECT_ENV}={text!r}: {why}; expected KIND:ITERATIONS[:RANK] with KIND one of "
                            f"{', '.join(FAULT_KINDS)}, e.g. nan-grad:3 or nan-loss:2-4:1")

        parts = text.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in FAULT_KINDS:
            bad("not understood")
        iterations = set()
        try:
            for item in parts[1].split(","):
                lo, _, hi = item.partition("-")
                iterations.update(range(int(lo), int(hi or lo) + 1))
            rank = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            bad("iterations and rank must be integers")
        if not iterations:
            bad("no iteration")
        return cls(parts[0], frozenset(iterations), rank)

    @classmethod
    def from_env(cls) -> Optional["FaultInjection"]:
        text = os.environ.get(INJECT_ENV, "").strip()
        return cls.parse(text) if text else None

    def hits(self, iteration: int) -> bool:
        return iteration in self.iterations and (self.rank is None or self.rank == _rank())


class InjectedFaults(FaultHooks):
    """The hooks of a :class:`FaultInjection`: the loss or the gradients of the chosen iterations and rank."""

    def __init__(self, spec: FaultInjection):
        self.spec = spec
        self.iteration = 0

    def start_step(self, iteration: int) -> None:
        self.iteration = iteration

    def wrap_forward_step(self, forward_step):
        if self.spec.kind not in ("nan-loss", "spike-loss"):
            return forward_step

        def poisoned_forward_step(data_iterator, model):
            output, loss_func = forward_step(data_iterator, model)
            return output, lambda output_tensor: self._poison_loss(loss_func(output_tensor))
        return poisoned_forward_step

    def _poison_loss(self, result):
        """The loss function's (loss, tokens, {"lm loss": [loss, tokens]}) with the loss times NaN / 1000."""
        if not self.spec.hits(self.iteration):
            return result
        factor = float("nan") if self.spec.kind == "nan-loss" else SPIKE_FACTOR
        loss, tokens, report = result
        lm = report["lm loss"]
        return loss * factor, tokens, {**report, "lm loss": torch.stack([lm[0] * factor, lm[1]])}

    def after_backward(self, model_chunks) -> None:
        if self.spec.kind not in ("nan-grad", "inf-grad") or not self.spec.hits(self.iteration):
            return
        value = float("nan") if self.spec.kind == "nan-grad" else float("inf")
        with torch.no_grad():
            for chunk in model_chunks:
                for p in chunk.parameters():
                    grad = getattr(p, "main_grad", None)
                    grad = grad if grad is not None else p.grad
                    if grad is not None:
                        grad.fill_(value)
