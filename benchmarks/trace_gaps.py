"""Where a profiled step's GPU sat idle: the gaps between its kernels in a torch.profiler trace, and the host ops
that issued the kernel after each gap.

    python benchmarks/trace_gaps.py TRACE.json[.gz] [--top 15] [--slow-host-ms 1]

TRACE: a chrome trace (``benchmarks/proxy_step.py --profile N --trace DIR`` writes DIR/trace_<impl>.json.gz).
A gap is "late" when the next kernel was launched after the GPU had already drained (the host was behind): those
are the gaps that host work, a synchronisation or a collector pause causes. Printed: the total gap time, the late
part, the late gap time by the innermost host op around the launch, the largest gaps, and host ops that took
longer than --slow-host-ms.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gaps(events: list) -> tuple[list, list, float]:
    """(gaps as (us, next GPU event, its launch event or None, late), the GPU events sorted, their first start)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "args" in e}
    out = []
    if not gpu:
        return out, gpu, 0.0
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] > end:
            launch = launches.get(e.get("args", {}).get("correlation"))
            out.append((e["ts"] - end, e, launch, launch is not None and launch["ts"] > end))
        end = max(end, e["ts"] + e["dur"])
    return out, gpu, gpu[0]["ts"]


class HostOps:
    """The innermost host (cpu_op) event around a time stamp."""

    def __init__(self, events: list):
        self.ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                          key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.ops]
        self.longest = max((e["dur"] for e in self.ops), default=0)

    def around(self, ts: float):
        best = None
        i = bisect.bisect_right(self.starts, ts)
        while i > 0:
            i -= 1
            e = self.ops[i]
            if e["ts"] < ts - self.longest:
                break
            if e["ts"] + e["dur"] >= ts and (best is None or e["dur"] < best["dur"]):
                best = e
        return best


def report(path: str, top: int, slow_host_ms: float, out=sys.stdout) -> dict:
    events = load(path)
    found, gpu, t0 = gaps(events)
    host = HostOps(events)
    total = sum(g for g, *_ in found)
    late = sum(g for g, _, _, is_late in found if is_late)
    span = (max(e["ts"] + e["dur"] for e in gpu) - t0) if gpu else 0.0
    print(f"{path}: {len(gpu)} GPU events over {span / 1e3:.2f} ms; gaps {total / 1e3:.2f} ms in {len(found)}, "
          f"of which launched late (the host was behind) {late / 1e3:.2f} ms", file=out)
    by_op = collections.Counter()
    for g, _, launch, is_late in found:
        if is_late:
            op = host.around(launch["ts"])
            by_op[op["name"] if op else "?"] += g
    print("late gap time by the host op that issued the next kernel:", file=out)
    for name, g in by_op.most_common(top):
        print(f"  {g / 1e3:8.3f} ms  {name}", file=out)
    print("largest gaps (ms, at ms from the first GPU event, next GPU event, late):", file=out)
    for g, e, launch, is_late in sorted(found, key=lambda x: -x[0])[:top]:
        print(f"  {g / 1e3:7.3f} at {(e['ts'] - t0) / 1e3:8.2f}  {e['name'][:70]}  {'late' if is_late else ''}",
              file=out)
    slow = [e for e in host.ops if e["dur"] > slow_host_ms * 1e3 and not e["name"].startswith("autograd::")]
    print(f"host ops longer than {slow_host_ms} ms (at ms from the first GPU event):", file=out)
    for e in slow[:top]:
        print(f"  {(e['ts'] - t0) / 1e3:8.2f} +{e['dur'] / 1e3:7.3f} ms  {e['name'][:70]}", file=out)
    return {"gap_ms": total / 1e3, "late_gap_ms": late / 1e3, "span_ms": span / 1e3,
            "late_by_op_ms": {k: v / 1e3 for k, v in by_op.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--slow-host-ms", type=float, default=1.0)
    args = p.parse_args(argv)
    report(args.trace, args.top, args.slow_host_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
