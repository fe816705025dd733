"""Fault-injection harness for checkpointing: kill training at random moments, resume, compare bitwise.

    python tests/faults/harness.py trials --trials 20 --seed 7 --jobs 2      # randomised SIGKILL trials
    python tests/faults/harness.py scenarios                                 # corruption, disk full, ...

One parent process imports the training code once (~5 s) and ``os.fork()``s every training run; a child calls
the entry point's ``main("finetune", argv)`` in-process with its output in a log file, so a run costs its
training only. A trial: the parent runs training, SIGKILLs it (after a random iteration plus a random delay,
or at a named point of a checkpoint save through ``training/fault_hooks.py``'s save points, including a kill timed
into the middle of writing the checkpoint's data file), resumes it with ``--load``, maybe kills it again, and
finally lets it finish. Checks per trial (against one uninterrupted reference run):

* every run's logged lm-loss and grad-norm equal the reference's bitwise, iteration by iteration;
* a resumed run starts at or after the last checkpoint that was reported complete before the kill (nothing is
  lost beyond it), and exactly where the kill point says (a save killed before its rename is not used, one
  killed after it is);
* the final run reaches the last iteration, its checkpoint is the newest, and no ``.partial`` is left.

Each trial's seed is printed (and stored in the JSON report); ``--only-seed S`` reruns one trial.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_ITERS = 8
SAVE_INTERVAL = 2
# a small, fast run: 48 chat samples, 64-token rows, 2 rows a step, no evaluation, no loader workers
BASE_FLAGS = ["--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL), "--log-interval", "1",
              "--eval-iters", "0", "--num-workers", "0", "--seq-length", "64", "--micro-batch-size", "2",
              "--global-batch-size", "2"]
SAVE_POINTS = ("mid-write", "files-written", "manifest-written", "renamed", "pointer-updated")
PROMOTED_AT = {"renamed", "pointer-updated"}  # a save killed at these points is complete on disk
SAVED = re.compile(r"saved checkpoint \S*iter_(\d+)")
RESUMED = re.compile(r"resumed from \S+ at iteration (\d+)")


# what a run imports lazily (model, MTP, MoE, checkpoint strategies, tokenizer, torch._dynamo for the optimizer's
# @_disable_dynamo): imported here once instead of in every forked run (~1 s of each run's ~2.5 s)
RUN_IMPORTS = ("torch._dynamo", "transformers", "tokenizers", "jinja2", "megatron.core.models.gpt.gpt_model",
               "megatron.core.models.mimo", "megatron.core.transformer.multi_latent_attention",
               "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.multi_token_prediction",
               "megatron.core.dist_checkpointing.strategies.fully_parallel",
               "megatron.core.dist_checkpointing.strategies.filesystem_async")


def _import_training():
    """Import the training code once; every forked run inherits it. (Running a warm-up step here to share
    torch.compile's kernels would need this process's gloo group in the children: they hang or crash.)"""
    import importlib

    from megatron_glm5.training import checkpointing, fault_hooks, loop  # noqa: F401
    from megatron_glm5.training.entry import main

    for name in RUN_IMPORTS:
        importlib.import_module(name)
    return main


def small_data(workdir: Path) -> Path:
    from megatron_glm5.data import TINY_CHAT_TRAIN

    lines = [ln for ln in Path(TINY_CHAT_TRAIN).read_text(encoding="utf-8").splitlines() if ln.strip()][:48]
    path = workdir / "chat48.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ one run


def install_save_hook(hook) -> None:
    """Have ``hook(point, iteration)`` called at each point of this process's checkpoint saves (None: no hook)."""
    from megatron_glm5.training import fault_hooks

    class SaveHook(fault_hooks.FaultHooks):
        def save_point(self, point, iteration):
            hook(point, iteration)

    fault_hooks.install(SaveHook() if hook is not None else None)


class Run:
    """A training run in a forked child. ``hook(point, iteration)`` runs in the child at each checkpoint step."""

    def __init__(self, main, argv, log: Path, hook=None):
        self.log = log
        self.pid = os.fork()
        if self.pid == 0:  # the child
            code = 1
            try:
                fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                import faulthandler
                faulthandler.enable()
                for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit (scenarios) fails writes instead
                install_save_hook(hook)
                code = main("finetune", list(map(str, argv)))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code or 0)
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 300):
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                self.kill()
                raise TimeoutError(f"run (log {self.log}) did not finish in {timeout:.0f} s")
            time.sleep(0.01)
        return self.returncode

    def kill(self, sig=signal.SIGKILL):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            while self.poll() is None:
                time.sleep(0.005)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def metrics(tb_dir: Path) -> dict:
    """{iteration: (lm-loss, grad-norm)} from a run's metrics.jsonl (a line cut by a kill is ignored)."""
    out = {}
    path = tb_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "lm-loss" in rec:
            out[rec["iteration"]] = (rec["lm-loss"], rec.get("grad-norm"))
    return out


