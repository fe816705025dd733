"""One rank of a 2-process torchrun training killed (SIGKILL) or stopped (SIGSTOP): launch, find the ranks, act.

    job = TorchrunJob(workdir, ["--distributed-timeout-minutes", "0.3"])   # tiny finetune, DP2, gloo
    job.wait_for(lambda: job.saved() >= [2])                                # "saved checkpoint" lines so far
    os.kill(job.rank_pids()[1], signal.SIGKILL)
    code = job.wait(timeout=60); text = job.output()

The ranks are torchrun's child processes, told apart by ``RANK`` in their environment (/proc). ``cleanup()``
kills whatever is left (a stopped rank included), so nothing outlives the test.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

REPO = Path(__file__).resolve().parents[2]
SAVED = re.compile(r"^\S+ INFO saved checkpoint \S*iter_(\d+)$", re.M)  # rank 0's lines (others say [rank N])
FLAGS = ["--train-iters", "60", "--save-interval", "1", "--log-interval", "1", "--eval-iters", "0",
         "--num-workers", "0", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"]


def _children(pid: int) -> Dict[int, int]:
    """{rank: pid} of the processes whose parent is ``pid`` and whose environment has RANK."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for var in env:
            if var.startswith(b"RANK="):
                ranks[int(var[5:])] = int(entry)
    return ranks


class TorchrunJob:
    def __init__(self, workdir: Path, extra=(), nproc: int = 2):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.save = self.workdir / "ckpt"
        self.log = self.workdir / "torchrun.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   TORCHDYNAMO_DISABLE="1")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "MEGATRON_GLM5_TRACEBACK", "TORCHELASTIC_ERROR_FILE"):
            env.pop(var, None)
        self._out = open(self.log, "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(REPO / "finetune_glm5.py"), *FLAGS, "--save", str(self.save), *map(str, extra)]
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir),
                                     start_new_session=True)
        self._ranks: Dict[int, int] = {}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def saved(self) -> List[int]:
        return [int(x) for x in SAVED.findall(self.output())]

    def rank_pids(self) -> Dict[int, int]:
        if not self._ranks:
            self._ranks = _children(self.proc.pid)
        return self._ranks

    def wait_for(self, condition: Callable[[], bool], timeout: float = 300, poll: float = 0.005) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return True
            if self.proc.poll() is not None:
                return condition()
            time.sleep(poll)
        return False

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def ours(self, pid: int) -> bool:
        """Still one of this job's processes (torchrun leads its own session; its ranks inherit it)."""
        try:
            return os.getsid(pid) == self.proc.pid
        except OSError:
            return False

    def cleanup(self) -> None:
        for pid in list(self._ranks.values()):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                if self.ours(pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._out.close()
