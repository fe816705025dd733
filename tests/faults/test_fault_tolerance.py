"""Checkpoint integrity under faults (docs/fault_tolerance.md), through tests/faults/harness.py.

Two harness processes start with the module and run side by side (each imports the training code once and
forks every training run): the randomised SIGKILL trials, and the fixed scenarios (damaged checkpoints,
--keep-last, a real file-size limit during a save, --async-save equality, SIGTERM / SIGUSR1). The tests judge
their JSON reports. FAULT_TRIALS / FAULT_SEED override the trial count and master seed (the seed is printed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import SAVE_INTERVAL, TRAIN_ITERS  # noqa: E402

pytestmark = pytest.mark.slow  # ~2 minutes of two cores for the whole module

TRIALS = int(os.environ.get("FAULT_TRIALS", "20"))
SEED = int(os.environ.get("FAULT_SEED", str(int(time.time()) % 100000)))
TIMEOUT_S = 900


def _start(cmd, workdir: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "MEGATRON_GLM5_TRACEBACK"):
        env.pop(var, None)
    out = open(workdir / f"{cmd[0]}.out", "w+")
    proc = subprocess.Popen([sys.executable, str(HERE / "harness.py"), *cmd, "--workdir", str(workdir / cmd[0]),
                             "--json", str(workdir / f"{cmd[0]}.json")], stdout=out, stderr=subprocess.STDOUT,
                            env=env, text=True)
    return proc, out


def _finish(job, workdir: Path, name: str) -> dict:
    proc, out = job
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seek(0)
    text = out.read()
    out.close()
    report = workdir / f"{name}.json"
    assert report.exists(), f"harness {name} wrote no report (exit {proc.returncode}):\n{text[-5000:]}"
    return {"report": json.loads(report.read_text()), "output": text, "exit": proc.returncode}


@pytest.fixture(scope="module")
def harness_jobs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("faults")
    jobs = {"trials": _start(["trials", "--trials", str(TRIALS), "--seed", str(SEED), "--jobs", "2"], workdir),
            "scenarios": _start(["scenarios"], workdir)}
    results = {}

    def get(name):
        if name not in results:
            results[name] = _finish(jobs[name], workdir, name)
        return results[name]
    yield get
    for proc, out in jobs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


@pytest.fixture(scope="module")
def scenarios(harness_jobs):
    return harness_jobs("scenarios")["report"]


def _scenario(scenarios, name) -> dict:
    result = scenarios.get(name)
    assert result is not None, f"scenario {name} did not run"
    assert not result.get("error"), f"scenario {name} raised:\n{result['error']}"
    return result


def _matches_reference(result, first: int):
    logged, ref = result["logged"], result["reference"]
    assert sorted(map(int, logged)) == list(range(first, TRAIN_ITERS + 1)), sorted(map(int, logged))
    for it, values in logged.items():
        assert values == ref[it], f"iteration {it}: {values} != reference {ref[it]} (must be bitwise equal)"


# ------------------------------------------------------------------------------------------------ trials


def test_random_sigkill_trials_resume_bitwise(harness_jobs):
    run = harness_jobs("trials")
    report = run["report"]
    trials = report["trials"]
    print(f"fault trials: master seed {report['master_seed']}, {len(trials)} trials in {report['total_s']} s")
    failed = {t["seed"]: t["failures"] for t in trials if t["failures"]}
    assert not failed, (f"failed trials (rerun one: python tests/faults/harness.py trials --only-seed SEED): "
                        f"{json.dumps(failed, indent=1)[:6000]}")
    assert len(trials) == TRIALS and run["exit"] == 0, run["output"][-3000:]
    kills = [a for t in trials for a in t["attempts"] if a["kill"] and a["exit"] != 0]
    assert all(a["exit"] == -9 for a in kills), [a["exit"] for a in kills]  # SIGKILL, nothing graceful
    mid_save = [a for a in kills if a["kill"]["kind"] == "save"]
    assert len(kills) >= TRIALS // 2 and len(mid_save) >= 3, (len(kills), len(mid_save))
    resumed = [t for t in trials if any(a["resumed_at"] > 0 for a in t["attempts"])]
    assert len(resumed) >= TRIALS // 2, len(resumed)
    assert all(t["attempts"][-1]["exit"] == 0 and t["attempts"][-1]["last_iteration"] == TRAIN_ITERS
               for t in trials)


# ------------------------------------------------------------------------------------------------ damage


@pytest.mark.parametrize("name, needle", [("corrupt_truncated", "truncated"), ("corrupt_flipped", "sha256 mismatch"),
                                          ("corrupt_no_manifest", "no manifest.json"),
                                          ("corrupt_missing_file", ".metadata: missing")])
def test_damaged_newest_checkpoint_falls_back_with_warning(scenarios, name, needle):
    r = _scenario(scenarios, name)
    newest, previous = f"iter_{TRAIN_ITERS:07d}", f"iter_{TRAIN_ITERS - SAVE_INTERVAL:07d}"
    assert r["exit"] == 0, r["tail"]
    warned = [w for w in r["warnings"] if "skipping checkpoint" in w]
    assert len(warned) == 1 and newest in warned[0] and needle in warned[0], r["warnings"]
    assert any(previous in w and "resuming from" in w for w in r["warnings"]), r["warnings"]
    assert len(r["resumed"]) == 1 and f"at iteration {TRAIN_ITERS - SAVE_INTERVAL}" in r["resumed"][0]
    _matches_reference(r, TRAIN_ITERS - SAVE_INTERVAL + 1)


def test_every_checkpoint_damaged_is_one_clear_error(scenarios):
    r = _scenario(scenarios, "corrupt_all")
    assert r["exit"] == 2 and len(r["errors"]) == 1, r["tail"]
    error = r["errors"][0]
    assert error.startswith("error: --load ") and "no usable checkpoint" in error, error
    for it in range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL):
        assert f"iter_{it:07d}: __0_0.distcp" in error, error
    assert "Traceback" not in r["tail"] and not r["logged"]


def test_keep_last_never_deletes_the_only_good_checkpoint(scenarios):
    r = _scenario(scenarios, "keep_last")
    assert r["exit"] == [0, 0], r
    # save 4 was damaged before retention ran: --keep-last 1 kept 4 (newest) AND 2 (the only one that verifies)
    assert r["dirs_after_damage"] == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert any("keeping" in w and "iter_0000002" in w for w in r["warnings"]), r["warnings"]
    assert any("skipping checkpoint" in w and "iter_0000004" in w for w in r["warnings"]), r["warnings"]
    assert "at iteration 2" in r["resumed"][0]
    _matches_reference(r, 3)
    # later good saves let retention work normally
    assert r["dirs_final"] == [f"iter_{TRAIN_ITERS:07d}", "latest_checkpointed_iteration.txt"]


# ------------------------------------------------------------------------------------------------ disk full


@pytest.mark.parametrize("name", ["disk_full_sync", "disk_full_async"])
def test_disk_full_during_save_is_clear_and_keeps_previous(scenarios, name):
    r = _scenario(scenarios, name)
    assert r["data_file_bytes"] > r["fsize_limit"]  # the limit really cuts the checkpoint's data file
    assert r["exit"][0] == 0 and r["exit"][1] == 2 and r["exit"][2] == 0, r["tail"]
    assert len(r["errors"]) == 1 and not r["traceback"], r["tail"]
    error = r["errors"][0]
    for needle in (f"--save {r['save_dir']}", "writing checkpoint", "iter_0000004.partial failed",
                   f"file-size limit (ulimit -f): {r['fsize_limit']} bytes", "nothing was promoted",
                   "iter_0000002 is untouched"):
        assert needle in error, (needle, error)
    # nothing half-written promoted, the previous checkpoint and pointer intact and loadable
    assert r["after_failure"] == {"dirs": ["iter_0000002", "latest_checkpointed_iteration.txt"], "latest": 2}
    assert "at iteration 2" in r["resumed"][0]
    _matches_reference(r, 3)


# ------------------------------------------------------------------------------------------------ async save


def test_async_save_is_loadable_and_equal(scenarios):
    r = _scenario(scenarios, "async_equal")
    assert r["exit"] == 0
    # the writer started after training had moved on (iteration 3 ran before save 2 completed) ...
    assert r["order"] == ["background 2", "iter 3", "saved 2"], r["order"]
    # ... and still holds exactly the tensors of a synchronous save at iteration 2
    assert r["tensors"] > 100 and r["differing"] == [], r["differing"][:10]
    _matches_reference(r, 1)  # async saving leaves the training itself unchanged


# ------------------------------------------------------------------------------------------------ preemption


@pytest.mark.parametrize("name, signame", [("signal_sigterm", "SIGTERM"), ("signal_sigusr1", "SIGUSR1"),
                                           ("signal_sigint", "SIGINT")])
def test_exit_signal_finishes_step_saves_and_exits_zero(scenarios, name, signame):
    r = _scenario(scenarios, name)
    assert r["exit"] == [0, 0], r
    assert len(r["received"]) == 1 and signame in r["received"][0], r["received"]
    k = r["latest_after_signal"]
    assert k is not None and 3 <= k < TRAIN_ITERS, r["exiting"]
    assert any(f"iter_{k:07d}" in line for line in r["saved"]), r["saved"]
    assert sorted(map(int, r["first"])) == list(range(1, k + 1))
    assert r["partials"] == [] and f"at iteration {k}" in r["resumed"][0]
    for it, values in r["first"].items():
        assert values == r["reference"][it]
    _matches_reference(r, k + 1)


def test_second_ctrl_c_stops_at_once_with_one_line(scenarios):
    r = _scenario(scenarios, "sigint_twice")
    assert r["exit"] == 130 and not r["traceback"], r["tail"]
    assert len(r["received"]) == 1 and "Ctrl-C again stops at once" in r["received"][0], r["received"]
    assert r["errors"] == ["error: interrupted (Ctrl-C twice): stopped at once, the unfinished step is not saved; "
                           "the checkpoints reported saved are complete"], r["tail"]
    # nothing half-promoted: the checkpoints are the ones reported saved, the pointer names the newest
    saved = [line.split("iter_")[-1] for line in r["saved"]]
    assert r["complete"] == [f"iter_{s}" for s in saved] and r["latest"] == int(saved[-1]), r


# ------------------------------------------------------------------------------------------------ metrics file


def test_metrics_file_never_keeps_a_torn_record(scenarios):
    r = _scenario(scenarios, "metrics_disk_full")
    assert r["exit"] == 2 and not r["traceback"] and len(r["errors"]) == 1, r["tail"]
    error = r["errors"][0]
    for needle in (f"--tensorboard-dir {Path(r['jsonl']).parent}: writing metrics.jsonl failed (wrote 40 of ",
                   "file-size limit (ulimit -f)", "the file ends at its last whole record"):
        assert needle in error, (needle, error)
    assert r["ends_with_newline"], r["lines"][-1:]
    records = [json.loads(line) for line in r["lines"]]  # every line parses: nothing torn
    assert len(records) == r["earlier_lines"] + 2 and [x["iteration"] for x in records[-2:]] == [1, 2]
