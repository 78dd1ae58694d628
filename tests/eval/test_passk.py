import random
import statistics
from math import comb

import pytest

from logra_rl.eval import eval_metrics, pass_at_k, pass_at_k_metrics
from logra_rl.eval.passk import pass1_stderr


def test_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - comb(7, 2) / comb(10, 2))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_metrics_over_prompts():
    metrics = pass_at_k_metrics([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], k=4, prefix="eval/math")
    assert metrics == pytest.approx({"eval/math/pass@1": (0.25 + 0 + 1) / 3, "eval/math/pass@4": 2 / 3})


def test_pass1_stderr_is_the_sampling_noise_of_pass1_on_these_prompts():
    # per prompt p̂ = c/n; the unbiased variance of p̂ is c(n−c)/(n²(n−1)); summed over prompts, over prompts²
    rewards = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    expected = ((1 * 3 / (16 * 3) + 0 + 2 * 2 / (16 * 3)) ** 0.5) / 3
    assert pass1_stderr(rewards) == pytest.approx(expected)
    assert pass1_stderr([[1, 1], [0, 0]]) == 0.0  # every prompt decided: a second eval would agree
    assert pass1_stderr([[1], [0]]) is None
    metrics = eval_metrics(rewards, ["a"] * 3, k=4, prefix="eval/t")
    assert metrics["eval/t/pass@1_stderr"] == pytest.approx(expected)
    assert "eval/t/pass@1_stderr" not in eval_metrics([[1], [0]], ["a", "a"], k=1, prefix="eval/t")


def test_pass1_stderr_matches_the_spread_of_repeated_evals():
    # 400 prompts with success rates spread over [0, 1], 4 samples each: 2000 repeated evals' spread
    rng = random.Random(0)
    rates = [rng.random() for _ in range(400)]
    evals = [[[float(rng.random() < p) for _ in range(4)] for p in rates] for _ in range(2000)]
    pass1 = [pass_at_k_metrics(rewards, 4, "e")["e/pass@1"] for rewards in evals]
    spread = statistics.stdev(pass1)
    estimates = [pass1_stderr(rewards) for rewards in evals[:50]]
    assert spread == pytest.approx(statistics.fmean(estimates), rel=0.05)
