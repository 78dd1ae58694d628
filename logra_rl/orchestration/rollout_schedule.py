"""RolloutSchedule: which policy samples each step's batch, and the batches in flight (`algorithm.max_staleness`).

Step t trains on batch t. With `max_staleness` K, batch t is sampled by the weights after step t − 1 − K (the
start's for t ≤ K): K = 0 is the synchronous loop (generate, then train on what was generated); K = 1 has the
engines generate batch t + 1 while the train group trains on batch t. The schedule is fixed (it does not depend
on which group is faster), so the same command gives the same records, and so does a resume or a replay after a
fault.

Generations run one at a time on background threads, in batch order; the engines run each call to the end
before the next one (a Ray actor's calls are serial), so a payload sent after a launch reaches the engines after
that generation, never during it. At a step's boundary (after the weight sync) every launched batch is therefore
complete: `state` holds them, with the prompt sampler's state before the first of them was drawn, so a
checkpoint restores them exactly (`load`: the same prompts drawn again, the same samples).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from logra_rl.data import PromptSampler
from logra_rl.data.prompts import Prompt
from logra_rl.rollout import Completion

Generate = Callable[[list[Prompt], int], list[Completion]]  # (prompts, step) → completions, n per prompt in order


@dataclass
class Rollout:
    """One step's batch: its prompts and, once generated, the engines' completions."""

    step: int
    prompts: list[Prompt]
    sampler_state: dict[str, Any]  # the prompt sampler before `prompts` were drawn
    version: int  # the policy version the engines were brought to before it was launched: the one that samples it
    completions: list[Completion] | None = None
    generation_s: float = 0.0  # how long the engines took to generate it
    ended: float = float("inf")  # time.monotonic() when its generation ended
    future: Future | None = field(default=None, repr=False)


class RolloutSchedule:
    def __init__(self, max_staleness: int, sampler: PromptSampler, prompts_per_step: int, generate: Generate) -> None:
        self.max_staleness = max_staleness
        self.sampler = sampler
        self.prompts_per_step = prompts_per_step
        self.generate = generate
        self.rollouts: dict[int, Rollout] = {}  # launched and not yet trained on, by step
        self._last: Future | None = None  # the generation launched last: the next one starts after it

    def launch(self, step: int, version: int, last_step: int) -> None:
        """Launch every batch from `step` to step + max_staleness (at most `last_step`) not launched yet, sampled
        by `version` (the engines' weights now: after step − 1)."""
        first = max(self.rollouts, default=step - 1) + 1
        for batch in range(max(first, step), min(step + self.max_staleness, last_step) + 1):
            state = self.sampler.state_dict()
            prompts = self.sampler.next_batch(self.prompts_per_step)
            self.rollouts[batch] = rollout = Rollout(batch, prompts, state, version)
            self._submit(rollout)

    def relaunch(self, step: int, version: int) -> None:
        """Generate batch `step`'s prompts again, sampled by `version` (after engines were lost during it, or a
        stale batch past `algorithm.staleness_kl`)."""
        rollout = self.rollouts[step]
        rollout.version, rollout.completions = version, None
        self._submit(rollout)

    def wait(self, step: int) -> Rollout:
        """Batch `step`, once generated (raises what its generation raised)."""
        rollout = self.rollouts[step]
        if rollout.completions is None:
            rollout.completions, rollout.generation_s = rollout.future.result()
        return rollout

    def wait_all(self) -> list[Rollout]:
        """Every launched batch, generated (the generations finished during this step come first)."""
        return [self.wait(step) for step in sorted(self.rollouts)]

    def trained(self, step: int) -> Rollout:
        return self.rollouts.pop(step)

    # ---- checkpoints ----------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Any], list[SavedRollout]]:
        """The sampler as the first batch in flight found it, and the batches in flight (all generated at a step
        boundary): what a checkpoint holds to resume them. Cheap: the completions are shared, not copied."""
        rollouts = self.wait_all()
        sampler = rollouts[0].sampler_state if rollouts else self.sampler.state_dict()
        return sampler, [SavedRollout(r.step, r.version, r.completions or []) for r in rollouts]

    def load(self, sampler: dict[str, Any], saved: list[SavedRollout]) -> None:
        """Restore `state()`: the sampler, then each batch's prompts drawn again with its completions."""
        self.discard()
        self.sampler.load_state_dict(sampler)
        for record in saved:
            state = self.sampler.state_dict()
            prompts = self.sampler.next_batch(self.prompts_per_step)
            per_prompt = len(record.completions) // len(prompts)
            completions = [
                replace(c, prompt_ids=prompts[i // per_prompt].token_ids) for i, c in enumerate(record.completions)
            ]
            self.rollouts[record.step] = Rollout(record.step, prompts, state, record.version, completions)

    def discard(self) -> None:
        """Forget every batch in flight (a generation still running ends on its own; its result is dropped)."""
        self.rollouts.clear()

    def _submit(self, rollout: Rollout) -> None:
        """Generate `rollout` on a daemon thread (a run that exits never waits for one) once the previous launch
        has ended."""
        previous, future = self._last, Future()
        prompts, step = rollout.prompts, rollout.step

        def generate() -> None:
            if previous is not None:
                wait_for([previous])
            future.set_running_or_notify_cancel()
            try:
                start = time.monotonic()
                completions = self.generate(prompts, step)
                rollout.ended = time.monotonic()
                future.set_result((completions, rollout.ended - start))
            except BaseException as error:  # re-raised in the driver's thread by `wait`
                future.set_exception(error)

        rollout.ended, rollout.future, self._last = float("inf"), future, future
        threading.Thread(target=generate, name=f"rollout-{step}", daemon=True).start()


@dataclass(frozen=True)
class SavedRollout:
    """A batch in flight as a checkpoint holds it (its prompts are drawn again from the sampler on resume)."""

    step: int
    version: int
    completions: list[Completion]


def pack_rollouts(saved: list[SavedRollout]) -> list[dict[str, Any]]:
    """Each batch's completions as flat tensors (a checkpoint's rollouts.pt; prompts are not stored)."""
    packed = []
    for record in saved:
        completions = record.completions
        packed.append(
            {
                "step": record.step,
                "version": record.version,
                "lengths": torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long),
                "token_ids": torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.long),
                "logprobs": torch.tensor([p for c in completions for p in c.logprobs], dtype=torch.float32),
                "finished": torch.tensor([c.finished for c in completions], dtype=torch.bool),
                "policy_version": torch.tensor([c.policy_version for c in completions], dtype=torch.long),
            }
        )
    return packed


def unpack_rollouts(packed: list[dict[str, Any]]) -> list[SavedRollout]:
    saved = []
    for record in packed:
        bounds = [0, *torch.cumsum(record["lengths"], 0).tolist()]
        tokens, logprobs = record["token_ids"].tolist(), record["logprobs"].tolist()
        completions = [
            Completion([], tokens[a:b], logprobs[a:b], bool(finished), int(version))
            for a, b, finished, version in zip(
                bounds[:-1], bounds[1:], record["finished"].tolist(), record["policy_version"].tolist(), strict=True
            )
        ]
        saved.append(SavedRollout(int(record["step"]), int(record["version"]), completions))
    return saved
