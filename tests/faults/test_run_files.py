"""The run's own files on a read-only file system: refused at start with one line, nothing written anywhere
(docs/bad_input.md). A read-only directory is a chmod 555 one for a normal user, a read-only tmpfs for root
(root writes through permission bits)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training_helpers import assert_user_error, run_entries  # noqa: E402

TINY = ["--train-iters", "2", "--eval-iters", "0", "--seq-length", "64"]


@contextlib.contextmanager
def read_only_dir(path: Path):
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs a non-root user or the right to mount a read-only tmpfs ({mounted.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_tensorboard_dir_and_save_are_refused_at_start(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        save = tmp_path / "save"
        proc, run_proc = run_entries([("finetune", [*TINY, "--save", save, "--tensorboard-dir", ro / "tb"], tmp_path),
                                      ("finetune", [*TINY, "--save", ro / "run"], tmp_path)])  # both at once
        message = assert_user_error(proc, f"--tensorboard-dir {ro / 'tb'}: cannot write there: {ro} is not writable",
                                    "give a writable directory")
        assert not save.exists(), sorted(save.iterdir())  # refused before the run claimed --save
        assert "iter " not in proc.stdout, message  # before the first step
        proc = run_proc
        assert_user_error(proc, f"--save {ro / 'run'}")
        assert "iter " not in proc.stdout
