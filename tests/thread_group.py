"""Threads as tensor-parallel ranks for the vocabulary-parallel cross-entropy tests (a process group under gloo
costs two interpreter starts, ~10 s of CPU; the math under test is the same)."""
from __future__ import annotations

import threading

import torch


class ThreadGroup:
    """``world`` threads as ranks: all_reduce (SUM / MAX) through a barrier, in place; ``local.rank`` is the
    calling thread's rank (each thread sets it first)."""

    def __init__(self, world):
        self.world, self.local, self.barrier = world, threading.local(), threading.Barrier(world)
        self.slots = [None] * world

    def all_reduce(self, t, op=None, group=None):
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        red = stacked.amax(0) if op == torch.distributed.ReduceOp.MAX else stacked.sum(0)
        self.barrier.wait()
        t.copy_(red)
