"""pass@k with the unbiased estimator of Chen et al. (2021): 1 − C(n−c, k) / C(n, k)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of k samples (drawn without replacement from n) is correct."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_at_k_metrics(rewards: Sequence[Sequence[float]], k: int, prefix: str) -> dict[str, float]:
    """`{prefix}/pass@1` (mean accuracy over all samples) and `{prefix}/pass@k`, from per-prompt rewards."""
    correct = [sum(r >= 1.0 for r in prompt) for prompt in rewards]
    pass1 = sum(pass_at_k(len(p), c, 1) for p, c in zip(rewards, correct, strict=True)) / len(rewards)
    passk = sum(pass_at_k(len(p), c, k) for p, c in zip(rewards, correct, strict=True)) / len(rewards)
    return {f"{prefix}/pass@1": pass1, f"{prefix}/pass@{k}": passk}


def pass1_stderr(rewards: Sequence[Sequence[float]]) -> float | None:
    """The standard error of pass@1 from sampling alone, on these prompts: how far a second eval of the same
    weights could land. Each prompt's success rate p is estimated from its n samples; its unbiased variance
    estimate c(n−c) / (n²(n−1)) sums over prompts. None when a prompt has a single sample (nothing to estimate
    from). Comparing two policies on the same prompts, this is the noise the difference carries from each."""
    if any(len(prompt) < 2 for prompt in rewards):
        return None
    correct = [sum(r >= 1.0 for r in prompt) for prompt in rewards]
    variance = sum(c * (len(p) - c) / (len(p) ** 2 * (len(p) - 1)) for p, c in zip(rewards, correct, strict=True))
    return math.sqrt(variance) / len(rewards)


def eval_metrics(rewards: Sequence[Sequence[float]], sources: Sequence[str], k: int, prefix: str) -> dict[str, float]:
    """pass@1 / pass@k overall (with pass@1's sampling standard error when every prompt has 2+ samples), and per
    source (`{prefix}/{source}/pass@…`) when the prompts have several."""
    metrics = pass_at_k_metrics(rewards, k, prefix)
    stderr = pass1_stderr(rewards)
    if stderr is not None:
        metrics[f"{prefix}/pass@1_stderr"] = stderr
    names = sorted(set(sources))
    if len(names) > 1:
        for name in names:
            subset = [r for r, source in zip(rewards, sources, strict=True) if source == name]
            metrics.update(pass_at_k_metrics(subset, k, f"{prefix}/{name}"))
    return metrics
