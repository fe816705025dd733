"""A rank of a 2-process torchrun run killed (SIGKILL) or stopped (SIGSTOP) mid-training: the job ends within
--distributed-timeout-minutes with one line naming the lost rank (exit status 3 on the survivor), and the
checkpoints on disk are as the last "saved checkpoint" line left them (docs/fault_tolerance.md).

Before the watchdog's liveness records and Watchdog.explain, the kill left the survivor's gloo traceback
("Connection reset by peer"), and the stopped rank was blamed as "a collective itself is stuck" (same iteration)."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_faults import TorchrunJob  # noqa: E402

from megatron_glm5.checkpoint import format as ckpt_format  # noqa: E402
from megatron_glm5.checkpoint import manifest  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TIMEOUT_MIN = 0.3  # 18 s
STARTUP_S = 300


def _errors(text: str):
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _on_disk(save: Path):
    complete = ckpt_format.complete_dirs(str(save))
    return {"latest": ckpt_format.read_latest(str(save)), "complete": [it for it, _ in complete],
            "damaged": {d: manifest.verify(d) for _, d in complete if manifest.verify(d)}}


def _no_child_traceback(text: str):
    # torchrun's own ChildFailedError traceback (its process) is the only one; no rank's traceback
    assert text.count("Traceback (most recent call last)") <= 1, text[-6000:]
    assert "RuntimeError" not in text and "[rank0]:" not in text and "[rank1]:" not in text, text[-6000:]


def test_kill_9_of_one_rank_mid_save_is_named_and_nothing_is_half_promoted(tmp_path):
    job = TorchrunJob(tmp_path, ["--distributed-timeout-minutes", TIMEOUT_MIN])
    try:
        assert job.wait_for(lambda: len(job.saved()) >= 2, timeout=STARTUP_S), job.output()[-4000:]
        # the next save: kill rank 1 as soon as its .partial directory appears
        assert job.wait_for(lambda: bool(ckpt_format.partial_dirs(str(job.save))), timeout=60), job.output()[-3000:]
        victim = job.rank_pids()[1]
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        code = job.wait(timeout=120)
        took = time.time() - t0
    finally:
        job.cleanup()
    text = job.output()
    assert code != 0, text[-4000:]
    assert took < TIMEOUT_MIN * 60, (took, text[-3000:])
    errors = _errors(text)
    assert len(errors) == 1, text[-6000:]
    assert errors[0].startswith("error: rank 0: lost rank 1 (its process ") and "has exited" in errors[0], errors
    assert "resume from them with --load" in errors[0], errors
    _no_child_traceback(text)
    # torchrun's summary shows the same line as the survivor's failure (its error file)
    assert f"traceback : {errors[0]}" in text, text[-3000:]
    disk = _on_disk(job.save)
    saved = job.saved()
    assert disk["damaged"] == {}, disk
    assert disk["latest"] == saved[-1] == max(disk["complete"]), (disk, saved)


def test_sigstop_of_one_rank_is_named_within_the_timeout(tmp_path):
    job = TorchrunJob(tmp_path, ["--distributed-timeout-minutes", TIMEOUT_MIN])
    stopped = None
    try:
        assert job.wait_for(lambda: len(job.saved()) >= 2, timeout=STARTUP_S), job.output()[-4000:]
        stopped = job.rank_pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        named = job.wait_for(lambda: bool(_errors(job.output())), timeout=TIMEOUT_MIN * 60 + 30, poll=0.2)
        took = time.time() - t0
        before = _on_disk(job.save)
        os.kill(stopped, signal.SIGCONT)  # then it finds rank 0 gone (or torchrun's SIGTERM ends it)
        code = job.wait(timeout=120)
    finally:
        job.cleanup()
    text = job.output()
    assert named and code != 0, text[-4000:]
    assert TIMEOUT_MIN * 60 - 5 <= took <= TIMEOUT_MIN * 60 + 10, (took, text[-3000:])
    first = _errors(text)[0]
    # the watchdog and gloo's own collective timeout use the same --distributed-timeout-minutes: whichever fires
    # first names the stopped rank (the watchdog's line, or the collective's error explained by its records)
    watchdog = (r"error: rank 0: no progress for \d+ s in \w+ of iteration \d+ \(--distributed-timeout-minutes "
                r"0.3\); waiting for: rank 1 \(.*its process \d+ is stopped\)$")
    collective = (r"error: rank 0: lost rank 1 \(its process \d+ is stopped\), during \w+ of iteration \d+ "
                  r"\(.*\); the job stops: the checkpoints it reported saved are complete, resume from them with "
                  r"--load$")
    assert re.match(watchdog, first) or re.match(collective, first), first
    assert f"its process {stopped} is stopped" in first, first
    _no_child_traceback(text)
    assert before["damaged"] == {} and before["latest"] == job.saved()[-1], before
    assert not job.ours(stopped)  # nothing outlives the job
