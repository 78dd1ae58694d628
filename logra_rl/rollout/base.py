"""The rollout engine interface. The HF engine implements it here; the vLLM engine plugs into the same one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from logra_rl.logra import PayloadMerger


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


class BucketedResync:
    """A full resync arriving in buckets of HF-named fp32 master weights: loads the merger's targets as
    their bucket arrives, and lets the last bucket set the version only if every weight has arrived."""

    def __init__(self, merger: PayloadMerger, weight_names: Iterable[str]) -> None:
        self.merger = merger
        self.weight_names = frozenset(weight_names)
        self.pending: set[str] = set()

    def receive(self, state: Mapping[str, torch.Tensor], version: int, bucket: int, buckets: int) -> None:
        """Bucket `bucket` of `buckets`; the engine has already loaded `state` into its own weights."""
        if bucket == 0:
            self.merger.begin_resync()
            self.pending = set(self.weight_names)
        self.pending -= state.keys()
        targets = self.merger.targets
        self.merger.load({name: state[f"{name}.weight"] for name in targets if f"{name}.weight" in state})
        if bucket == buckets - 1:
            if self.pending:
                raise KeyError(f"full resync ended without weights {sorted(self.pending)[:4]}")
            self.merger.finish_resync(version)


class RolloutEngine(Protocol):
    """What the controller needs from an engine; each method is called through a Ray actor handle."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def apply_payload(self, payload: bytes) -> SyncResult: ...

    def load_weights(
        self, state: dict[str, torch.Tensor], version: int, bucket: int = 0, buckets: int = 1
    ) -> SyncResult: ...

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]: ...
