"""Adam against Muon on the tiny model: the same data, seed and schedule, each at the best of a few learning rates.

    python benchmarks/adam_vs_muon.py [--iters 300] [--adam-lrs 1e-3,3e-3,1e-2] [--muon-lrs 1e-3,3e-3,1e-2]
        [--out runs/adam_vs_muon] [--json adam_vs_muon.json] [--jobs N]

Every run is finetune_glm5.py on the shipped SFT data (tiny preset, fp32 on CPU, seq 64, global batch 4, cosine
schedule with 10% warm-up, validation every 50 iterations on 10 batches), one per (optimizer, lr); its TensorBoard
logs are under <out>/<optimizer>_lr<lr>/tensorboard (and metrics.jsonl beside them). The best lr of each optimizer
is the one with the lowest final validation loss. Printed: a table of every run (final training loss = mean of the
last 20 logged steps, validation loss at each evaluation), then both best runs' curves side by side, and the JSON
summary (device, command, runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--preset", "tiny", "--attn", "torch", "--seq-length", "64", "--micro-batch-size", "4",
          "--global-batch-size", "4", "--log-interval", "10", "--eval-interval", "50", "--eval-iters", "10",
          "--seed", "1234", "--no-save"]


def run(optimizer: str, lr: float, iters: int, out: Path) -> dict:
    tb = out / f"{optimizer}_lr{lr:g}" / "tensorboard"
    tb.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "finetune_glm5.py"), *COMMON, "--train-iters", str(iters),
           "--optimizer", optimizer, "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--tensorboard-dir", str(tb)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"))
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    train, val = {}, {}
    for line in (tb / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lm-loss" in rec:
            train[rec["iteration"]] = rec["lm-loss"]
        if "validation/lm-loss" in rec:
            val[rec["iteration"]] = rec["validation/lm-loss"]
    last = sorted(train)[-20:]
    return dict(optimizer=optimizer, lr=lr, seconds=round(time.time() - t0, 1), train=train, validation=val,
                final_train=sum(train[i] for i in last) / len(last), final_validation=val[max(val)],
                tensorboard=str(tb))


def main() -> int:
    p = argparse.ArgumentParser(prog="benchmarks/adam_vs_muon.py")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--out", default="runs/adam_vs_muon")
    p.add_argument("--json", default=None)
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    opts = p.parse_args()
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = [(o, float(lr)) for o, lrs in (("adam", opts.adam_lrs), ("muon", opts.muon_lrs)) for lr in lrs.split(",")]
    with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        runs = list(pool.map(lambda job: run(job[0], job[1], opts.iters, out), todo))
    evals = sorted(runs[0]["validation"])
    print(f"{'optimizer':9} {'lr':>7} {'final train':>11} " + " ".join(f"val@{i:<4}" for i in evals))
    for r in runs:
        print(f"{r['optimizer']:9} {r['lr']:7g} {r['final_train']:11.4f} "
              + " ".join(f"{r['validation'][i]:8.4f}" for i in sorted(r["validation"])))
    best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["final_validation"])
            for o in ("adam", "muon")}
    a, m = best["adam"], best["muon"]
    print(f"\nbest: adam lr {a['lr']:g}, muon lr {m['lr']:g}\n{'iter':>5} {'adam train':>10} {'muon train':>10}")
    for i in sorted(a["train"]):
        if i % 20 == 0 or i == 10:
            print(f"{i:5d} {a['train'][i]:10.4f} {m['train'].get(i, float('nan')):10.4f}")
    import torch

    report = dict(device="cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                  command=" ".join(["python", "benchmarks/adam_vs_muon.py", *sys.argv[1:]]), flags=COMMON,
                  iters=opts.iters, best={o: r["lr"] for o, r in best.items()}, runs=runs)
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
