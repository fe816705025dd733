"""Progress and memory figures of the conversion tools.

``byte_bar``: the one progress bar of a conversion, over tensor bytes (tqdm: bytes/s and ETA), fed by every worker
(parallel.py aggregates the workers' counts through a queue). It is shown only when asked for (``--no-progress``
turns it off) and when stderr is a terminal: a log file or CI output gets no carriage-return lines, only the
tools' summary line.

``peak_rss_bytes``: the peak resident set of the calling process (each worker reports its own).
"""
from __future__ import annotations

import resource
import sys


def byte_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` bytes; disabled (updates cost nothing) unless ``enabled`` and stderr is a tty."""
    from tqdm import tqdm

    show = bool(enabled) and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not show,
                dynamic_ncols=True, file=sys.stderr, smoothing=0.1)


def peak_rss_bytes() -> int:
    """Peak resident set of this process image: VmHWM (Linux; unlike ru_maxrss it does not inherit the peak of a
    parent that forked us before exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
