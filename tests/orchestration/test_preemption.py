import os
import signal
import time

import pytest

from logra_rl.orchestration.preemption import Interrupted, Preemption


def test_the_first_signal_is_noted_and_the_second_exits_with_the_shells_status():
    before = signal.getsignal(signal.SIGINT)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested and preemption.name == "SIGINT"
        with pytest.raises(SystemExit) as exit:
            os.kill(os.getpid(), signal.SIGINT)
    assert exit.value.code == 130
    assert signal.getsignal(signal.SIGINT) is before  # restored on leaving


def test_a_second_signal_while_the_run_shuts_down_lets_the_shutdown_finish(capfd):
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        preemption.shutting_down = True  # an exit raised now would land inside Ray's or a finalizer's cleanup
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.name == "SIGTERM"
    assert "already shutting down" in capfd.readouterr().err


def test_inside_interruptible_work_the_first_signal_raises_at_once():
    """An eval or a generation (nothing a checkpoint holds changes) is dropped when the signal comes, not waited
    for; outside it the signal is only noted, and a signal noted before it starts stops it before it begins."""
    with Preemption() as preemption:
        with pytest.raises(Interrupted), preemption.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the eval that would outlast the grace period
        assert preemption.requested and preemption.name == "SIGTERM"
        with pytest.raises(Interrupted), preemption.interruptible():
            raise AssertionError("a signal already noted stops the work before it begins")
    with Preemption() as preemption:
        with preemption.interruptible():
            pass
        os.kill(os.getpid(), signal.SIGINT)  # outside: noted only
        assert preemption.requested
