"""Parallel conversion: a conversion's tensor jobs split over worker processes on one node and torchrun ranks.

A *job* is a picklable object with ``nbytes`` (the tensor bytes it writes: the unit of balance and of the progress
bar) and ``run(ctx)``, which writes those bytes into files that already exist, at offsets fixed before any job
runs (tensor_jobs.py: the safetensors headers, the torch_dist record layout). The output therefore does not depend
on which process wrote which job, nor in which order: 1, 4 or 8 workers write the same bytes. A job may write
several tensors (an FP8 weight and its ``weight_scale_inv`` travel as one job).

Split: the job list (in output order) is cut into ``ranks x --workers`` contiguous runs of about equal bytes (job
``i`` goes to the run holding the middle of its byte range), so each worker reads and writes mostly sequentially.
``--workers`` above the number of jobs is clamped to it; below 1 is refused.

One node: ``--workers 1`` runs the jobs in this process; ``N > 1`` starts N processes (multiprocessing
``forkserver``: each worker is forked from a clean single-threaded server process that imported the converter
once, so workers start in milliseconds and inherit no threads or open files; ``spawn`` where forkserver is
missing). Workers report bytes written, their peak RSS and errors through a queue; the first error stops the
others (they check an event between blocks) and is raised here as it was raised there, so the tool prints its one
line and the caller removes the temporary directory. A worker that dies without a word (killed, out of memory) is
reported by its exit code. Ctrl-C: workers ignore SIGINT, this process stops them and re-raises.

torchrun: ``WORLD_SIZE > 1`` makes every rank a participant (gloo group): every rank plans the same jobs, rank 0
prepares the directory and files, a barrier, each rank runs its share (with its own ``--workers`` processes), the
ranks exchange their outcome (a failing rank also drops a marker file that stops the others' workers between
blocks), and rank 0 writes the index / metadata and renames. The output directory must be on a file system every
rank sees.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

from megatron_glm5.conversion.progress import peak_rss_bytes
from megatron_glm5.errors import UserError

log = logging.getLogger("megatron_glm5.conversion")

STOP_MARKER = ".conversion-failed"  # dropped into the output's temporary directory by a failing rank
_JOIN_SECONDS = 60.0


class ParallelError(UserError, ValueError):
    """--workers out of range, or a worker that died without reporting an error."""


class WorkerFailed(RuntimeError):
    """An unexpected exception in a worker (a bug, not bad input): its traceback is in the message."""


class Stopped(Exception):
    """Raised inside a worker when another worker failed (or the coordinator is gone)."""


def add_workers_flag(parser) -> None:
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="worker processes, each converting a disjoint, byte-balanced share of the tensors; "
                             "the output is identical for every N. Under torchrun: processes per rank "
                             "(default: 1; clamped to the number of tensors)")


def check_workers(workers) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ParallelError(f"--workers {workers}: must be an integer >= 1 (the number of worker processes; 1 "
                            "converts in this process)")
    return workers


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges over the jobs, of about equal bytes (some may be empty): job
    ``i`` belongs to the part holding the middle of its bytes. Depends only on ``sizes`` and ``parts``."""
    total = sum(sizes)
    owners, acc = [], 0
    for i, s in enumerate(sizes):
        if total > 0:
            owners.append(min(parts - 1, (2 * acc + s) * parts // (2 * total)))
        else:
            owners.append(i * parts // max(1, len(sizes)))
        acc += s
    ranges, start = [], 0
    for p in range(parts):
        stop = start
        while stop < len(owners) and owners[stop] == p:
            stop += 1
        ranges.append((start, stop))
        start = stop
    return ranges


# ====================================================================== what a job sees
class WorkerContext:
    """Files and resources of one worker: ``file(path)`` opens an existing file for writing at offsets (kept
    open); ``resource(key, make)`` caches e.g. a checkpoint reader; ``progress(n)``; ``check_stop()``."""

    def __init__(self, progress: Optional[Callable[[int], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None, resources: Optional[dict] = None):
        self._progress, self._should_stop = progress, should_stop
        self._files: dict[str, object] = {}
        self._resources, self._owned = dict(resources or {}), set()

    def file(self, path: str):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "r+b")
        return f

    def resource(self, key, make: Callable[[], object]):
        if key not in self._resources:
            self._resources[key] = make()
            self._owned.add(key)
        return self._resources[key]

    def progress(self, nbytes: int) -> None:
        if self._progress is not None and nbytes:
            self._progress(nbytes)

    def check_stop(self) -> None:
        if self._should_stop is not None and self._should_stop():
            raise Stopped()

    def close(self, sync: bool = True) -> None:
        """Flush (and fsync, ``sync``) every file written; close the resources this context made."""
        files, self._files = self._files, {}
        try:
            for f in files.values():
                f.flush()
                if sync:
                    os.fsync(f.fileno())
        finally:
            for f in files.values():
                f.close()
            for key in self._owned:
                close = getattr(self._resources[key], "close", None)
                if close is not None:
                    close()
            self._owned.clear()


def run_share(jobs, ctx: WorkerContext) -> None:
    for job in jobs:
        ctx.check_stop()
        job.run(ctx)


# ====================================================================== worker processes
def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # imported once by the server: unpickling a job then needs no import in the forked worker
        ctx.set_forkserver_preload(["megatron_glm5.conversion.convert", "megatron_glm5.conversion.tensor_jobs"])
        return ctx
    return multiprocessing.get_context("spawn")


def _portable(exc: BaseException) -> BaseException:
    """The exception itself (same type and message: the tools print user errors as their one line), with the
    worker's traceback as a note; a WorkerFailed carrying the traceback when it does not survive pickling."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            if hasattr(exc, "add_note"):
                exc.add_note("worker traceback:\n" + tb)
            return exc
    except Exception:  # noqa: BLE001 - not portable: described instead
        pass
    return WorkerFailed(f"{type(exc).__name__}: {exc}\nworker traceback:\n{tb}")


def _worker_main(index: int, jobs, messages, stop, marker: Optional[str], threads: int, level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle: it stops us
    import torch

    from megatron_glm5 import quiet
    quiet.install(tool=True)
    logging.basicConfig(level=level, format="%(levelname)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(threads)

    parent = multiprocessing.parent_process()  # the coordinator (not the fork server that forked us)

    def should_stop() -> bool:
        return (stop.is_set() or (parent is not None and not parent.is_alive())
                or (marker is not None and os.path.exists(marker)))

    ctx = WorkerContext(progress=lambda n: messages.put(("bytes", index, n)), should_stop=should_stop)
    ok = False
    try:
        run_share(jobs, ctx)
        ctx.close(sync=True)
        ok = True
        messages.put(("done", index, peak_rss_bytes()))
    except Stopped:
        messages.put(("stopped", index, None))
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator, which raises it
        messages.put(("error", index, _portable(e)))
    finally:
        if not ok:
            try:
                ctx.close(sync=False)
            except OSError:
                pass


def _run_processes(shares: list[list], on_bytes: Optional[Callable[[int], None]], marker: Optional[str]
                   ) -> list[int]:
    """Run each share in its own process; returns the workers' peak RSS; raises the first worker's error."""
    mp = _mp_context()
    messages, stop = mp.Queue(), mp.Event()
    threads = max(1, (os.cpu_count() or 1) // len(shares))
    level = logging.getLogger("megatron_glm5").getEffectiveLevel()
    procs = [mp.Process(target=_worker_main, name=f"conversion-worker-{i}", daemon=True,
                        args=(i, share, messages, stop, marker, threads, level))
             for i, share in enumerate(shares)]
    peaks = [0] * len(procs)
    pending = set(range(len(procs)))
    error: list[BaseException] = []

    def handle(msg):
        kind, i, value = msg
        if kind == "bytes":
            if on_bytes is not None:
                on_bytes(value)
            return
        pending.discard(i)
        if kind == "done":
            peaks[i] = value
        elif kind == "error":
            if not error:
                error.append(value)
            stop.set()
        elif kind == "stopped" and not stop.is_set() and not error:
            error.append(ParallelError(f"conversion worker {i} stopped: it was told another worker failed"))

    try:
        for p in procs:
            p.start()
        while pending:
            try:
                handle(messages.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            for i in sorted(pending):
                if procs[i].is_alive():
                    continue
                while True:  # a finished worker's last messages are in the pipe before it exits
                    try:
                        handle(messages.get_nowait())
                    except queue.Empty:
                        break
                if i in pending:
                    pending.discard(i)
                    code = procs[i].exitcode
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    hint = " (out of memory? each worker holds one block: lower --max-chunk-size / " \
                           "--max-block-size or --workers)" if code == -signal.SIGKILL else ""
                    if not error:
                        error.append(ParallelError(f"conversion worker {i} died without reporting an error "
                                                   f"({how}){hint}"))
                    stop.set()
        if error:
            raise error[0]
        return peaks
    except BaseException:
        stop.set()
        raise
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=_JOIN_SECONDS)
                if p.is_alive():
                    p.terminate()
                    p.join()
        messages.close()
        messages.join_thread()


# ====================================================================== ranks
@dataclass
class Topology:
    rank: int = 0
    world: int = 1


def topology() -> Topology:
    """This process's place among torchrun ranks (a gloo group is created when WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Topology()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(hours=6))  # a rank waits for the slowest one's share
    return Topology(dist.get_rank(), dist.get_world_size())


class Runner:
    """Runs a conversion's jobs over ``workers`` processes on every rank; see the module doc."""

    def __init__(self, workers: int = 1):
        self.workers = check_workers(workers)
        self.topo = topology()
        self.used_workers = 1
        self.worker_peak_rss: list[int] = []

    @property
    def is_coordinator(self) -> bool:
        return self.topo.rank == 0

    @property
    def distributed(self) -> bool:
        return self.topo.world > 1

    def _agree(self, error: Optional[BaseException]) -> None:
        """Every rank learns every rank's outcome; the first error is raised on all of them."""
        if self.distributed:
            import torch.distributed as dist

            outcomes = [None] * self.topo.world
            dist.all_gather_object(outcomes, None if error is None else _portable(error))
            error = error or next((e for e in outcomes if e is not None), None)
        if error is not None:
            raise error

    def barrier(self) -> None:
        self._agree(None)

    def prepare(self, fn: Callable[[], None]) -> None:
        """``fn`` on the coordinator (creating the directory, the files), then every rank goes on."""
        error = None
        if self.is_coordinator:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
                error = e
        self._agree(error)

    def run(self, jobs: list, on_bytes: Optional[Callable[[int], None]] = None, marker_dir: Optional[str] = None,
            resources: Optional[dict] = None, on_share: Optional[Callable[[int], None]] = None) -> None:
        """Run this rank's share of ``jobs``. ``resources`` seed the in-process context (e.g. an open reader);
        ``on_share(bytes)`` is told this rank's share of the bytes under torchrun (the bar counts it)."""
        total_workers = self.topo.world * self.workers
        parts = max(1, min(total_workers, len(jobs)))
        if parts < total_workers:
            log.info("--workers %d%s: only %d tensor jobs, using %d workers", self.workers,
                     f" x {self.topo.world} ranks" if self.distributed else "", len(jobs), parts)
        ranges = split_by_bytes([j.nbytes for j in jobs], parts)
        mine = [ranges[g] for g in range(self.topo.rank * self.workers, (self.topo.rank + 1) * self.workers)
                if g < len(ranges)]
        shares = [jobs[a:b] for a, b in mine if b > a]
        if self.distributed and on_share is not None:
            on_share(sum(j.nbytes for s in shares for j in s))
        marker = os.path.join(marker_dir, STOP_MARKER) if (marker_dir and self.distributed) else None
        error = None
        try:
            if len(shares) <= 1:
                self.used_workers = 1
                ctx = WorkerContext(progress=on_bytes, resources=resources,
                                    should_stop=(lambda: os.path.exists(marker)) if marker else None)
                ok = False
                try:
                    run_share(shares[0] if shares else [], ctx)
                    ctx.close(sync=True)
                    ok = True
                finally:
                    if not ok:
                        ctx.close(sync=False)
                self.worker_peak_rss = [peak_rss_bytes()]
            else:
                self.used_workers = len(shares)
                self.worker_peak_rss = _run_processes(shares, on_bytes, marker)
        except Stopped:
            error = None  # another rank failed: its error arrives through _agree
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            error = e
            if marker is not None:
                try:
                    with open(marker, "w") as f:
                        f.write(f"rank {self.topo.rank}: {e}\n")
                except OSError:
                    pass
        self._agree(error)
