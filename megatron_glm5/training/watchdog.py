"""A hung rank is named, not waited for: heartbeats in the process group's store and a watchdog thread.

Every rank writes ``rank r: iteration i, phase p`` into the c10d store (the one ``torchrun`` set up for the process
group) when it enters a phase of the loop (``step``, ``eval``, ``save``). A daemon thread on every rank watches its
own progress: when the rank has been in the same phase for longer than ``--distributed-timeout-minutes``, it reads
the other ranks' heartbeats, prints one line naming the ranks that are behind (or that stopped writing), and ends
the process with exit status 3 — before gloo's or NCCL's own timeout turns the wait into a traceback, and long
before their 30-minute defaults. A stopped (SIGSTOP) or deadlocked rank writes nothing, so the ranks waiting for it
name it; a dead rank is named the same way when torchrun has not already ended the job.

The thread also rewrites ``megatron_glm5/alive/{rank}`` (host, process id, time) at every poll: a rank that is
alive but waiting keeps it fresh, a killed or stopped one does not, so a rank at the same iteration and phase as the
others is still named when it stopped (and, on the same host, its process is looked at: exited or stopped).

When a collective fails instead (a peer's death under gloo: ``Connection reset by peer``; gloo's or NCCL's own
timeout), :meth:`Watchdog.explain` turns the library's error into a :class:`JobFailure` naming the lost rank(s):
one line, exit status 3 (arguments.main_guard).

The thread never touches CUDA or a collective; reading the store has its own short timeout.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("megatron_glm5.watchdog")

EXIT_STATUS = 3
_KEY = "megatron_glm5/heartbeat/{rank}"
_ALIVE_KEY = "megatron_glm5/alive/{rank}"
Alive = Tuple[str, int, float]  # (host, pid, last time the rank's watchdog thread ran)


class JobFailure(Exception):
    """The job cannot go on because another rank is lost or stopped responding (not this process's fault, not
    the user's input): one line ``error: ...`` and exit status 3."""

    exit_status = EXIT_STATUS


def process_state(host: str, pid: int) -> Optional[str]:
    """"exited" or "stopped" for a process of this host that is not running; None when it runs, or runs on
    another host (nothing to look at from here)."""
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except OSError:
            pass
        return None
    if state in ("T", "t"):
        return "stopped"
    if state in ("Z", "X"):
        return "exited"
    return None


def _silence(alive: Optional[Alive], now: float, stale_after: float) -> Optional[str]:
    """Why a rank looks lost from its liveness record (None: it looks alive)."""
    if alive is None:
        return None
    host, pid, stamp = alive
    state = process_state(host, pid)
    if state is not None:
        return f"its process {pid} has {state}" if state == "exited" else f"its process {pid} is stopped"
    if now - stamp > stale_after:
        return f"no sign of life for {now - stamp:.0f} s"
    return None


def _default_store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def describe_laggards(me: Tuple[int, int, str], beats: Dict[int, Optional[Tuple[int, str, float]]],
                      now: float, alive: Optional[Dict[int, Optional[Alive]]] = None,
                      stale_after: float = float("inf")) -> str:
    """The ranks behind this one (lower iteration, or silent), from their last heartbeats; with ``alive`` (the
    ranks' liveness records) also the ranks at the same point whose process stopped or exited, or that gave no
    sign of life for ``stale_after`` seconds."""
    my_rank, my_iter, my_phase = me
    behind: List[str] = []
    for rank in sorted(beats):
        if rank == my_rank:
            continue
        beat = beats[rank]
        silence = _silence((alive or {}).get(rank), now, stale_after)
        if beat is None:
            behind.append(f"rank {rank} (no heartbeat{'; ' + silence if silence else ''})")
            continue
        iteration, phase, stamp = beat
        if (iteration, phase) != (my_iter, my_phase) or silence:
            behind.append(f"rank {rank} (last at iteration {iteration}, {phase}, {now - stamp:.0f} s ago"
                          f"{'; ' + silence if silence else ''})")
    return ", ".join(behind) if behind else "no rank is behind by its heartbeat (a collective itself is stuck)"


def is_collective_failure(exc: BaseException) -> bool:
    """A failed or timed-out collective / process-group store (gloo's errors are plain RuntimeErrors)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and "gloo" in str(exc)


def short_reason(exc: BaseException) -> str:
    """The library's error without its source path and advice: 'Read error [127.0.0.1]:5123: Connection reset
    by peer'."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically caused by")[0]
    return text[:200].rstrip(". ")


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
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._store_ok = True
        self._alive()
        self._thread = threading.Thread(target=self._watch, name="megatron_glm5-watchdog", daemon=True)
        self._thread.start()

    @property
    def stale_after(self) -> float:
        """A liveness record older than this is a rank that stopped (its thread writes one every poll)."""
        return 3 * self._poll_s + 2.0

    def _alive(self) -> None:
        if self.store is not None and self._store_ok:
            try:
                self.store.set(_ALIVE_KEY.format(rank=self.rank), f"{self._host}|{self._pid}|{time.time()}")
            except Exception:  # advisory, as the heartbeats
                pass

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

    def _read(self, key: str, parse):
        """One rank's record from the store, or None (missing, unreadable, or the store gone)."""
        if self.store is None or not self._store_ok:
            return None
        try:
            if hasattr(self.store, "check") and not self.store.check([key]):
                return None
            return parse(self.store.get(key).decode())
        except (ValueError, IndexError):
            return None
        except Exception:
            if hasattr(self.store, "check"):  # the key exists, or check itself failed: the store is not answering
                self._store_ok = False  # and is not asked again
            return None

    def _prepare_reads(self) -> None:
        if self.store is not None:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=5))
            except Exception:
                pass

    def _heartbeats(self) -> Dict[int, Optional[Tuple[int, str, float]]]:
        def parse(raw):
            it, phase, stamp = raw.split("|")
            return int(it), phase, float(stamp)
        self._prepare_reads()
        return {rank: self._read(_KEY.format(rank=rank), parse) for rank in range(self.world_size)}

    def _liveness(self) -> Dict[int, Optional[Alive]]:
        def parse(raw):
            host, pid, stamp = raw.rsplit("|", 2)
            return host, int(pid), float(stamp)
        self._prepare_reads()
        return {rank: self._read(_ALIVE_KEY.format(rank=rank), parse) for rank in range(self.world_size)
                if rank != self.rank}

    def _lost(self, alive: Dict[int, Optional[Alive]], now: float) -> List[int]:
        return [r for r, a in sorted(alive.items()) if _silence(a, now, self.stale_after)]

    def explain(self, exc: BaseException) -> Optional[JobFailure]:
        """A failed collective as one line naming the rank(s) lost (None: ``exc`` is not a collective's
        failure). A rank that died a moment ago may still look alive on another host: its liveness record is
        read again until it is stale (at most ``stale_after`` seconds)."""
        if not is_collective_failure(exc):
            return None
        iteration, phase, _ = self._state
        alive = self._liveness()
        deadline = time.time() + self.stale_after + self._poll_s
        while not self._lost(alive, time.time()) and self._store_ok and alive and time.time() < deadline:
            time.sleep(self._poll_s)
            alive = self._liveness()
        now = time.time()
        lost = self._lost(alive, now)
        if lost:
            who = ", ".join(f"rank {r} ({_silence(alive[r], now, self.stale_after)})" for r in lost)
            head = f"lost {who}"
        else:
            head = ("a collective failed and no other rank looks lost: "
                    + describe_laggards((self.rank, iteration, phase), self._heartbeats(), now))
        return JobFailure(f"rank {self.rank}: {head}, during {phase} of iteration {iteration} ({short_reason(exc)}); the job stops: "
                          f"the checkpoints it reported saved are complete, resume from them with --load")

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._alive()
            iteration, phase, since = self._state
            waited = time.time() - since
            if waited <= self.timeout_s:
                continue
            now = time.time()
            others = describe_laggards((self.rank, iteration, phase), self._heartbeats(), now,
                                       self._liveness(), self.stale_after)
            self._on_timeout(
                f"rank {self.rank}: no progress for {waited:.0f} s in {phase} of iteration {iteration} "
                f"(--distributed-timeout-minutes {self.timeout_s / 60:g}); waiting for: {others}")
            return

    @staticmethod
    def _exit(message: str) -> None:
        from megatron_glm5.torchrun_report import write_error_file

        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        write_error_file(f"error: {message}")
        os._exit(EXIT_STATUS)
