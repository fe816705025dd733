"""A run owns its directory: one run per ``--save`` directory, locked while it trains, never overwritten unasked.

A run directory holds the run's checkpoints (``iter_*``, the ``latest`` pointer), its TensorBoard events and
``metrics.jsonl`` (``tensorboard/``), and two files of its own:

- ``run.json``: who the run is (a random run id, when it started, mode, the model's fingerprint and description,
  the data paths, the command line), written atomically by rank 0 when the run first starts;
- ``run.lock``: held by rank 0 with an exclusive ``flock`` while the run lives (pid, host and start time inside).
  The operating system releases a lock when its process dies, so a lock left by a killed run is stale by
  construction: the next run takes it (and says so when the file names a process that is gone).

Rules at start (:func:`claim`, collective: rank 0 decides, every rank gets the same answer or the same error):

- no ``--save``: a fresh directory per run, ``runs/<mode>_<model>/<YYYYmmdd-HHMMSS>``, printed at start;
- ``--save DIR`` that holds no run: a new run;
- ``--save DIR`` holding a run: continued when this run resumes it (``--load DIR`` or ``--resume``) with the same
  model (else refused, with the fields that differ); a fresh run there is refused, unless ``--overwrite`` (the old
  run's checkpoints, events and metrics are deleted first, and the deletion is logged);
- another live run holding the lock: refused, naming its pid, host and start time.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from typing import Any, Dict, List, Optional

from megatron_glm5.checkpoint import format as ckpt_format
from megatron_glm5.checkpoint.format import describe_difference, model_description, model_fingerprint
from megatron_glm5.errors import UserError

log = logging.getLogger("megatron_glm5.run")

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
LOCK_GRACE_S = 5.0  # how long a starting run waits for a directory's lock before naming its holder
RUN_FORMAT = 1
# what a run directory's previous run leaves, removed by --overwrite (names inside the directory)
_RUN_ARTIFACTS = (ckpt_format.LATEST, "tensorboard", RUN_FILE)


class RunDirectoryError(UserError):
    """The run directory belongs to another run (or is locked by one)."""


def default_run_root(mode: str, model_slug: str) -> str:
    return os.path.join("runs", f"{mode}_{model_slug}")


def read_run(path: str) -> Optional[Dict[str, Any]]:
    """The run.json of a directory, or None (no file, or one that is not a run record)."""
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "run_id" in record else None


def _checkpoint_names(path: str) -> List[str]:
    """Complete and partial checkpoint directories of a run directory."""
    names = [os.path.basename(p) for _, p in ckpt_format.complete_dirs(path)]
    return sorted(names + [os.path.basename(p) for p in ckpt_format.partial_dirs(path)])


def holds_run(path: str) -> bool:
    """True when ``path`` holds a run: its record, checkpoints, the latest pointer or metrics."""
    return (read_run(path) is not None or bool(_checkpoint_names(path))
            or os.path.exists(os.path.join(path, ckpt_format.LATEST))
            or os.path.exists(os.path.join(path, "tensorboard", "metrics.jsonl")))


def run_dir_of_load(load: str) -> Optional[str]:
    """The run directory a --load names: the directory itself, or the parent of an ``iter_XXXXXXX`` directory."""
    if ckpt_format.iteration_of(load) is not None:
        return os.path.dirname(os.path.normpath(load)) or "."
    return load


def newest_run(root: str) -> Optional[str]:
    """The most recently started run directory directly under ``root`` (for ``--resume`` without ``--save``)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    runs = [os.path.join(root, n) for n in names if holds_run(os.path.join(root, n))]
    if holds_run(root):  # a run written straight into the root by an older version
        runs.append(root)
    if not runs:
        return None
    return max(runs, key=lambda p: ((read_run(p) or {}).get("started_unix", 0.0), p))


def fresh_run_dir(root: str, now: Optional[float] = None) -> str:
    """Create a new directory under ``root`` named by the start time (a suffix when that name is taken, also by a
    run starting at the same moment: the directory is created exclusively) and return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    os.makedirs(root, exist_ok=True)
    n = 1
    while True:
        path = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def _load_is_inside(load: Optional[str], save: str) -> bool:
    """--load names the run directory itself or one of its iteration directories."""
    return bool(load) and os.path.realpath(run_dir_of_load(load)) == os.path.realpath(save)


class RunDirectory:
    """This run's claim on its directory: the lock (rank 0) and the run record."""

    def __init__(self, path: str, record: Dict[str, Any], lock_fd: Optional[int]):
        self.path = path
        self.record = record
        self._lock_fd = lock_fd

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    def release(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)  # a clean end leaves no holder behind (a crash leaves its line)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None


def _lock(path: str) -> int:
    """Take the directory's lock (rank 0) or raise naming the run that holds it.  A run that starts beside another
    waits up to LOCK_GRACE_S for it: a run deciding what to do with the directory (and then, say, refusing) holds the
    lock for a moment only, and this one then takes its own decision instead of reporting that moment."""
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise RunDirectoryError(
                    f"--save {path}: another run is using this directory ({holder or 'no details'}); wait for it to "
                    f"finish, or choose another --save") from None
            raise
    previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if previous:
        log.warning("run directory %s: taking over the lock of a run that ended without releasing it (%s)",
                    path, previous)
    text = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    return fd


