"""A new user's first hour, in one clone: the README's first command, the tiny example scripts, then the first
command again -- every run's checkpoints and TensorBoard events stay intact and separate. Also the guard under it
(training/run_dir.py) through the real entry point: a fresh run into a used --save is refused with one line, two
runs started at once on one --save (the second refused), --overwrite replaces, --resume continues.

Runs are shortened with the scripts' own pass-through flags ("$@") so the whole module stays CI-sized.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from training_helpers import (REPO, assert_user_error, check_ok, describe, entry_env, latest_iteration,
                              read_metrics, run_entries, run_entry, series)

SHORT = ["--train-iters", "4", "--lr-warmup-iters", "1", "--save-interval", "2", "--eval-interval", "2",
         "--eval-iters", "1", "--log-interval", "2"]


def _fingerprint(run: Path) -> dict:
    """Every file of a run directory (checkpoints, events, metrics) -> sha256, except its live lock file."""
    out = {}
    for p in sorted(run.rglob("*")):
        if p.is_file() and p.name != "run.lock":
            out[str(p.relative_to(run))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _runs(root: Path):
    return sorted(p for p in root.iterdir() if (p / "run.json").is_file()) if root.is_dir() else []


def _script(name: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    """examples/NAME run from a copy of the clone's layout (scripts cd to their repo root)."""
    return subprocess.run(["bash", str(cwd / "examples" / name), *extra], cwd=cwd, env=entry_env(),
                          capture_output=True, text=True, timeout=600)


def _scripts_at_once(cwd: Path, *runs) -> list:
    """Several (NAME, *extra) example scripts started together (each one process on its own core), as _script."""
    procs = []
    for name, *extra in runs:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((subprocess.Popen(["bash", str(cwd / "examples" / name), *extra], cwd=cwd, env=entry_env(),
                                       stdout=out, stderr=err, text=True), out, err))
    done = []
    for p, out, err in procs:
        p.wait(timeout=600)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, *texts))
    return done


@pytest.fixture
def clone(tmp_path):
    """A working copy of the repository's user-facing files (entry scripts, examples, package by symlink)."""
    root = tmp_path / "clone"
    root.mkdir()
    for name in ("finetune_glm5.py", "pretrain_glm5.py", "megatron_glm5", "tools"):
        os.symlink(REPO / name, root / name)
    (root / "examples").mkdir()
    for p in (REPO / "examples").iterdir():
        os.symlink(p, root / "examples" / p.name)
    return root


