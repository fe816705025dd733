"""The CPU layout-test harness: run finetune_glm5.py / a tool under torchrun (gloo) and compare per-step metrics
with a single-process run. Used by tests/test_layouts_*.py; the shared single-process reference is the
session fixture ``layouts_reference`` in tests/conftest.py (built once for every file that uses it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LAUNCH_TIMEOUT = 300

STEPS, RESUME_AT = 6, 3
TRAIN = ["--preset", "tiny", "--attn", "torch", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0",
         "--seed", "1234"]
LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 5e-6



def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("MEGATRON_GLM5_DISABLE_SHIMS", None)
    # layouts are compared with each other: torch.compile of megatron-core's small fusions, redone in every
    # process at start-up, only costs time here (the training tests keep it on)
    env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def _launch(nproc: int, script: str, args: list[str], log: Path):
    cmd = TORCHRUN + ["--nproc-per-node", str(nproc), script] + args
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=LAUNCH_TIMEOUT)
    if r.returncode:
        tail = log.read_text()[-4000:]
        pytest.fail(f"{' '.join(cmd)} exited with {r.returncode}; end of {log}:\n{tail}")


def _train(nproc: int, out: Path, *extra: str) -> dict:
    """Run finetune_glm5.py; {iteration: metrics} of the logged steps."""
    out.mkdir(parents=True, exist_ok=True)
    _launch(nproc, "finetune_glm5.py", TRAIN + ["--tensorboard-dir", str(out / "tb"), *extra], out / "log.txt")
    steps = {}
    for line in (out / "tb" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lm-loss" in rec:
            steps[rec["iteration"]] = rec
    return steps


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_steps_match(run: dict, ref: dict, steps, what: str):
    assert sorted(run) == list(steps), f"{what}: logged iterations {sorted(run)}, expected {list(steps)}"
    loss = {i: _rel(run[i]["lm-loss"], ref[i]["lm-loss"]) for i in steps}
    gnorm = {i: _rel(run[i]["grad-norm"], ref[i]["grad-norm"]) for i in steps}
    print(f"{what}: max relative difference lm-loss {max(loss.values()):.2e}, grad-norm {max(gnorm.values()):.2e}")
    bad = {i: (run[i]["lm-loss"], ref[i]["lm-loss"]) for i in steps if loss[i] > LOSS_RTOL}
    assert not bad, f"{what}: lm-loss differs from the single-process run by more than {LOSS_RTOL:g} (run, ref): {bad}"
    bad = {i: (run[i]["grad-norm"], ref[i]["grad-norm"]) for i in steps if gnorm[i] > GRAD_NORM_RTOL}
    assert not bad, f"{what}: grad norm differs by more than {GRAD_NORM_RTOL:g} (run, ref): {bad}"


def make_layouts_reference(root: Path):
    """(start checkpoint, reference checkpoint root, reference steps {iteration: metrics}, work directory): a
    one-process run trains 1 step and saves (the shared start); the reference loads it and trains STEPS steps,
    saving at RESUME_AT."""
    start = root / "start"
    _train(1, root / "start_run", "--train-iters", "1", "--save", str(start))
    ref_ckpt = root / "ref_ckpt"
    ref = _train(1, root / "ref", "--load", str(start), "--finetune", "--train-iters", str(STEPS),
                 "--save", str(ref_ckpt), "--save-interval", str(RESUME_AT))
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert (ref_ckpt / f"iter_{RESUME_AT:07d}").is_dir()
    return start, ref_ckpt, ref, root
