"""A benchmark's measurement in a fresh interpreter: its result comes back whatever else the process prints, and a
failure says which measurement failed and why."""

import sys

import pytest

from logra_rl.apps.bench_runs import child_result

PRINTS = "from logra_rl.apps.bench_runs import print_child_result; print('loading...'); print_child_result({})"


def test_the_measurement_s_result_is_read_among_its_other_output():
    command = [sys.executable, "-c", PRINTS.replace("{}", "{'peak_gib': 1.5, 'rows': [2, 8]}")]
    assert child_result(command, "guard") == {"peak_gib": 1.5, "rows": [2, 8]}


def test_a_measurement_that_fails_is_named_with_its_exit_code_and_error():
    command = [sys.executable, "-c", "raise MemoryError('4096 tokens')"]
    with pytest.raises(RuntimeError, match=r"(?s)jvp failed with exit code 1:.*MemoryError: 4096 tokens"):
        child_result(command, "jvp")