@pytest.mark.slow
def test_readme_command_examples_and_again_keep_every_run(clone):
    first = check_ok(run_entry("finetune", SHORT, clone))
    ft_root = clone / "runs" / "finetune_tiny"
    (run1,) = _runs(ft_root)
    assert str(run1.relative_to(clone)) in first.stdout + first.stderr  # the directory is printed at start
    before = _fingerprint(run1)

    # the two single-process scripts write different run roots: they run at once, both after the first command
    sft, pre = _scripts_at_once(clone, ("tiny_cpu_sft.sh", *SHORT), ("tiny_cpu_pretrain.sh", *SHORT))
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert pre.returncode == 0, pre.stderr[-3000:]
    lay = _script("tiny_cpu_layouts.sh", clone, "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
                  "--save-interval", "2")
    assert lay.returncode == 0, lay.stderr[-3000:]
    again = check_ok(run_entry("finetune", SHORT, clone))

    runs = _runs(ft_root)
    assert len(runs) == 3, [p.name for p in runs]  # first command, the SFT script, the first command again
    assert _fingerprint(run1) == before, "a later run changed the first run's files"
    (pre_run,) = _runs(clone / "runs" / "pretrain_tiny")
    for run in runs + [pre_run]:
        assert latest_iteration(run) == 4 and (run / "iter_0000004").is_dir(), describe(again)
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
        assert sorted(series(read_metrics(run / "tensorboard"), "lm-loss")) == [2, 4]  # one run per directory
    (layouts,) = [p for p in (clone / "runs" / "layouts").iterdir()]
    assert sorted(p.name for p in layouts.iterdir()) == ["ep2", "pp2", "tp2"]
    for run in layouts.iterdir():
        assert latest_iteration(run) == 2 and list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_summary_nothing_left_to_train_and_eval_only(tmp_path):
    """The end of a run says what happened and what to run next; a resume with nothing left to train says so;
    --eval-only evaluates a checkpoint and writes nothing."""
    save = tmp_path / "r"
    done = check_ok(run_entry("finetune", SHORT + ["--save", save], tmp_path))
    out = done.stdout + done.stderr
    assert "run summary: 4 iterations (0 -> 4)" in out and f"checkpoint:  {save}/iter_0000004" in out
    assert f"--load {save} --save {save}" in out and "tools/convert_megatron_to_hf.py --load" in out
    kept = _fingerprint(save)
    # the three runs below only read the checkpoint: they start together
    again, ev, no_load = run_entries([("finetune", SHORT + ["--load", save], tmp_path),
                                      ("finetune", ["--eval-only", "--load", save, "--eval-iters", "2"], tmp_path),
                                      ("finetune", ["--eval-only"], tmp_path)])
    check_ok(again)
    assert "nothing to train: the checkpoint is at iteration 4 and --train-iters is 4" in again.stdout + again.stderr
    check_ok(ev)
    line = [l for l in (ev.stdout + ev.stderr).splitlines() if "evaluation of" in l]
    assert line and "(iteration 4): lm loss " in line[0] and "ppl " in line[0], ev.stdout[-2000:]
    assert {k: v for k, v in _fingerprint(save).items() if "tensorboard" not in k} == \
        {k: v for k, v in kept.items() if "tensorboard" not in k}  # no checkpoint written by either
    assert_user_error(no_load, "--eval-only needs --load")


def test_fresh_run_into_a_used_save_is_refused_then_overwrite_and_resume(tmp_path):
    save = tmp_path / "mine"
    check_ok(run_entry("finetune", SHORT + ["--save", save], tmp_path))
    kept = _fingerprint(save)
    # both refused at start, and both only read the run: they start together
    refused, other = run_entries([("finetune", SHORT + ["--save", save, "--lr", "2e-3"], tmp_path),
                                  ("finetune", SHORT + ["--load", save, "--preset", "tiny-indexshare"], tmp_path)])
    msg = assert_user_error(refused, f"--save {save} already holds run", "iteration 4", "--overwrite")
    assert "--load" in msg and _fingerprint(save) == kept
    assert_user_error(other, "another model")
    # continuing it (same model) takes the run's own checkpoint
    cont = check_ok(run_entry("finetune", ["--train-iters", "6", "--lr-warmup-iters", "1", "--log-interval", "2",
                                           "--eval-interval", "2", "--eval-iters", "1", "--resume", "--save", save],
                              tmp_path))
    assert "resumed from" in cont.stdout and latest_iteration(save) == 6
    check_ok(run_entry("finetune", SHORT + ["--save", save, "--overwrite"], tmp_path))
    assert latest_iteration(save) == 4 and not (save / "iter_0000006").exists()


def test_two_runs_at_once_on_one_save(tmp_path):
    save = tmp_path / "both"
    a, b = run_entries([("finetune", SHORT + ["--save", save], tmp_path),
                        ("finetune", SHORT + ["--save", save], tmp_path)])
    ok = [p for p in (a, b) if p.returncode == 0]
    refused = [p for p in (a, b) if p.returncode != 0]
    assert len(ok) == 1 and len(refused) == 1, describe(a) + describe(b)
    msg = assert_user_error(refused[0])
    assert "another run is using this directory" in msg or "already holds" in msg, msg
    assert sorted(series(read_metrics(save / "tensorboard"), "lm-loss")) == [2, 4]  # one run's records only
