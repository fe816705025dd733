"""The step watchdog (megatron_glm5/training/watchdog.py): a rank stuck in a phase names the ranks behind it."""
from __future__ import annotations

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
