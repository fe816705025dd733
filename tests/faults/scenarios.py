"""Fixed fault scenarios run by ``harness.py scenarios`` (forked runs, as the trials): each returns what it
observed (exit codes, log lines, directory listings, losses) for tests/faults/test_fault_tolerance.py to judge.

corrupt_*      a damaged newest checkpoint (truncated file, flipped byte, no manifest, missing file) -> resume
               from the previous one with a warning; every checkpoint damaged -> one error line
keep_last      --keep-last 1 while the newest checkpoint is damaged right after its save -> the older good one
               stays; the next good save removes both
disk_full_*    a real file-size limit (RLIMIT_FSIZE set as the save starts writing, SIGXFSZ ignored: writes fail
               with EFBIG) during a save,
               synchronous and --async-save -> one error line naming the directory, previous checkpoint intact
async_equal    --async-save whose writer starts only after training changed the parameters -> the checkpoint
               holds the same tensors as a synchronous save of that iteration
signal_*       SIGTERM (default) and SIGUSR1 (--exit-signal SIGUSR1, with --async-save) to a running training
               -> it finishes the step, saves, exits 0; the resumed run matches the uninterrupted one; SIGINT
               (Ctrl-C) with the default --exit-signal does the same
sigint_twice   two Ctrl-C in a row -> the second stops at once: exit 130, one line, nothing half-promoted
metrics_disk_full  a file-size limit reached in the middle of a metrics.jsonl record -> the record is cut back,
               one error line, every line of the file parses
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import time
import traceback
from pathlib import Path

from harness import BASE_FLAGS, SAVE_INTERVAL, TRAIN_ITERS, Run, last_logged_iteration, metrics, small_data

MIB = 1 << 20


RUN_FILES = ("run.json", "run.lock")  # the run directory's own record and lock (training/run_dir.py)


def _dirs(save: Path) -> list:
    """What a save directory holds besides the run's own record and lock: checkpoints and the pointer."""
    return sorted(p.name for p in save.iterdir() if p.name not in RUN_FILES) if save.exists() else []


def _latest(save: Path):
    p = save / "latest_checkpointed_iteration.txt"
    return int(p.read_text()) if p.exists() else None


def _lines(text: str, *needles) -> list:
    return [ln for ln in text.splitlines() if all(n in ln for n in needles)]


def _error_lines(text: str) -> list:
    """The entry point's one-line user errors."""
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _warnings(text: str) -> list:
    return [ln for ln in text.splitlines() if " WARNING " in ln]


