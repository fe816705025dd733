"""A checkpoint write that fails on one rank stops every rank with an error (none is left waiting in a collective).

Two processes (gloo, launched directly: no torchrun to kill the survivor) complete a save in which rank 1's writer
failed with a full disk; the finalize step is a collective that rank 1 never joins. Without the agreement in
``_PendingSave.complete`` rank 0 enters it alone: measured with gloo, it fails there with "Connection closed by
peer" once rank 1 has exited (the test fails); with NCCL it waits until the watchdog's timeout."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r'''
import os, sys
import torch.distributed as dist
from megatron_glm5.training import checkpointing as C

rank, init, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
pending = object.__new__(C._PendingSave)
pending.root, pending.iteration, pending.args = root, 5, None
pending.partial = C.iteration_dir(root, 5) + ".partial"
os.makedirs(pending.partial, exist_ok=True)
pending.errors = [OSError(28, "No space left on device")] if rank == 1 else []


class Request:
    finalize_fns = [dist.barrier]  # collective, like dist_checkpointing's metadata finalisation


pending.request = Request()
try:
    pending.complete()
    print(f"rank {rank}: no error")
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {e}")
'''


def test_write_failure_on_one_rank_stops_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    init = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), init, str(root)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            p.kill()
    assert "rank 0: CheckpointWriteError: --save" in outs[0] and "failed on rank(s) 1" in outs[0], outs
    assert "rank 1: CheckpointWriteError" in outs[1] and "No space left on device" in outs[1], outs
    assert not (root / "iter_0000005.partial").exists() and not (root / "iter_0000005").exists()
