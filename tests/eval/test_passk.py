from math import comb

import pytest

from logra_rl.eval import pass_at_k, pass_at_k_metrics


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
