"""Rewards: named graders and the timeout-safe process pool that runs them.

`rewards.grading.CompletionGrader` (torch) is imported from its module, not here: the pool's spawned
workers import this package, and a replaced worker must start fast.
"""

from logra_rl.rewards.graders import (
    GraderTimeout,
    RewardFunction,
    exact_match_reward,
    final_text,
    get_reward_function,
    last_boxed,
    reasoning_gym_reward,
    register_reward,
    strip_end_of_text,
    usable_answer,
)
from logra_rl.rewards.math import math_reward, math_verify_reward
from logra_rl.rewards.pool import GradeRequest, GradeResult, RewardPool, grade_one, grader_metrics

__all__ = [
    "GradeRequest",
    "GradeResult",
    "GraderTimeout",
    "RewardFunction",
    "RewardPool",
    "exact_match_reward",
    "final_text",
    "get_reward_function",
    "grade_one",
    "grader_metrics",
    "last_boxed",
    "math_reward",
    "math_verify_reward",
    "reasoning_gym_reward",
    "register_reward",
    "strip_end_of_text",
    "usable_answer",
]
