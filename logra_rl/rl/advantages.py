"""Advantages: the paper's running-baseline REINFORCE, optional length weighting, GRPO groups."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch


class RunningBaseline:
    """A_i = o_i − b with b the baseline *before* this batch; then b ← (1 − w)·b + w·mean(o).

    The outcome o_i is 1 for a correct response (reward ≥ success_threshold) and
    `failure_reward` otherwise. Rows marked invalid (e.g. empty responses) get advantage 0
    and do not move the baseline.

    With `per_prompt`, every prompt keeps its own b (kept under a hash of its tokens), starting
    from the batch-wide one when the prompt is first seen, and moved by the mean of its own outcomes. Where prompts
    repeat across steps, a prompt the policy already solves then stops pulling every answer towards its own (its
    advantages fall to ~0) and the gradient is left to the prompts it does not solve yet; the wrong answers of an
    unsolved prompt get a push back of −b of that prompt, near 0, where a batch-wide b would give more.
    """

    def __init__(
        self,
        weight: float = 0.1,
        failure_reward: float = -0.01,
        success_threshold: float = 1.0,
        per_prompt: bool = False,
    ):
        if not 0 < weight <= 1:
            raise ValueError(f"baseline weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.failure_reward = failure_reward
        self.success_threshold = success_threshold
        self.per_prompt = per_prompt
        self.value = 0.0
        self.prompt_values: dict[str, float] = {}

    def outcomes(self, rewards: torch.Tensor) -> torch.Tensor:
        return torch.where(rewards >= self.success_threshold, 1.0, self.failure_reward).to(torch.float64)

    def advantages(
        self,
        rewards: torch.Tensor,
        valid: torch.Tensor | None = None,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """`prompts`: each row's prompt token ids, required with `per_prompt` (rows of one prompt share a
        baseline, kept under `prompt_hash` of its tokens) and not read otherwise."""
        valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
        if not bool(torch.isfinite(rewards[valid]).all()):
            raise FloatingPointError("non-finite reward on a valid row")
        outcomes = self.outcomes(torch.nan_to_num(rewards))
        if self.per_prompt:
            if prompts is None or len(prompts) != len(rewards):
                raise ValueError("a per-prompt baseline needs each row's prompt")
            keys = [prompt_hash(ids) for ids in prompts]
            baselines = torch.tensor([self.prompt_values.get(k, self.value) for k in keys], dtype=torch.float64)
            groups: dict[str, list[float]] = {}
            for key, outcome, ok in zip(keys, outcomes.tolist(), valid.tolist(), strict=True):
                if ok:
                    groups.setdefault(key, []).append(outcome)
            for key, seen in groups.items():
                before = self.prompt_values.get(key, self.value)
                self.prompt_values[key] = (1 - self.weight) * before + self.weight * sum(seen) / len(seen)
        else:
            baselines = torch.full_like(outcomes, self.value)
        advantages = torch.where(valid, outcomes - baselines, 0.0)
        if valid.any():
            self.value = (1 - self.weight) * self.value + self.weight * float(outcomes[valid].mean())
        return advantages

    def state_dict(self) -> dict:
        return {"value": self.value, "prompt_values": dict(self.prompt_values)}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.prompt_values = {k: float(v) for k, v in state.get("prompt_values", {}).items()}


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A short stable name for a prompt's tokens (what a per-prompt baseline is kept under in a checkpoint)."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).hexdigest()


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
