"""A reward that hangs on one answer: the step must go on, the item scoring 0 as a timeout."""

import os
import time
from pathlib import Path

from logra_rl.rewards import exact_match_reward


def hangs_on_three(response: str, answer: str, metadata) -> float:
    if answer == "3":
        time.sleep(60)
    return exact_match_reward(response, answer, metadata)


def marks_then_hangs(response: str, answer: str, metadata) -> float:
    """Writes the file named by $LOGRA_TEST_MARKER (the run is grading), then hangs past any test's patience."""
    marker = os.environ.get("LOGRA_TEST_MARKER")
    if marker:
        Path(marker).touch()
    time.sleep(60)
    return exact_match_reward(response, answer, metadata)
