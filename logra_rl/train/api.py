"""What the train group answers the driver: typed results, no positional conventions.

A step returns a `StepResult`: the policy version after it (the trainer owns the version: the number
of updates committed so far, checkpointed with the optimizer), its metrics (only metrics), and one
`WeightUpdate` saying what the rollout engines need to catch up:

- `LowRankPayloads`: LoGRA (or LoRA) committed one update per payload, in order (several with PPO epochs);
- `FullResync`: dense AdamW moved every weight; the engines need bf16(master) in full;
- `NoChange`: every update of the step was skipped; no weight moved, nothing is sent.

An update rule answers the same type for one update, its payload the committed `Payload`; the
step's answer carries each payload as a `PayloadRef` instead, left in Ray's object store by train rank 0:
the driver hands the reference on to the engines and never holds the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import ray

P = TypeVar("P")  # how a payload travels: a `Payload` inside a worker, a PayloadRef beyond it


@dataclass(frozen=True)
class PayloadRef:
    """One payload's bytes (`Payload.to_bytes()`, as a uint8 array) in Ray's object store, and what the
    driver records of it without reading it. Train rank 0 put it there and owns it: the object lives while
    that actor does and the driver holds this reference (until every engine has applied it)."""

    ref: ray.ObjectRef
    nbytes: int
    base_version: int  # the policy version the payload applies to
    new_version: int


@dataclass(frozen=True)
class LowRankPayloads(Generic[P]):
    payloads: tuple[P, ...]  # in order, each version-gated on the engines


@dataclass(frozen=True)
class FullResync:
    pass


@dataclass(frozen=True)
class NoChange:
    reason: str


@dataclass(frozen=True)
class StaleBatch(NoChange):
    """The batch was sampled by a policy further than the staleness bound (`algorithm.staleness_kl` or the rule's
    default) from the one being trained: not trained on (nothing moved); the controller has its prompts generated
    again by the current policy."""


WeightUpdate = LowRankPayloads[P] | FullResync | NoChange


@dataclass(frozen=True)
class StepResult:
    policy_version: int
    metrics: dict[str, float]
    update: WeightUpdate[PayloadRef]


@dataclass(frozen=True)
class ResyncBucket:
    """State-dict keys streamed together in a full resync, and the fp32 bytes they send to an engine."""

    keys: tuple[str, ...]
    nbytes: int
