"""Compare training curves of several runs against a reference run (e.g. parallel layouts against one GPU).

    python tools/compare_runs.py runs/layouts/1gpu runs/layouts/tp2 runs/layouts/pp2 [--key lm-loss grad-norm]
        [--tolerance 1e-4] [--json out.json]

Each argument is a run's --tensorboard-dir (or its metrics.jsonl, which the trainer writes next to the TensorBoard
events), a run directory holding tensorboard/metrics.jsonl, or NAME=PATH to label it.  The first is the reference.
Prints, per metric, each run's largest relative difference |x - ref| / |ref| over the iterations both logged, and
the iteration where it occurs.  With --tolerance, exits 1 when a difference exceeds it (or a run shares no
iteration with the reference), naming the run and metric.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple


def _metrics_file(path: Path) -> Path:
    for cand in (path, path / "metrics.jsonl", path / "tensorboard" / "metrics.jsonl"):
        if cand.is_file():
            return cand
    raise SystemExit(f"compare_runs: no metrics.jsonl at {path} (nor {path}/metrics.jsonl, "
                     f"{path}/tensorboard/metrics.jsonl)")


def load_curves(path: Path) -> Dict[str, Dict[int, float]]:
    """{metric: {iteration: value}} from a metrics.jsonl (later records of an iteration win, as after a resume)."""
    f = _metrics_file(path)
    curves: Dict[str, Dict[int, float]] = {}
    text = f.read_text(errors="replace")
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            it = int(rec["iteration"])
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines) and not text.endswith("\n"):  # a last line torn by a crash or a full disk
                print(f"compare_runs: {f}:{n}: skipping an incomplete last line", file=sys.stderr)
                break
            raise SystemExit(f"compare_runs: {f}:{n}: not a metrics record ({e})")
        for k, v in rec.items():
            if k != "iteration" and isinstance(v, (int, float)):
                curves.setdefault(k, {})[it] = float(v)
    return curves


def max_rel_diff(ref: Dict[int, float], run: Dict[int, float]) -> Tuple[float, int, int]:
    """(largest relative difference, its iteration, number of common iterations)."""
    common = sorted(set(ref) & set(run))
    worst, at = 0.0, -1
    for it in common:
        d = abs(run[it] - ref[it]) / max(abs(ref[it]), 1e-30)
        if d >= worst:
            worst, at = d, it
    return worst, at, len(common)


def _label(arg: str) -> Tuple[str, Path]:
    if "=" in arg and not Path(arg).exists():
        name, p = arg.split("=", 1)
        return name, Path(p)
    p = Path(arg)
    name = p.name if p.name not in ("tensorboard", "metrics.jsonl") else p.parent.name
    if p.name == "metrics.jsonl" and p.parent.name == "tensorboard":
        name = p.parent.parent.name
    return name, p


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="reference first; run dirs, tensorboard dirs, metrics.jsonl or NAME=PATH")
    ap.add_argument("--key", nargs="+", default=["lm-loss"], help="metrics to compare (default: lm-loss)")
    ap.add_argument("--tolerance", type=float, default=None, help="exit 1 when a relative difference exceeds this")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    if len(args.runs) < 2:
        ap.error("give a reference run and at least one run to compare")
    (ref_name, ref_path), *others = [_label(a) for a in args.runs]
    ref = load_curves(ref_path)
    rows, failures = [], []
    for key in args.key:
        if key not in ref:
            raise SystemExit(f"compare_runs: the reference {ref_name} logged no {key!r} (has: {', '.join(sorted(ref))})")
        print(f"{key}: reference {ref_name}, {len(ref[key])} iterations")
        for name, path in others:
            curve = load_curves(path).get(key, {})
            worst, at, n = max_rel_diff(ref[key], curve)
            rows.append(dict(metric=key, run=name, max_rel_diff=worst, at_iteration=at, common_iterations=n))
            print(f"  {name:24s} max rel diff {worst:.3e} at iteration {at:>5d}  ({n} common iterations)")
            if args.tolerance is not None and (n == 0 or worst > args.tolerance):
                failures.append(f"{name} {key}: " + ("no common iteration" if n == 0 else
                                                     f"{worst:.3e} > {args.tolerance:g} at iteration {at}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"reference": ref_name, "rows": rows}, indent=1))
    for f in failures:
        print(f"compare_runs: FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
