"""Run the real entry scripts (pretrain_glm5.py / finetune_glm5.py) in subprocesses and read what they leave.

    proc = run_entry("finetune", ["--train-iters", "4"], cwd=tmp_path)      # CompletedProcess (text)
    a, b = run_entries([("finetune", [...], dir_a), ("finetune", [...], dir_b)])  # concurrently
    records = read_metrics(only_run_dir(tmp_path / "runs/finetune_tiny") / "tensorboard")  # metrics.jsonl
    losses = series(records, "lm-loss")                                     # {iteration: value}
    ea = event_scalars(tb_dir)                                              # tensorboard EventAccumulator

Each run gets ``OMP_NUM_THREADS=1`` and its own working directory (the default ``--save`` is relative).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"finetune": REPO / "finetune_glm5.py", "pretrain": REPO / "pretrain_glm5.py"}
TIMEOUT_S = 400


def entry_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MEGATRON_GLM5_TRACEBACK", None)  # user errors must be one line, as users see them
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def entry_command(mode: str, args: Sequence[str]) -> List[str]:
    return [sys.executable, str(SCRIPTS[mode]), *map(str, args)]


def start_entry(mode: str, args: Sequence[str], cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Popen of an entry script (text mode)."""
    return subprocess.Popen(entry_command(mode, args), cwd=str(cwd), env=entry_env(), stdout=stdout, stderr=stderr,
                            text=True)


def run_entries(runs: Sequence[Tuple[str, Sequence[str], object]], timeout: float = TIMEOUT_S
                ) -> List[subprocess.CompletedProcess]:
    """Run several entry scripts at once ((mode, args, cwd) each) and wait for all; CompletedProcess each."""
    procs = []
    for mode, args, cwd in runs:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((start_entry(mode, args, cwd, stdout=out, stderr=err), out, err, mode, args))
    deadline = time.time() + timeout
    results = []
    try:
        for p, out, err, mode, args in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p, *_ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out, err, mode, args in procs:
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        results.append(subprocess.CompletedProcess(entry_command(mode, args), p.returncode, *texts))
    return results


def run_entry(mode: str, args: Sequence[str], cwd, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return run_entries([(mode, args, cwd)], timeout=timeout)[0]


def describe(proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """The end of a run's output, for assertion messages."""
    return (f"command: {' '.join(proc.args)}\nexit code {proc.returncode}\n--- stdout (end) ---\n"
            f"{proc.stdout[-tail:]}\n--- stderr (end) ---\n{proc.stderr[-tail:]}")


def check_ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, describe(proc)
    return proc


def read_metrics(tensorboard_dir) -> List[dict]:
    path = Path(tensorboard_dir) / "metrics.jsonl"
    assert path.is_file(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: Sequence[dict], key: str) -> Dict[int, float]:
    """{iteration: value} of one scalar; an iteration logged twice (a resumed run appending) keeps the last."""
    return {r["iteration"]: r[key] for r in records if key in r}


def event_scalars(tensorboard_dir):
    """An EventAccumulator over the TensorBoard event files of a directory, loaded, every scalar kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return ea


def only_run_dir(root) -> Path:
    """The one run directory a run without --save made under runs/<mode>_<model>/ (a new one per run)."""
    runs = sorted(p for p in Path(root).iterdir() if (p / "run.json").is_file())
    assert len(runs) == 1, f"expected one run directory under {root}, found {[p.name for p in runs]}"
    return runs[0]


def latest_iteration(save_dir) -> int:
    return int((Path(save_dir) / "latest_checkpointed_iteration.txt").read_text().strip())


def checkpoint_dirs(root) -> List[Path]:
    """Every checkpoint directory (complete or partial) anywhere under root."""
    return sorted(p for p in Path(root).rglob("iter_*") if p.is_dir())


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str, workdir=None) -> str:
    """The run failed as a user error: non-zero exit, stderr ends with one line 'error: ...' holding every needle,
    no traceback; and no checkpoint (not even a partial one) under workdir. Returns the error line."""
    assert proc.returncode != 0, describe(proc)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), describe(proc)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, describe(proc)
    message = lines[-1]
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    if workdir is not None:
        assert not checkpoint_dirs(workdir), f"checkpoint left behind: {checkpoint_dirs(workdir)}"
    return message
