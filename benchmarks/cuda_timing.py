"""The benchmarks' CUDA-event timers.

``median_ms``: the median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs, ``refill()`` (fresh
random inputs) before each run and outside the timed region, each run started on an idle GPU -- so the time includes
whatever the GPU waits for the host to issue (the figure every benchmark row reports); ``idle_ms``: the same with
the host's issue time.

``queued_ms``: the same runs with the host ahead of the GPU, as in a training step whose earlier work is still
running: each run is issued while the GPU is still busy with ``busy()`` (work queued just before it), and the events
around it are recorded in stream order, so they time the GPU's own work and its gaps between kernels but not the
host's issue time.  Returns (median GPU ms, median host issue ms, runs where the host had not finished issuing
before the busy work ended -- those are not queued runs, and a caller should lengthen ``busy``)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Tuple

import torch


def _runs(fn: Callable[[], object], reps: int, warmup: int, refill: Optional[Callable[[], None]],
          busy: Optional[Callable[[], object]] = None) -> Tuple[list, list, int]:
    """The one timing loop: warm-ups, then per run refill(), an idle GPU, busy() (if given) queued first, and
    CUDA events around fn() in stream order; (GPU ms per run, host issue ms per run, runs the GPU reached before the
    host had issued fn -- with busy(): runs not queued)."""
    refill = refill or (lambda: None)
    for _ in range(warmup):
        refill()
        fn()
    times, hosts, late = [], [], 0
    for _ in range(reps):
        refill()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy is not None:
            busy()
        start.record()  # with busy(): reached by the GPU when busy() is done
        h0 = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - h0) * 1e3)
        late += int(start.query())  # the GPU already past the start: it waited for the host in this run
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, hosts, late


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3,
              refill: Optional[Callable[[], None]] = None) -> float:
    return statistics.median(_runs(fn, reps, warmup, refill)[0])


def idle_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> Tuple[float, float]:
    """median_ms's runs (each from an idle GPU) with the host's part: (median GPU ms, median host issue ms)."""
    times, hosts, _ = _runs(fn, reps, warmup, None)
    return statistics.median(times), statistics.median(hosts)


def queued_ms(fn: Callable[[], object], busy: Callable[[], object], reps: int, warmup: int = 3,
              refill: Optional[Callable[[], None]] = None) -> Tuple[float, float, int]:
    times, hosts, late = _runs(fn, reps, warmup, refill, busy)
    return statistics.median(times), statistics.median(hosts), late
