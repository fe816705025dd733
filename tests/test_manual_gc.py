"""--manual-gc (megatron_glm5/training/manual_gc.py): the collector's calls the training loop makes, against a
recording stand-in for Python's gc module; the flag's range check. (A training run with it: the resumed runs of
tests/test_training_cpu.py, whose results must equal the uninterrupted run's bitwise.)"""
import pytest

from megatron_glm5.arguments import build_parser, validate_args
from megatron_glm5.errors import FlagError
from megatron_glm5.training.manual_gc import ManualGC


class Recorder:
    def __init__(self, enabled=True):
        self.calls, self.enabled = [], enabled

    def isenabled(self):
        return self.enabled

    def __getattr__(self, name):  # collect, freeze, unfreeze, disable, enable
        def call():
            self.calls.append(name)
            if name in ("disable", "enable"):
                self.enabled = name == "enable"
        return call


def test_the_loop_collects_after_every_nth_step_and_before_sync_points_only():
    rec = Recorder()
    policy = ManualGC(True, 3, collector=rec)
    policy.start()
    assert rec.calls == ["collect", "freeze", "disable"] and not rec.enabled
    rec.calls.clear()
    for it in range(1, 8):
        policy.after_step(it)
    assert rec.calls == ["collect", "collect"]  # after iterations 3 and 6
    policy.before_sync_point()
    policy.stop()
    assert rec.calls == ["collect", "collect", "collect", "unfreeze", "enable"] and rec.enabled


def test_without_the_flag_nothing_is_touched_and_interval_zero_collects_only_at_sync_points():
    rec = Recorder()
    off = ManualGC(False, 3, collector=rec)
    off.start(), off.after_step(3), off.before_sync_point(), off.stop()
    assert rec.calls == []
    rec = Recorder(enabled=False)  # a collector the caller had switched off stays off
    zero = ManualGC(True, 0, collector=rec)
    zero.start()
    for it in range(1, 5):
        zero.after_step(it)
    zero.before_sync_point()
    zero.stop()
    assert rec.calls == ["collect", "freeze", "disable", "collect", "unfreeze"] and not rec.enabled


def test_negative_interval_is_a_flag_error():
    args = build_parser().parse_args(["--manual-gc", "--manual-gc-interval", "-1"])
    with pytest.raises(FlagError, match="--manual-gc-interval -1 must be >= 0") as e:
        validate_args(args, world_size=1)
    assert e.value.flag == "--manual-gc-interval"
