"""A run owns its directory (megatron_glm5/training/run_dir.py): unit cases of the claim rules, in one process."""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

from megatron_glm5.checkpoint.format import model_description, model_fingerprint
from megatron_glm5.config import GLM5Config
from megatron_glm5.training import run_dir


def _args(tmp_path, save=None, **kw):
    cfg = kw.pop("model_config", None) or GLM5Config.from_preset("tiny")
    default = save is None
    a = argparse.Namespace(save=str(save or tmp_path / "runs" / "finetune_tiny"), save_is_default=default,
                           load=None, finetune=False, resume=False, overwrite=False, model_config=cfg,
                           mode="finetune", data_path=["d.jsonl"], tensorboard_dir=None)
    a.tensorboard_dir = os.path.join(a.save, "tensorboard")
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _fake_checkpoint(path, iteration=5):
    os.makedirs(os.path.join(path, f"iter_{iteration:07d}"), exist_ok=True)
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_default_save_gives_each_run_its_own_directory(tmp_path):
    a, b = _args(tmp_path), _args(tmp_path)
    ra = run_dir.claim(a, now=1_700_000_000.0)
    rb = run_dir.claim(b, now=1_700_000_000.0)  # same second: still two directories
    try:
        assert a.save != b.save
        assert os.path.dirname(a.save) == os.path.dirname(b.save) == str(tmp_path / "runs" / "finetune_tiny")
        assert a.tensorboard_dir == os.path.join(a.save, "tensorboard")
        assert ra.run_id != rb.run_id
        assert run_dir.read_run(a.save)["run_id"] == ra.run_id
    finally:
        ra.release()
        rb.release()


def test_fresh_run_into_a_used_save_is_refused_and_overwrite_replaces(tmp_path):
    save = tmp_path / "mine"
    first = run_dir.claim(_args(tmp_path, save))
    first.release()
    _fake_checkpoint(save, 300)
    with pytest.raises(run_dir.RunDirectoryError) as e:
        run_dir.claim(_args(tmp_path, save))
    msg = str(e.value)
    assert f"--save {save} already holds run {first.run_id}" in msg and "iteration 300" in msg
    assert "--overwrite" in msg and f"--load {save}" in msg
    assert (save / "iter_0000300").is_dir()  # nothing touched by the refusal
    again = run_dir.claim(_args(tmp_path, save, overwrite=True))
    try:
        assert not (save / "iter_0000300").exists() and not (save / "latest_checkpointed_iteration.txt").exists()
        assert again.run_id != first.run_id
    finally:
        again.release()


def test_resume_continues_the_same_run_and_refuses_another_model(tmp_path):
    save = tmp_path / "mine"
    first = run_dir.claim(_args(tmp_path, save))
    first.release()
    _fake_checkpoint(save)
    cont = run_dir.claim(_args(tmp_path, save, load=str(save)))
    cont.release()
    assert cont.run_id == first.run_id
    cont = run_dir.claim(_args(tmp_path, save, load=str(save / "iter_0000005")))  # an iteration dir of the run
    cont.release()
    assert cont.run_id == first.run_id
    other = GLM5Config.from_preset("tiny").replace(rope_theta=1234.0)
    with pytest.raises(run_dir.RunDirectoryError, match=r"another model \(rope_theta: .* -> 1234.0\)"):
        run_dir.claim(_args(tmp_path, save, load=str(save), model_config=other))
    # weights-only loading from the run (--finetune) is a new run: refused in the same directory
    with pytest.raises(run_dir.RunDirectoryError, match="already holds"):
        run_dir.claim(_args(tmp_path, save, load=str(save), finetune=True))


def test_resume_without_save_takes_the_newest_run(tmp_path):
    a = _args(tmp_path)
    ra = run_dir.claim(a, now=1_700_000_000.0)
    ra.release()
    b = _args(tmp_path)
    rb = run_dir.claim(b, now=1_700_000_100.0)
    rb.release()
    r = _args(tmp_path, resume=True)
    rr = run_dir.claim(r)
    rr.release()
    assert r.save == b.save and r.load == b.save and rr.run_id == rb.run_id
    with pytest.raises(run_dir.RunDirectoryError, match="no earlier run"):
        run_dir.claim(_args(tmp_path / "empty", resume=True))


def test_a_live_lock_refuses_and_a_dead_one_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "LOCK_GRACE_S", 0.3)
    save = tmp_path / "shared"
    os.makedirs(save)
    holder = os.open(save / run_dir.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    os.write(holder, b"pid 42 on host elsewhere since then")
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(run_dir.RunDirectoryError, match="another run is using this directory .pid 42"):
            run_dir.claim(_args(tmp_path, save))
    finally:
        os.close(holder)
    # a process that held the lock and died: the OS released it, the file stays
    code = (f"import fcntl, os; fd = os.open({str(save / run_dir.LOCK_FILE)!r}, os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    taken = run_dir.claim(_args(tmp_path, save))
    try:
        assert (save / run_dir.LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    finally:
        taken.release()


def test_fingerprint_covers_function_fields_only():
    base = GLM5Config.from_preset("tiny")
    fp = model_fingerprint(base)
    for change in ({"n_group": 2, "topk_group": 1}, {"num_experts_per_tok": 3}, {"routed_scaling_factor": 1.0},
                   {"rope_theta": 5.0}, {"rms_norm_eps": 1e-3}):
        assert model_fingerprint(base.replace(**change)) != fp, change
    assert model_fingerprint(base.replace(eos_token_id=[7], initializer_range=0.5)) == fp
    record = json.loads(json.dumps(model_description(base)))  # JSON-ready
    assert record == model_description(base)


def test_a_run_that_saved_nothing_is_restarted_by_the_same_model_only(tmp_path):
    save = tmp_path / "requeued"
    first = run_dir.claim(_args(tmp_path, save))
    first.release()  # killed before its first checkpoint: only run.json (and events) are there
    again = run_dir.claim(_args(tmp_path, save))
    again.release()
    assert again.run_id == first.run_id
    other = GLM5Config.from_preset("tiny").replace(rms_norm_eps=1e-3)
    with pytest.raises(run_dir.RunDirectoryError, match="already holds"):
        run_dir.claim(_args(tmp_path, save, model_config=other))


def test_a_refused_start_leaves_nothing_behind(tmp_path):
    save = tmp_path / "never"
    with pytest.raises(run_dir.RunDirectoryError, match="holds no run to resume"):
        run_dir.claim(_args(tmp_path, save, resume=True))
    assert not save.exists()


def test_a_lock_held_for_a_moment_is_waited_for(tmp_path, monkeypatch):
    """A run that starts while another holds the lock only to decide (and refuse) waits for it (LOCK_GRACE_S) and
    takes its own decision, instead of reporting the other's moment as 'another run is using this directory'."""
    monkeypatch.setattr(run_dir, "LOCK_GRACE_S", 10.0)
    save = tmp_path / "shared"
    os.makedirs(save)
    code = (f"import fcntl, os, time; fd = os.open({str(save / run_dir.LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.0)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        taken = run_dir.claim(_args(tmp_path, save))
        waited = time.monotonic() - start
    finally:
        holder.wait()
    taken.release()
    assert 0.3 < waited < 9.0, waited
