"""Advantages: the paper's running-baseline REINFORCE, optional length weighting, GRPO groups."""

from __future__ import annotations

import math

import torch


class RunningBaseline:
    """A_i = o_i − b with b the baseline *before* this batch; then b ← (1 − w)·b + w·mean(o).

    The outcome o_i is 1 for a correct response (reward ≥ success_threshold) and
    `failure_reward` otherwise. Rows marked invalid (e.g. empty responses) get advantage 0
    and do not move the baseline.
    """

    def __init__(self, weight: float = 0.1, failure_reward: float = -0.01, success_threshold: float = 1.0):
        if not 0 < weight <= 1:
            raise ValueError(f"baseline weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.failure_reward = failure_reward
        self.success_threshold = success_threshold
        self.value = 0.0

    def outcomes(self, rewards: torch.Tensor) -> torch.Tensor:
        return torch.where(rewards >= self.success_threshold, 1.0, self.failure_reward).to(torch.float64)

    def advantages(self, rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
        if not bool(torch.isfinite(rewards[valid]).all()):
            raise FloatingPointError("non-finite reward on a valid row")
        outcomes = self.outcomes(torch.nan_to_num(rewards))
        advantages = torch.where(valid, outcomes - self.value, 0.0)
        if valid.any():
            self.value = (1 - self.weight) * self.value + self.weight * float(outcomes[valid].mean())
        return advantages

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def length_weighted(advantages: torch.Tensor, lengths: torch.Tensor, reference: float) -> torch.Tensor:
    """A_i · L_ref / max(L_i, 1): each response then carries weight ∝ A_i spread over its tokens."""
    if not (reference > 0 and math.isfinite(reference)):
        raise ValueError(f"length reference must be > 0, got {reference}")
    return advantages * (reference / lengths.clamp_min(1).to(advantages.dtype))


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """GRPO: reward minus its group's mean (optionally over the group's std); groups are consecutive rows."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.to(torch.float64).view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + 1e-6)
    return centered.flatten()
