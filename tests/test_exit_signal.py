"""training/loop.py's exit signal at the end of a run: a run ending on a lost rank keeps SIGTERM / SIGINT recorded
(torchrun stops the surviving ranks with SIGTERM as soon as the lost one exits; the default action would end the
survivor before arguments.main_guard prints the line naming the lost rank -- seen once in CI on a loaded 2-core
machine), while any other end puts the previous handlers back."""
import os
import signal

from megatron_glm5.training import loop


def _marker(signum, frame):  # a recognisable "previous" handler
    raise AssertionError("the previous handler ran")


def test_a_run_ending_on_a_lost_rank_records_sigterm_instead_of_dying(caplog):
    before = {s: signal.signal(s, _marker) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        session = loop._Session()
        session.exit_signal = loop._ExitSignal("SIGTERM")
        session.end_on_lost_rank()
        session.close()
        assert signal.getsignal(signal.SIGTERM) == session.exit_signal._handler  # held, not restored
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stopping the survivor: recorded, nothing else
        assert session.exit_signal.received
        assert "received SIGTERM" not in caplog.text  # no "saving, exiting" promise on the way out
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_any_other_end_restores_the_previous_handlers():
    before = {s: signal.signal(s, _marker) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        session = loop._Session()
        session.exit_signal = loop._ExitSignal("SIGTERM")
        assert signal.getsignal(signal.SIGTERM) == session.exit_signal._handler
        session.close()
        assert signal.getsignal(signal.SIGTERM) is _marker and signal.getsignal(signal.SIGINT) is _marker
    finally:
        for s, h in before.items():
            signal.signal(s, h)
