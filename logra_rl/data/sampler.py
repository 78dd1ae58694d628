"""Endless, resumable prompt sampling over shuffled epochs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Yields batches from a fresh permutation per epoch, drawn from (seed, epoch) alone.

    The state is just (epoch, position), so a resumed run sees exactly the prompts it would have seen.
    A batch that crosses an epoch boundary finishes the old epoch and continues into the new one.
    """

    def __init__(self, examples: Sequence[T], seed: int) -> None:
        if not examples:
            raise ValueError("PromptSampler needs at least one example")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples)).tolist()

    def next_batch(self, n: int) -> list[T]:
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch.extend(self.examples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> T:
        return self.next_batch(1)[0]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; it must come from a sampler over the same number of examples and seed."""
        if (state["seed"], state["num_examples"]) != (self.seed, len(self.examples)):
            raise ValueError(
                f"sampler state is for seed {state['seed']} over {state['num_examples']} examples, but this sampler "
                f"has seed {self.seed} over {len(self.examples)}; resume with the same data config"
            )
        if not 0 <= state["position"] <= len(self.examples):
            raise ValueError(f"sampler state position {state['position']} is outside 0..{len(self.examples)}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation(self.epoch)
