"""The end of a run, said once: what it did, where it left things, and what to run next.

    run summary: 300 iterations (0 -> 300) in 1m32s, 2.46M tokens | validation lm loss: last 1.112 (iter 300),
        best 1.104 (iter 250)
      checkpoint:  runs/finetune_tiny/20261201-091502/iter_0000300
      tensorboard: runs/finetune_tiny/20261201-091502/tensorboard  (tensorboard --logdir ...)
      resume:      python finetune_glm5.py --load runs/finetune_tiny/20261201-091502 ...
      export:      python tools/convert_megatron_to_hf.py --load runs/finetune_tiny/20261201-091502 --save OUT

Rank 0 prints it (the logging rank); the numbers come from the loop, nothing is recomputed here.
"""
from __future__ import annotations

import math
import shlex
import sys
from typing import List, Optional, Tuple


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _tokens(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def resume_command(entry: str, save: str, argv: List[str]) -> str:
    """The command line that continues this run: the same flags with --load pointing at its directory."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--load", "--save", "--overwrite", "--resume", "--finetune"):
            skip = a in ("--load", "--save")
            continue
        if a.startswith(("--load=", "--save=")):
            continue
        kept.append(a)
    return " ".join(shlex.quote(x) for x in ["python", entry, *kept, "--load", save, "--save", save])


class RunSummary:
    def __init__(self, start_iteration: int, tokens_per_iteration: int):
        self.start_iteration = start_iteration
        self.tokens_per_iteration = tokens_per_iteration
        self.iteration = start_iteration
        self.evals: List[Tuple[int, float]] = []
        self.last_checkpoint: Optional[str] = None

    def note_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def note_eval(self, iteration: int, loss: Optional[float]) -> None:
        if loss is not None and math.isfinite(loss):
            self.evals.append((iteration, float(loss)))

    def note_checkpoint(self, path: str) -> None:
        self.last_checkpoint = path

    def lines(self, seconds: float, save: Optional[str], tensorboard_dir: Optional[str], entry: str,
              argv: Optional[List[str]] = None) -> List[str]:
        done = self.iteration - self.start_iteration
        head = (f"run summary: {done} iterations ({self.start_iteration} -> {self.iteration}) in "
                f"{_duration(seconds)}, {_tokens(done * self.tokens_per_iteration)} tokens")
        if self.evals:
            last_it, last = self.evals[-1]
            best_it, best = min(self.evals, key=lambda e: (e[1], e[0]))
            head += (f" | validation lm loss: last {last:.4f} (iter {last_it}), best {best:.4f} (iter {best_it}), "
                     f"ppl {math.exp(min(last, 50)):.2f}")
        out = [head]
        if self.last_checkpoint:
            out.append(f"  checkpoint:  {self.last_checkpoint}")
        elif save:
            out.append(f"  checkpoint:  none written this run (directory {save})")
        if tensorboard_dir:
            out.append(f"  tensorboard: {tensorboard_dir}  (tensorboard --logdir {shlex.quote(tensorboard_dir)})")
        if save and self.last_checkpoint:
            argv = list(sys.argv[1:] if argv is None else argv)
            out.append(f"  resume:      {resume_command(entry, save, argv)}")
            out.append(f"  export:      python tools/convert_megatron_to_hf.py --load {shlex.quote(save)} "
                       f"--save OUT_DIR")
        return out
