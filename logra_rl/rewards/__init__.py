"""Rewards: named graders and the timeout-safe process pool that runs them."""

from logra_rl.rewards.graders import (
    GraderTimeout,
    RewardFunction,
    exact_match_reward,
    get_reward_function,
    last_boxed,
    reasoning_gym_reward,
    register_reward,
    strip_end_of_text,
)
from logra_rl.rewards.grading import CompletionGrader
from logra_rl.rewards.math import math_reward, math_verify_reward
from logra_rl.rewards.pool import GradeRequest, GradeResult, RewardPool, grade_one, grader_metrics

__all__ = [
    "CompletionGrader",
    "GradeRequest",
    "GradeResult",
    "GraderTimeout",
    "RewardFunction",
    "RewardPool",
    "exact_match_reward",
    "get_reward_function",
    "grade_one",
    "grader_metrics",
    "last_boxed",
    "math_reward",
    "math_verify_reward",
    "reasoning_gym_reward",
    "register_reward",
    "strip_end_of_text",
]
