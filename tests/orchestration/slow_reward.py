"""A reward that hangs on one answer: the step must go on, the item scoring 0 as a timeout."""

import time

from logra_rl.rewards import exact_match_reward


def hangs_on_three(response: str, answer: str, metadata) -> float:
    if answer == "3":
        time.sleep(60)
    return exact_match_reward(response, answer, metadata)