def _data_file(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


def _flip_byte(path: Path, offset: int = None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


class Scenarios:
    def __init__(self, main, workdir: Path):
        self.main, self.workdir = main, workdir
        self.data = small_data(workdir)
        self.n = 0

    def run(self, save: Path, extra=(), load=True, hook=None):
        """A forked training run to completion: (exit code, log text, {iteration: (lm-loss, grad-norm)})."""
        self.n += 1
        tb = self.workdir / f"tb{self.n}"
        argv = BASE_FLAGS + ["--data-path", self.data, "--valid-data-path", self.data, "--save", save,
                             "--tensorboard-dir", tb, *extra]
        if load:
            argv += ["--load", save]
        run = Run(self.main, argv, self.workdir / f"run{self.n}.log", hook=hook)
        code = run.wait()
        return code, run.text(), metrics(tb)

    # -------------------------------------------------------------------------------------------- scenarios

    def base(self):
        """The uninterrupted run (checkpoints at 2, 4, 6, 8): the reference for the others."""
        self.base_dir = self.workdir / "base"
        code, text, ref = self.run(self.base_dir, load=False)
        assert code == 0, text[-3000:]
        self.ref = ref
        return {"exit": code, "dirs": _dirs(self.base_dir), "logged": sorted(ref)}

    def _copy(self, name) -> Path:
        dst = self.workdir / name
        shutil.copytree(self.base_dir, dst, ignore=shutil.ignore_patterns("tensorboard"))
        return dst

    def corrupt(self, name, damage, extra=()):
        save = self._copy(name)
        damage(save)
        code, text, logged = self.run(save, extra=extra)
        return {"exit": code, "warnings": _warnings(text), "error": None, "errors": _error_lines(text),
                "resumed": _lines(text, "resumed from"), "logged": {str(k): v for k, v in logged.items()},
                "reference": {str(k): v for k, v in self.ref.items()}, "dirs": _dirs(save), "tail": text[-2000:]}

    def keep_last(self):
        save = self.workdir / "keep"

        def damage_newest(point, it):  # right after save 4 is complete, before retention looks at it
            if point == "pointer-updated" and it == 4:
                _flip_byte(_data_file(save / "iter_0000004"))

        code1, text1, _ = self.run(save, extra=["--keep-last", "1", "--exit-interval", "4"], load=False,
                                   hook=damage_newest)
        after_damage = _dirs(save)
        code2, text2, logged = self.run(save, extra=["--keep-last", "1"])
        return {"exit": [code1, code2], "dirs_after_damage": after_damage, "dirs_final": _dirs(save),
                "warnings": _warnings(text1) + _warnings(text2), "resumed": _lines(text2, "resumed from"),
                "logged": {str(k): v for k, v in logged.items()},
                "reference": {str(k): v for k, v in self.ref.items()}, "error": None}

    def disk_full(self, name, extra=()):
        """The file-size limit is set (in the training process) when the save of iteration 4 starts writing:
        earlier, torch.compile's compiler writes files larger than the limit."""
        save = self.workdir / name
        limit = 1 * MIB

        def limit_file_size(point, it):
            if point == "writing" and it == 4:  # (Run ignores SIGXFSZ: writes beyond the limit fail with EFBIG)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

        code1, text1, _ = self.run(save, extra=[*extra, "--exit-interval", "2"], load=False)
        size = os.path.getsize(_data_file(save / "iter_0000002"))
        code2, text2, _ = self.run(save, extra=[*extra, "--exit-interval", "4"], hook=limit_file_size)
        seen = {"dirs": _dirs(save), "latest": _latest(save)}
        code3, text3, logged = self.run(save, extra=extra)
        return {"exit": [code1, code2, code3], "data_file_bytes": size, "fsize_limit": limit,
                "errors": _error_lines(text2), "traceback": "Traceback" in text2, "after_failure": seen,
                "resumed": _lines(text3, "resumed from"), "logged": {str(k): v for k, v in logged.items()},
                "reference": {str(k): v for k, v in self.ref.items()}, "dirs_final": _dirs(save), "error": None,
                "save_dir": str(save), "tail": text2[-2000:]}

    def async_equal(self):
        save = self.workdir / "async"
        order = []

        def slow_writer(point, it):  # the writer thread starts writing after training moved on
            if point == "writing" and it == 2:
                time.sleep(1.0)

        code, text, logged = self.run(save, extra=["--async-save"], load=False, hook=slow_writer)
        for ln in text.splitlines():
            if "iter 3/" in ln:
                order.append("iter 3")
            elif "saved checkpoint" in ln and "iter_0000002" in ln:
                order.append("saved 2")
            elif "in the background" in ln and "iter_0000002" in ln:
                order.append("background 2")
        a = _tensors(save / "iter_0000002", self.workdir / "async2.pt")
        b = _tensors(self.base_dir / "iter_0000002", self.workdir / "sync2.pt")
        differing = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not _same(a[k], b[k]))
        return {"exit": code, "order": order, "tensors": len(a), "differing": differing,
                "logged": {str(k): v for k, v in logged.items()},
                "reference": {str(k): v for k, v in self.ref.items()}, "error": None}

    def preempt(self, name, sig, extra=()):
        save = self.workdir / name
        tb = self.workdir / f"{name}_tb"
        argv = BASE_FLAGS + ["--data-path", self.data, "--valid-data-path", self.data, "--save", save,
                             "--tensorboard-dir", tb, *extra]
        run = Run(self.main, argv, self.workdir / f"{name}.log")
        deadline = time.time() + 300
        while run.poll() is None and last_logged_iteration(tb) < 3 and time.time() < deadline:
            time.sleep(0.005)
        run.kill(sig)
        code = run.wait()
        text = run.text()
        first = metrics(tb)
        code2, text2, logged = self.run(save, extra=extra)
        return {"exit": [code, code2], "received": _lines(text, "received"), "exiting": _lines(text, "exiting at"),
                "latest_after_signal": int(_lines(text, "exiting at")[0].split()[-1]) if _lines(text, "exiting at") else None,
                "saved": _lines(text, "saved checkpoint"), "first": {str(k): v for k, v in first.items()},
                "resumed": _lines(text2, "resumed from"), "logged": {str(k): v for k, v in logged.items()},
                "reference": {str(k): v for k, v in self.ref.items()}, "partials": sorted(p.name for p in save.glob("*.partial")),
                "error": None}

    def sigint_twice(self):
        """Ctrl-C twice in a row: the second stops at once (exit 130, one line), the unfinished step is not saved."""
        save = self.workdir / "sigint2"
        tb = self.workdir / "sigint2_tb"
        argv = BASE_FLAGS + ["--data-path", self.data, "--valid-data-path", self.data, "--save", save,
                             "--tensorboard-dir", tb]
        # Python runs a signal handler between bytecodes: two signals that arrive while a torch op runs become one.
        # So the second Ctrl-C is sent once the first has been handled (its line is logged), and each save is
        # held 0.5 s after writing its files, so the run cannot have finished in between.
        run = Run(self.main, argv, self.workdir / "sigint2.log",
                  hook=lambda point, iteration: time.sleep(0.5) if point == "files-written" else None)
        deadline = time.time() + 300
        while run.poll() is None and last_logged_iteration(tb) < 3 and time.time() < deadline:
            time.sleep(0.005)
        run.kill(signal.SIGINT)
        while run.poll() is None and "received SIGINT" not in run.text() and time.time() < deadline:
            time.sleep(0.002)
        run.kill(signal.SIGINT)
        code = run.wait()
        text = run.text()
        return {"exit": code, "errors": _error_lines(text), "received": _lines(text, "received SIGINT"),
                "traceback": "Traceback" in text, "saved": _lines(text, "saved checkpoint"), "latest": _latest(save),
                "complete": sorted(p.name for p in save.glob("iter_*") if not p.name.endswith(".partial")),
                "error": None, "tail": text[-2000:]}

    def metrics_disk_full(self):
        """A file-size limit that metrics.jsonl reaches in the middle of a record (set after save 2, 40 bytes
        beyond the file's size): the record is not left half-written, the run stops with one line, and the file
        parses line by line. The file starts with 64 KiB of earlier records, so that it is the largest file the
        run writes until the next save (the run's own log must stay below the limit)."""
        save = self.workdir / "mfull"
        tb = self.workdir / "mfull_tb"
        jsonl = tb / "metrics.jsonl"
        tb.mkdir(parents=True)
        earlier = "".join(f'{{"iteration": 0, "earlier": {i}, "pad": "{"x" * 100}"}}\n' for i in range(560))
        jsonl.write_text(earlier)

        def limit_after_save(point, it):
            if point == "pointer-updated" and it == 2:
                resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(jsonl) + 40, resource.RLIM_INFINITY))

        argv = BASE_FLAGS + ["--data-path", self.data, "--valid-data-path", self.data, "--save", save,
                             "--tensorboard-dir", tb]
        run = Run(self.main, argv, self.workdir / "mfull.log", hook=limit_after_save)
        code = run.wait()
        text = run.text()
        raw = jsonl.read_bytes()
        return {"exit": code, "errors": _error_lines(text), "traceback": "Traceback" in text,
                "earlier_lines": earlier.count("\n"), "ends_with_newline": raw.endswith(b"\n"),
                "lines": raw.decode().splitlines(), "jsonl": str(jsonl), "error": None, "tail": text[-2000:]}


