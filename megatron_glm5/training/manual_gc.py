"""``--manual-gc``: Python's cyclic garbage collector off during training, run at fixed iterations instead
(stdlib only: arguments.py imports it).

A full collection stops the host for as long as it takes to walk every tracked object -- ~11 ms inside one proxy
step on the H200 (docs/host_syncs.md) -- and it starts whenever allocation counts say so, at a different moment on
every rank: one rank's pause holds the others at the next collective. With ``--manual-gc`` the collector is
switched off after start-up (the objects alive then are frozen out of later collections, ``gc.freeze``) and one
collection runs on every rank after the same iterations (``--manual-gc-interval``), and before evaluation and
checkpoint saves, which wait for all ranks anyway. Reference cycles made during training are freed only at those
collections, so an interval of 0 (never during training) is for runs known to make none.
"""
from __future__ import annotations

import argparse
import gc

from megatron_glm5.errors import FlagError


class ManualGCFlagError(FlagError):
    FLAG = "--manual-gc-interval"


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("host: Python's garbage collector")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collection off during training and collect on every rank "
                        "after the same iterations instead (no collector pause at a random step on one rank)")
    g.add_argument("--manual-gc-interval", type=int, default=100, metavar="N",
                   help="with --manual-gc: collect after every N iterations (and before evaluation and saves); "
                        "0: only there")


def check(args) -> None:
    if args.manual_gc_interval < 0:
        raise ManualGCFlagError(f"--manual-gc-interval {args.manual_gc_interval} must be >= 0 (0: collect only "
                                "before evaluation and checkpoint saves)")


class ManualGC:
    """The training loop's collector policy: ``start()`` once before the loop, ``after_step(iteration)`` after each
    iteration, ``before_sync_point()`` before evaluation / saving, ``stop()`` at the end (also on errors). Without
    --manual-gc every call does nothing."""

    def __init__(self, enabled: bool, interval: int, collector=gc):
        self.enabled, self.interval, self.gc = bool(enabled), int(interval), collector
        self._was_enabled = None

    def start(self) -> None:
        if not self.enabled:
            return
        self._was_enabled = self.gc.isenabled()
        self.gc.collect()
        self.gc.freeze()  # what start-up built (model, optimizer, data) is not walked by later collections
        self.gc.disable()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            self.gc.collect()

    def before_sync_point(self) -> None:
        if self.enabled:
            self.gc.collect()

    def stop(self) -> None:
        if self.enabled and self._was_enabled is not None:
            self.gc.unfreeze()
            if self._was_enabled:
                self.gc.enable()
            self._was_enabled = None