def last_logged_iteration(tb_dir: Path) -> int:
    m = metrics(tb_dir)
    return max(m) if m else 0


def kill_self(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def make_hook(point: str, iteration: int, delay_s: float = 0.0, action=kill_self):
    """A save hook that runs ``action(point)`` at ``point`` of the first save at or after ``iteration``. "mid-write"
    fires at the "writing" point, and a timer thread kills the process ``delay_s`` later, while the data file is
    being written."""
    def hook(name, it):
        if it < iteration:
            return
        if point == "mid-write" and name == "writing":
            threading.Timer(delay_s, kill_self).start()
        elif name == point:
            action(name)
    return hook


# ------------------------------------------------------------------------------------------------ trials


def reference(main, workdir: Path, data: Path, extra=()) -> dict:
    """The uninterrupted run's {iteration: (lm-loss, grad-norm)}."""
    ref = workdir / "reference"
    run = Run(main, BASE_FLAGS + ["--data-path", data, "--valid-data-path", data, "--save", ref / "ckpt",
                                  "--tensorboard-dir", ref / "tb",
                                  *extra], workdir / "reference.log")
    code = run.wait()
    if code != 0:
        raise RuntimeError(f"reference run failed (exit {code}):\n{run.text()[-3000:]}")
    m = metrics(ref / "tb")
    if sorted(m) != list(range(1, TRAIN_ITERS + 1)):
        raise RuntimeError(f"reference run logged iterations {sorted(m)}")
    return m


def plan_trial(seed: int) -> dict:
    rng = random.Random(seed)
    kills = []
    for _ in range(rng.choice((1, 1, 2))):
        if rng.random() < 0.5:
            kills.append({"kind": "step", "after_iteration": rng.randint(1, TRAIN_ITERS - 1),
                          "delay_s": round(rng.uniform(0.0, 0.3), 3)})
        else:
            kills.append({"kind": "save", "point": rng.choice(SAVE_POINTS),
                          "iteration": rng.choice(range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL)),
                          "delay_s": round(rng.uniform(0.0, 0.02), 4)})
    return {"seed": seed, "async_save": rng.random() < 0.3, "kills": kills}


