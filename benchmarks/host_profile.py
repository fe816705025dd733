"""Where the host's time goes while it issues a GPU call: cProfile over a few calls, each issued behind queued GPU
work (so no call waits for the GPU and the profile holds only the host's own cost), the functions with the most time
of their own and the most time under them."""
from __future__ import annotations

import cProfile
import io
import pstats
from typing import Callable, Optional

import torch


def host_profile(fn: Callable[[], object], calls: int, top: int, log: Callable[[str], None],
                 busy: Optional[Callable[[], object]] = None) -> pstats.Stats:
    prof = cProfile.Profile()
    for _ in range(calls):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if busy is not None:
            busy()
        prof.enable()
        fn()
        prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    for key, what in (("tottime", "own time"), ("cumulative", "time under them")):
        text = io.StringIO()
        stats.stream = text
        stats.sort_stats(key).print_stats(top)
        body = text.getvalue()
        start = body.find("ncalls")
        log(f"host profile, {calls} calls, the top {top} functions by {what} (seconds over all calls):\n"
            + (body[start:] if start >= 0 else body).rstrip())
    return stats
