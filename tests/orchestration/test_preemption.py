import os
import signal

import pytest

from logra_rl.orchestration.preemption import Preemption


def test_the_first_signal_is_noted_and_the_second_exits_with_the_shells_status():
    before = signal.getsignal(signal.SIGINT)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested and preemption.name == "SIGINT" and preemption.exit_code == 130
        with pytest.raises(SystemExit) as exit:
            os.kill(os.getpid(), signal.SIGINT)
    assert exit.value.code == 130
    assert signal.getsignal(signal.SIGINT) is before  # restored on leaving


def test_a_second_signal_while_the_run_shuts_down_lets_the_shutdown_finish(capfd):
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        preemption.shutting_down = True  # an exit raised now would land inside Ray's or a finalizer's cleanup
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.exit_code == 128 + signal.SIGTERM
    assert "already shutting down" in capfd.readouterr().err