def _write_record(path: str, record: Dict[str, Any]) -> None:
    tmp = os.path.join(path, f".{RUN_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, RUN_FILE))


def _remove_previous_run(path: str) -> None:
    removed = []
    for name in _checkpoint_names(path) + list(_RUN_ARTIFACTS):
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.remove(target)
        else:
            continue
        removed.append(name)
    if removed:
        log.warning("--overwrite: removed the previous run's %s from %s", ", ".join(removed), path)


def _summary(record: Optional[Dict[str, Any]], path: str) -> str:
    its = [it for it, _ in ckpt_format.complete_dirs(path)]
    parts = []
    if record:
        parts.append(f"run {record['run_id']} ({record.get('mode', '?')}, started {record.get('started', '?')})")
    else:
        parts.append("an earlier run")
    parts.append(f"checkpoints up to iteration {max(its)}" if its else "no complete checkpoint")
    return ", ".join(parts)


def _directory(args, now: float) -> str:
    """The run's directory: --save, a fresh one under the default root, or the newest run there for --resume."""
    if not getattr(args, "save_is_default", False):
        return args.save
    if getattr(args, "resume", False):
        found = newest_run(args.save)
        if found is None:
            raise RunDirectoryError(f"--resume: no earlier run under {args.save} to resume; start one without "
                                    "--resume, or name it with --save DIR")
        return found
    return fresh_run_dir(args.save, now)


def _decide(args, save: str) -> Dict[str, Any]:
    """Rank 0's decision, taken under the directory's lock: what to do with it. Raises RunDirectoryError."""
    resume = bool(getattr(args, "resume", False))
    continuing = resume or (_load_is_inside(args.load, save) and not getattr(args, "finetune", False))
    record = read_run(save)
    current = model_description(args.model_config)
    if holds_run(save):
        same_model = record is None or record.get("model_fingerprint") == model_fingerprint(args.model_config)
        if continuing and not same_model:
            raise RunDirectoryError(
                f"--save {save} holds run {record['run_id']} of another model "
                f"({describe_difference(record.get('model', {}), current)}); resume it with its own "
                f"--preset/--hf-config, or start this model in another --save")
        if continuing:
            return {"path": save, "action": "continue", "record": record}
        if same_model and record is not None and not ckpt_format.complete_dirs(save) \
                and not getattr(args, "overwrite", False):
            # the run died before its first checkpoint: running it again (a requeued job) restarts it
            log.warning("run %s in %s left no complete checkpoint: restarting it from iteration 0",
                        record["run_id"], save)
            return {"path": save, "action": "continue", "record": record}
        if not getattr(args, "overwrite", False):
            raise RunDirectoryError(
                f"--save {save} already holds {_summary(record, save)}; continue it with --load {save} (or "
                f"--resume), choose another --save, or pass --overwrite to replace it")
        return {"path": save, "action": "overwrite", "record": None}
    if resume:
        raise RunDirectoryError(f"--resume: {save} holds no run to resume")
    return {"path": save, "action": "new", "record": None}


def _new_record(args, now: float) -> Dict[str, Any]:
    return {
        "format": RUN_FORMAT,
        "run_id": uuid.uuid4().hex[:12],
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        "started_unix": now,
        "mode": getattr(args, "mode", None),
        "model_fingerprint": model_fingerprint(args.model_config),
        "model": model_description(args.model_config),
        "data": list(getattr(args, "data_path", None) or []),
        "command": list(sys.argv),
    }


def _broadcast(obj):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def claim(args, now: Optional[float] = None) -> Optional[RunDirectory]:
    """Claim ``args.save`` for this run (collective). Sets ``args.save`` (and a default ``args.tensorboard_dir``)
    to the run's directory. Returns None when the run saves nothing."""
    if not args.save:
        return None
    now = time.time() if now is None else now
    old_save = args.save
    decision, error, lock_fd = None, None, None
    if _is_rank0():
        path, created = None, False
        try:
            existed = os.path.isdir(args.save) and not getattr(args, "save_is_default", False)
            path = _directory(args, now)
            created = not existed and not holds_run(path)
            os.makedirs(path, exist_ok=True)
            lock_fd = _lock(path)  # decided under the lock: a run starting beside this one waits its turn
            decision = _decide(args, path)
            if decision["action"] == "overwrite":
                _remove_previous_run(path)
            record = decision["record"] or _new_record(args, now)
            if decision["record"] is None:
                _write_record(path, record)
            decision["record"] = record
        except (RunDirectoryError, OSError) as e:
            if lock_fd is not None:
                os.close(lock_fd)
            if created and path is not None:  # nothing left behind by a refused start
                shutil.rmtree(path, ignore_errors=True)
            error = e if isinstance(e, RunDirectoryError) else RunDirectoryError(f"--save {old_save}: {e}")
            decision = None
    shared = _broadcast({"decision": decision, "error": str(error) if error else None})
    if shared["error"]:
        raise error if error is not None else RunDirectoryError(shared["error"])
    decision = shared["decision"]
    args.save = decision["path"]
    if getattr(args, "tensorboard_dir", None) == os.path.join(old_save, "tensorboard"):
        args.tensorboard_dir = os.path.join(args.save, "tensorboard")
    if getattr(args, "resume", False) and not args.load:
        args.load = args.save
    verb = {"new": "new run", "overwrite": "new run (replacing the previous one)", "continue": "continuing run"}
    log.info("%s %s in %s", verb[decision["action"]], decision["record"]["run_id"], args.save)
    return RunDirectory(args.save, decision["record"], lock_fd)
