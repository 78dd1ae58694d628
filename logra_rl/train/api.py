"""What the train group answers the driver: typed results, no positional conventions.

A step returns a `StepResult`: the policy version after it (the trainer owns the version: the number
of updates committed so far, checkpointed with the optimizer), its metrics (only metrics), and one
`WeightUpdate` saying what the rollout engines need to catch up:

- `LowRankPayloads`: LoGRA committed one update per payload, in order (several with PPO epochs);
- `FullResync`: dense AdamW or LoRA moved every trained weight; the engines need bf16(master) in full;
- `NoChange`: every update of the step was skipped; no weight moved, nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LowRankPayloads:
    payloads: tuple[bytes, ...]  # UpdatePayload.to_bytes(), each version-gated on the engines


@dataclass(frozen=True)
class FullResync:
    pass


@dataclass(frozen=True)
class NoChange:
    reason: str


WeightUpdate = LowRankPayloads | FullResync | NoChange


@dataclass(frozen=True)
class StepResult:
    policy_version: int
    metrics: dict[str, float]
    update: WeightUpdate


@dataclass(frozen=True)
class ResyncBucket:
    """State-dict keys streamed together in a full resync, and the fp32 bytes they send to an engine."""

    keys: tuple[str, ...]
    nbytes: int
