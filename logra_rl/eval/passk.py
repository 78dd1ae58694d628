"""pass@k with the unbiased estimator of Chen et al. (2021): 1 − C(n−c, k) / C(n, k)."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of k samples (drawn without replacement from n) is correct."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def pass_at_k_metrics(rewards: Sequence[Sequence[float]], k: int, prefix: str) -> dict[str, float]:
    """`{prefix}/pass@1` (mean accuracy over all samples) and `{prefix}/pass@k`, from per-prompt rewards."""
    correct = [sum(r >= 1.0 for r in prompt) for prompt in rewards]
    pass1 = sum(pass_at_k(len(p), c, 1) for p, c in zip(rewards, correct, strict=True)) / len(rewards)
    passk = sum(pass_at_k(len(p), c, k) for p, c in zip(rewards, correct, strict=True)) / len(rewards)
    return {f"{prefix}/pass@1": pass1, f"{prefix}/pass@{k}": passk}


def eval_metrics(rewards: Sequence[Sequence[float]], sources: Sequence[str], k: int, prefix: str) -> dict[str, float]:
    """pass@1 / pass@k overall, and per source (`{prefix}/{source}/pass@…`) when the prompts have several."""
    metrics = pass_at_k_metrics(rewards, k, prefix)
    names = sorted(set(sources))
    if len(names) > 1:
        for name in names:
            subset = [r for r, source in zip(rewards, sources, strict=True) if source == name]
            metrics.update(pass_at_k_metrics(subset, k, f"{prefix}/{name}"))
    return metrics