def _tensors(ckpt: Path, out: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (read with torch.distributed.checkpoint, no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(str(out), weights_only=False)
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
    walk("", state)
    return flat


def _same(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def run_scenarios(main, workdir: Path) -> dict:
    s = Scenarios(main, workdir)
    report = {}

    def record(name, fn, *a, **kw):
        t0 = time.time()
        try:
            report[name] = fn(*a, **kw)
        except BaseException:
            report[name] = {"error": traceback.format_exc()}
        report[name]["seconds"] = round(time.time() - t0, 2)
        print(f"scenario {name}: {'error' if report[name].get('error') else 'ran'} ({report[name]['seconds']} s)",
              flush=True)

    record("base", s.base)
    if report["base"].get("error"):
        return report
    newest = f"iter_{TRAIN_ITERS:07d}"
    record("corrupt_truncated", s.corrupt, "c_trunc", lambda d: _truncate(_data_file(d / newest)))
    record("corrupt_flipped", s.corrupt, "c_flip", lambda d: _flip_byte(_data_file(d / newest)))
    record("corrupt_no_manifest", s.corrupt, "c_nomani", lambda d: (d / newest / "manifest.json").unlink())
    record("corrupt_missing_file", s.corrupt, "c_missing", lambda d: (d / newest / ".metadata").unlink())

    def damage_all(d):
        for it in range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL):
            _truncate(_data_file(d / f"iter_{it:07d}"))
    record("corrupt_all", s.corrupt, "c_all", damage_all)
    record("keep_last", s.keep_last)
    record("disk_full_sync", s.disk_full, "full_sync")
    record("disk_full_async", s.disk_full, "full_async", ["--async-save"])
    record("async_equal", s.async_equal)
    record("signal_sigterm", s.preempt, "sigterm", signal.SIGTERM)
    record("signal_sigusr1", s.preempt, "sigusr1", signal.SIGUSR1, ["--exit-signal", "SIGUSR1", "--async-save"])
    record("signal_sigint", s.preempt, "sigint", signal.SIGINT)  # Ctrl-C with the default --exit-signal SIGTERM
    record("sigint_twice", s.sigint_twice)
    record("metrics_disk_full", s.metrics_disk_full)
    return report
