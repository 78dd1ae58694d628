import math
import time

import pytest
from reasoning_gym import create_dataset

from logra_rl.rewards import GradeRequest, GradeResult, RewardPool, grade_one, grader_metrics

TIMEOUT_S = 1.0
PATHOLOGICAL = r"\boxed{2^{2^{2^{2^{2^2}}}}}"  # sympy would evaluate this tower far beyond the timeout


def raising_reward(response, answer, metadata):
    raise RuntimeError("grader bug")


def out_of_range_reward(response, answer, metadata):
    return float(response)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as reward_pool:
        yield reward_pool


def test_results_keep_order_and_a_pathological_item_times_out_alone(pool):
    entry = create_dataset("gcd", size=1, seed=3)[0]
    requests = [
        GradeRequest("math_verify", r"\boxed{\frac{1}{2}}", "0.5"),
        GradeRequest("math_verify", PATHOLOGICAL, r"\sqrt{3}"),
        GradeRequest("math_verify", r"\boxed{2}", "3"),
        GradeRequest(
            "reasoning_gym", f"<answer>{entry['answer']}</answer>", entry["answer"], {"dataset": "gcd", "entry": entry}
        ),
        GradeRequest("exact_match", "yes<|im_end|>", "yes"),
    ]
    pool.grade(requests[:1])  # workers started
    start = time.monotonic()
    results = pool.grade(requests)
    elapsed = time.monotonic() - start
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert [r.timed_out for r in results] == [False, True, False, False, False]
    assert all(r.error is None for r in results)
    assert elapsed < TIMEOUT_S + 2.0
    # The killed worker is replaced: the pool keeps grading.
    assert pool.grade(requests[:1] + requests[2:3]) == [GradeResult(1.0), GradeResult(0.0)]
    assert grader_metrics(results) == {"reward/grader_timeouts": 1.0, "reward/grader_errors": 0.0}


def test_grader_failures_score_zero_with_the_error(pool):
    before = dict(pool.summary)
    results = pool.grade(
        [
            GradeRequest("tests.rewards.test_pool:raising_reward", "x", "y"),
            GradeRequest("tests.rewards.test_pool:out_of_range_reward", "1.5", "y"),
            GradeRequest("tests.rewards.test_pool:out_of_range_reward", "nan", "y"),
            GradeRequest("tests.rewards.test_pool:out_of_range_reward", "0.25", "y"),
            GradeRequest("reasoning_gym", "<answer>1</answer>", "1", {}),  # metadata lacks the entry
        ]
    )
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.25, 0.0]
    assert "RuntimeError: grader bug" in results[0].error
    assert "must be a finite number in [0, 1]" in results[1].error
    assert "must be a finite number in [0, 1]" in results[2].error
    assert results[3].error is None
    assert "needs metadata keys" in results[4].error
    assert not any(r.timed_out for r in results)
    assert grader_metrics(results) == {"reward/grader_timeouts": 0.0, "reward/grader_errors": 4.0}
    assert pool.summary["errors"] - before["errors"] == 4
    assert pool.summary["graded"] - before["graded"] == 5


def test_unknown_reward_fails_before_grading(pool):
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        pool.grade([GradeRequest("math_verify", "1", "1"), GradeRequest("nope", "1", "1")])


def test_grade_one_checks_the_reward_range():
    assert grade_one("exact_match", "a", "a", {}) == 1.0
    with pytest.raises(ValueError, match="returned inf"):
        grade_one("tests.rewards.test_pool:out_of_range_reward", str(math.inf), "", {})


def test_bad_arguments_and_use_after_close():
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s=-1"):
        RewardPool(timeout_s=-1)
    closed = RewardPool(num_workers=1)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.grade([GradeRequest("exact_match", "a", "a")])
