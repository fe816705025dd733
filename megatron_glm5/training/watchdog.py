"""A hung rank is named, not waited for: heartbeats in the process group's store and a watchdog thread.

Every rank writes ``rank r: iteration i, phase p`` into the c10d store (the one ``torchrun`` set up for the process
group) when it enters a phase of the loop (``step``, ``eval``, ``save``). A daemon thread on every rank watches its
own progress: when the rank has been in the same phase for longer than ``--distributed-timeout-minutes``, it reads
the other ranks' heartbeats, prints one line naming the ranks that are behind (or that stopped writing), and ends
the process with exit status 3 — before gloo's or NCCL's own timeout turns the wait into a traceback, and long
before their 30-minute defaults. A stopped (SIGSTOP) or deadlocked rank writes nothing, so the ranks waiting for it
name it; a dead rank is named the same way when torchrun has not already ended the job.

The thread never touches CUDA or a collective; reading the store has its own short timeout.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("megatron_glm5.watchdog")

EXIT_STATUS = 3
_KEY = "megatron_glm5/heartbeat/{rank}"


def _default_store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def describe_laggards(me: Tuple[int, int, str], beats: Dict[int, Optional[Tuple[int, str, float]]],
                      now: float) -> str:
    """The ranks behind this one (lower iteration, or silent), from their last heartbeats."""
    my_rank, my_iter, my_phase = me
    behind: List[str] = []
    for rank in sorted(beats):
        if rank == my_rank:
            continue
        beat = beats[rank]
        if beat is None:
            behind.append(f"rank {rank} (no heartbeat)")
            continue
        iteration, phase, stamp = beat
        if (iteration, phase) != (my_iter, my_phase):
            behind.append(f"rank {rank} (last at iteration {iteration}, {phase}, {now - stamp:.0f} s ago)")
    return ", ".join(behind) if behind else "no rank is behind by its heartbeat (a collective itself is stuck)"


class Watchdog:
    """``beat(iteration, phase)`` at each phase of the loop; ``stop()`` at the end."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, store=None,
                 on_timeout: Optional[Callable[[str], None]] = None, poll_s: Optional[float] = None):
        self.timeout_s = float(timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = store if store is not None else _default_store()
        self._on_timeout = on_timeout or self._exit
        self._poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, self.timeout_s / 20))
        self._state: Tuple[int, str, float] = (0, "start", time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megatron_glm5-watchdog", daemon=True)
        self._thread.start()

    def beat(self, iteration: int, phase: str) -> None:
        now = time.time()
        self._state = (iteration, phase, now)
        if self.store is not None:
            try:
                self.store.set(_KEY.format(rank=self.rank), f"{iteration}|{phase}|{now}")
            except Exception:  # the store is advisory: a failed heartbeat must never stop training
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._poll_s * 4)

    def _heartbeats(self) -> Dict[int, Optional[Tuple[int, str, float]]]:
        beats: Dict[int, Optional[Tuple[int, str, float]]] = {}
        if self.store is None:
            return beats
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
        except Exception:
            pass
        for rank in range(self.world_size):
            try:
                raw = self.store.get(_KEY.format(rank=rank)).decode()
                it, phase, stamp = raw.split("|")
                beats[rank] = (int(it), phase, float(stamp))
            except Exception:
                beats[rank] = None
        return beats

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            iteration, phase, since = self._state
            waited = time.time() - since
            if waited <= self.timeout_s:
                continue
            others = describe_laggards((self.rank, iteration, phase), self._heartbeats(), time.time())
            self._on_timeout(
                f"rank {self.rank}: no progress for {waited:.0f} s in {phase} of iteration {iteration} "
                f"(--distributed-timeout-minutes {self.timeout_s / 60:g}); waiting for: {others}")
            return

    @staticmethod
    def _exit(message: str) -> None:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(EXIT_STATUS)
