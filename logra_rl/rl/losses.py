"""Token-level policy-gradient losses with truncated importance weights.

All losses are token *sums*; the caller divides by the global token count (directly for
dense AdamW, through `LoGRAOptimizer.prepare(num_tokens=...)` for LoGRA), so every data
parallel rank contributes its share of one global token-mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossStats:
    """Sums over the loss tokens of a microbatch, reduced by the caller."""

    tokens: float
    is_ratio_sum: float  # Σ π_train/π_rollout (before truncation)
    is_truncated: float  # tokens whose importance weight hit the cap
    clipped: float  # tokens whose PPO ratio was clipped
    entropy: float  # Σ of the policy's entropy at each loss token (0 where no entropies were given)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float = 2.0,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Σ_tokens −A·w·log π (REINFORCE) or the PPO clipped surrogate, weighted by truncated IS, minus
    `entropy_coeff`·Σ_tokens H (`entropy`: the policy's entropy at each token, an exploration bonus).

    w = min(π_old/π_rollout, tis_cap), detached, corrects for the rollout engine's numerics
    (π_old = π_train at the start of the step). With `clip_low`/`clip_high` the surrogate is
    min(r·A, clip(r, 1−clip_low, 1+clip_high)·A) with r = π/π_old (several mini-batch epochs).
    `advantages` is per row (broadcast over tokens) or per token.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    is_ratio = torch.exp(old - rollout_logprobs)
    weight = is_ratio.clamp(max=tis_cap)
    if clip_low is None and clip_high is None:
        per_token = -advantages * weight * logprobs
        clipped = torch.zeros((), dtype=logprobs.dtype)
    else:
        ratio = torch.exp(logprobs - old)
        bounded = ratio.clamp(
            None if clip_low is None else 1 - clip_low, None if clip_high is None else 1 + clip_high
        )  # a missing bound leaves that side unclipped
        surrogate = torch.minimum(ratio * advantages, bounded * advantages)
        per_token = -weight * surrogate
        clipped = ((ratio * advantages > bounded * advantages) * mask).sum()
    loss = (per_token * mask).sum()
    entropy_sum = torch.zeros((), dtype=logprobs.dtype) if entropy is None else (entropy * mask).sum()
    if entropy_coeff:
        if entropy is None:
            raise ValueError("entropy_coeff > 0 needs the entropies")
        loss = loss - entropy_coeff * entropy_sum
    stats = LossStats(
        tokens=float(mask.sum()),
        is_ratio_sum=float((is_ratio * mask).sum()),
        is_truncated=float(((is_ratio > tis_cap) * mask).sum()),
        clipped=float(clipped),
        entropy=float(entropy_sum.detach()),
    )
    return loss, stats