def run_trial(main, plan: dict, workdir: Path, data: Path, ref: dict) -> dict:
    """Run one planned trial; returns {"seed", "plan", "attempts", "failures"} (no failures: passed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    save = workdir / "ckpt"
    extra = ["--async-save"] if plan["async_save"] else []
    failures, attempts = [], []
    completed = 0  # the newest checkpoint any run reported complete ("saved checkpoint ...")
    kills = list(plan["kills"])
    for attempt in range(len(kills) + 1):
        tb = workdir / f"tb{attempt}"
        resume = any(p.is_dir() and re.fullmatch(r"iter_\d+", p.name) for p in save.glob("iter_*"))
        argv = BASE_FLAGS + ["--data-path", data, "--valid-data-path", data, "--save", save, "--tensorboard-dir", tb,
                             *extra]
        if resume:
            argv += ["--load", save]
        kill = kills[attempt] if attempt < len(kills) else None
        hook = make_hook(kill["point"], kill["iteration"], kill["delay_s"]) if kill and kill["kind"] == "save" else None
        run = Run(main, argv, workdir / f"run{attempt}.log", hook=hook)
        if kill and kill["kind"] == "step":
            deadline = time.time() + 300
            while run.poll() is None and last_logged_iteration(tb) < kill["after_iteration"] and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(kill["delay_s"])
            run.kill()
        code = run.wait()
        text = run.text()
        started = int(RESUMED.search(text).group(1)) if RESUMED.search(text) else 0
        saved = [int(x) for x in SAVED.findall(text)]
        logged = metrics(tb)
        record = {"attempt": attempt, "kill": kill, "exit": code, "resumed_at": started,
                  "saved": saved, "logged": sorted(logged)}
        attempts.append(record)
        where = f"attempt {attempt} (kill {kill}, log {run.log})"
        if kill is None and code != 0:
            failures.append(f"{where}: exit {code}: {text[-1500:]}")
        if kill is not None and code == 0:
            record["note"] = "finished before the kill"
        if "Traceback" in text and code not in (-signal.SIGKILL,):
            failures.append(f"{where}: traceback: {text[-1500:]}")
        if started < completed:
            failures.append(f"{where}: resumed at {started} but checkpoint {completed} had completed")
        if attempt and started > attempts[-2]["last_iteration"]:
            failures.append(f"{where}: resumed at {started}, beyond the previous run's last iteration")
        if attempt and attempts[-2]["kill"] and attempts[-2]["kill"]["kind"] == "save" and attempts[-2]["exit"] != 0:
            prev = attempts[-2]["kill"]
            hit = attempts[-2]["killed_save"]
            expected = hit if prev["point"] in PROMOTED_AT else hit - SAVE_INTERVAL
            if started != expected:
                failures.append(f"{where}: killed at {prev['point']} of save {prev['iteration']}: expected to "
                                f"resume at {expected}, resumed at {started}")
        if logged and min(logged) != started + 1:
            failures.append(f"{where}: first logged iteration {min(logged)} after resuming at {started}")
        for it, values in sorted(logged.items()):
            if values != ref.get(it):
                failures.append(f"{where}: iteration {it}: {values} != reference {ref.get(it)}")
                break
        record["last_iteration"] = max(logged) if logged else started
        if kill and kill["kind"] == "save":  # the save the hook fired in, and what it left behind
            record["killed_save"] = max(kill["iteration"], (started // SAVE_INTERVAL + 1) * SAVE_INTERVAL)
            record["partial_files"] = {f"{p.parent.name}/{p.name}": p.stat().st_size
                                       for p in save.glob("*.partial/*") if p.is_file()}
        completed = max([completed] + saved)
    final = attempts[-1]
    if final["exit"] == 0:
        latest = (save / "latest_checkpointed_iteration.txt").read_text().strip()
        if latest != str(TRAIN_ITERS) or final["last_iteration"] != TRAIN_ITERS:
            failures.append(f"final run: latest {latest}, last iteration {final['last_iteration']}")
        leftovers = sorted(p.name for p in save.glob("*.partial"))
        if leftovers:
            failures.append(f"final run left {leftovers}")
    return {"seed": plan["seed"], "plan": plan, "attempts": attempts, "failures": failures}


def _trial_in_child(main, plan, workdir, data, ref, out: Path) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            result = run_trial(main, plan, workdir, data, ref)
        except BaseException:
            result = {"seed": plan["seed"], "plan": plan, "attempts": [], "failures": [traceback.format_exc()]}
            code = 1
        out.write_text(json.dumps(result))
        os._exit(code)
    return pid


def trials(n: int, seed: int, jobs: int, workdir: Path, only_seed=None) -> dict:
    t0 = time.time()
    main = _import_training()
    data = small_data(workdir)
    t_warm = time.time() - t0
    t0 = time.time()
    ref = reference(main, workdir, data)
    t_ref = time.time() - t0
    master = random.Random(seed)
    seeds = [only_seed] if only_seed is not None else [master.randrange(1 << 30) for _ in range(n)]
    print(f"harness: {len(seeds)} trials, master seed {seed}; trial seeds {seeds}", flush=True)
    results, running = [], {}
    queue_ = list(seeds)
    while queue_ or running:
        while queue_ and len(running) < jobs:
            s = queue_.pop(0)
            out = workdir / f"trial_{s}.json"
            running[_trial_in_child(main, plan_trial(s), workdir / f"trial_{s}", data, ref, out)] = (s, out)
        pid, _ = os.wait()
        if pid in running:
            s, out = running.pop(pid)
            result = json.loads(out.read_text()) if out.exists() else {"seed": s, "failures": ["no result"]}
            status = "ok" if not result["failures"] else "FAILED"
            print(f"trial seed {s}: {status} plan {json.dumps(result.get('plan'))}", flush=True)
            for f in result["failures"]:
                print(f"  {f}", flush=True)
            results.append(result)
    return {"master_seed": seed, "warmup_s": round(t_warm, 2), "reference_s": round(t_ref, 2), "total_s": round(time.time() - t0, 2),
            "reference": {str(k): v for k, v in ref.items()}, "trials": results}


# ------------------------------------------------------------------------------------------------ entry


def main_cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trials", help="randomised SIGKILL + resume trials")
    t.add_argument("--trials", type=int, default=20)
    t.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    t.add_argument("--only-seed", type=int, default=None, help="rerun the one trial with this trial seed")
    t.add_argument("--jobs", type=int, default=2, help="trials run at once")
    s = sub.add_parser("scenarios", help="corruption, retention, disk full, async save, preemption signals")
    for q in (t, s):
        q.add_argument("--compile", action="store_true", help="keep torch.compile in the runs (slower)")
        q.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
        q.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.compile:
        # megatron-core torch.compile()s the router's expert-bias update: a compile per forked run (~1.5 s of
        # CPU, half a run's cost). All runs of a harness are compared with each other, so eager is as good.
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="glm5_faults_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.cmd == "trials":
        report = trials(args.trials, args.seed, args.jobs, workdir, args.only_seed)
        failed = [r["seed"] for r in report["trials"] if r["failures"]]
        print(f"harness: {len(report['trials']) - len(failed)}/{len(report['trials'])} trials passed in "
              f"{report['total_s']} s (master seed {args.seed}); failed seeds: {failed}", flush=True)
    else:
        from scenarios import run_scenarios  # tests/faults/scenarios.py
        report = run_scenarios(_import_training(), workdir)
        failed = [k for k, v in report.items() if v.get("error")]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if not args.workdir and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main_cli())
