"""The rollout engine interface. The HF engine implements it here; the vLLM engine plugs into the same one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    max_new_tokens: int
    n: int = 1  # responses per prompt, returned consecutively


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the end-of-turn token when `finished`
    logprobs: list[float]  # log-probability of each generated token under the sampling distribution
    finished: bool  # ended with end-of-turn (False: cut at max_new_tokens)


@dataclass(frozen=True)
class SyncResult:
    applied: bool
    version: int  # the engine's policy version after the call
    reason: str = ""  # why a payload was refused (the controller then resyncs)


class RolloutEngine(Protocol):
    """What the controller needs from an engine; each method is called through a Ray actor handle."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def apply_payload(self, payload: bytes) -> SyncResult: ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> SyncResult: ...

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]: ...
