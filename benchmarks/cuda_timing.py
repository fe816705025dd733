"""The benchmarks' one CUDA-event timer: the median milliseconds of ``fn()`` over ``reps`` runs after ``warmup``
runs, ``refill()`` (fresh random inputs) before each run and outside the timed region."""
from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3, refill: Optional[Callable[[], None]] = None) -> float:
    refill = refill or (lambda: None)
    for _ in range(warmup):
        refill()
        fn()
    times = []
    for _ in range(reps):
        refill()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
