"""The step watchdog (megatron_glm5/training/watchdog.py): a rank stuck in a phase names the ranks behind it."""
from __future__ import annotations

import os
import threading
import time

from megatron_glm5.training.watchdog import Watchdog, describe_laggards


class FakeStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        if k not in self.d:
            raise RuntimeError("timeout")
        return self.d[k]

    def set_timeout(self, t):
        pass


def test_stuck_rank_names_the_rank_that_stopped_beating():
    store = FakeStore()
    fired = []
    done = threading.Event()
    peer = Watchdog(60.0, rank=1, world_size=3, store=store, on_timeout=lambda m: None)
    peer.beat(4, "step")  # rank 1 reached iteration 4, then stops (SIGSTOP-like)
    peer.stop()
    me = Watchdog(0.3, rank=0, world_size=3, store=store, on_timeout=lambda m: (fired.append(m), done.set()),
                  poll_s=0.05)
    me.beat(5, "step")
    assert done.wait(5.0), "watchdog did not fire"
    me.stop()
    msg = fired[0]
    assert msg.startswith("rank 0: no progress for ") and "in step of iteration 5" in msg
    assert "rank 1 (last at iteration 4, step" in msg and "rank 2 (no heartbeat)" in msg


def test_progress_keeps_the_watchdog_quiet():
    fired = []
    w = Watchdog(0.4, rank=0, world_size=1, store=FakeStore(), on_timeout=fired.append, poll_s=0.05)
    for i in range(10):
        w.beat(i, "step")
        time.sleep(0.1)
    w.stop()
    assert fired == []


def test_describe_laggards_equal_ranks_blame_the_collective():
    now = 100.0
    beats = {0: (5, "step", 90.0), 1: (5, "step", 91.0)}
    assert "a collective itself is stuck" in describe_laggards((0, 5, "step"), beats, now)
    assert describe_laggards((0, 5, "save"), beats, now) == "rank 1 (last at iteration 5, step, 9 s ago)"


def test_a_rank_at_the_same_point_that_stopped_living_is_named():
    """Same iteration and phase as this rank (it stopped mid-step): named by its stale liveness record (another
    host) or by its process (this host), not blamed on 'a collective'."""
    now = 100.0
    beats = {0: (5, "step", 90.0), 1: (5, "step", 90.5), 2: (5, "step", 90.2)}
    alive = {1: ("elsewhere-host", 4242, 60.0), 2: ("elsewhere-host", 4343, 99.0)}
    said = describe_laggards((0, 5, "step"), beats, now, alive, stale_after=10.0)
    assert said == "rank 1 (last at iteration 5, step, 10 s ago; no sign of life for 40 s)"


def test_process_state_of_a_stopped_and_an_exited_process():
    import signal
    import socket
    import subprocess
    import sys

    from megatron_glm5.training.watchdog import process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        assert process_state(host, child.pid) is None
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while process_state(host, child.pid) != "stopped" and time.time() < deadline:
            time.sleep(0.01)
        assert process_state(host, child.pid) == "stopped"
        assert process_state("another-host", child.pid) is None  # nothing to look at from here
    finally:
        child.kill()
        child.wait()
    assert process_state(host, child.pid) == "exited"


def test_explain_names_the_lost_rank_of_a_failed_collective():
    import socket
    import subprocess
    import sys

    from megatron_glm5.training.watchdog import JobFailure, short_reason

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store = FakeStore()
    store.set("megatron_glm5/alive/1", f"{socket.gethostname()}|{gone.pid}|{time.time()}")
    w = Watchdog(60.0, rank=0, world_size=2, store=store, on_timeout=lambda m: None, poll_s=0.05)
    w.beat(7, "step")
    err = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                       "[127.0.0.1]:5123: Connection reset by peer. This is typically caused by a remote worker "
                       "hanging or bugs in the application. Check the logs")
    failure = w.explain(err)
    assert isinstance(failure, JobFailure) and failure.exit_status == 3
    assert str(failure).startswith(f"rank 0: lost rank 1 (its process {gone.pid} has exited), during step of "
                                   f"iteration 7 (Read error [127.0.0.1]:5123: Connection reset by peer); ")
    assert w.explain(ValueError("not a collective")) is None
    assert short_reason(err) == "Read error [127.0.0.1]:5123: Connection reset by peer"
    w.stop()
