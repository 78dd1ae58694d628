"""RolloutSchedule: which policy samples each step's batch, and the batches in flight (`algorithm.max_staleness`).

Step t trains on batch t. With `max_staleness` K, batch t is sampled by the weights after step t − 1 − K (the
start's for t ≤ K): K = 0 is the synchronous loop (generate, then train on what was generated); K = 1 has the
engines generate batch t + 1 while the train group trains on batch t. The schedule is fixed (it does not depend
on which group is faster), so the same command gives the same records, and so does a resume or a replay after a
fault.

Generations run one at a time on background threads, in batch order; the engines run each call to the end
before the next one (a Ray actor's calls are serial), so a payload sent after a launch reaches the engines after
that generation, never during it; a generation whose predecessor failed is abandoned, not run. At a step's
boundary (after the weight sync) every launched batch is therefore
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

from logra_rl.data import Prompt, PromptSampler
from logra_rl.rollout import Completion

Generate = Callable[[list[Prompt], int], list[Completion]]  # (prompts, step) → completions, n per prompt in order


class GenerationAbandoned(RuntimeError):
    """A batch's generation was not run: the one launched before it failed (its engines need the policy's
    weights again before anything is generated on them)."""


@dataclass
class Rollout:
    """One step's batch: its prompts and, once generated, the engines' completions."""

    step: int
    prompts: list[Prompt]
    sampler_state: dict[str, Any]  # the prompt sampler before `prompts` were drawn
    policy_version: int  # the engines' when it was launched: the policy that samples it
    completions: list[Completion] | None = None
    generation_s: float = 0.0  # how long the engines took to generate it
    ended: float = float("inf")  # time.monotonic() when its generation ended
    future: Future[tuple[list[Completion], float]] | None = field(default=None, repr=False)


class RolloutSchedule:
    def __init__(self, max_staleness: int, sampler: PromptSampler, prompts_per_step: int, generate: Generate) -> None:
        self.max_staleness = max_staleness
        self.sampler = sampler
        self.prompts_per_step = prompts_per_step
        self.generate = generate
        self.rollouts: dict[int, Rollout] = {}  # launched and not yet trained on, by step
        self._last: Future | None = None  # the generation launched last: the next one starts after it

    def launch(self, step: int, policy_version: int, last_step: int) -> None:
        """Launch every batch from `step` to step + max_staleness (at most `last_step`) not launched yet, sampled
        by `policy_version` (the engines' weights now: after step − 1)."""
        first = max(self.rollouts, default=step - 1) + 1
        for batch in range(max(first, step), min(step + self.max_staleness, last_step) + 1):
            state = self.sampler.state_dict()
            prompts = self.sampler.next_batch(self.prompts_per_step)
            self.rollouts[batch] = rollout = Rollout(batch, prompts, state, policy_version)
            self._submit(rollout)

    def relaunch(self, step: int, policy_version: int) -> None:
        """Generate batch `step`'s prompts again, sampled by `policy_version` (after engines were lost during it,
        or a stale batch past `algorithm.staleness_kl`). It waits for the launch before it to end: one that failed
        (or was abandoned after a failure) is history, since the caller has brought the engines back since."""
        if self._last is not None:
            wait_for([self._last])
            if self._last.exception() is not None:
                self._last = None
        rollout = self.rollouts[step]
        rollout.policy_version, rollout.completions = policy_version, None
        self._submit(rollout)

    def wait(self, step: int) -> Rollout:
        """Batch `step`, once generated (raises what its generation raised)."""
        rollout = self.rollouts[step]
        if rollout.completions is None:
            rollout.completions, rollout.generation_s = rollout.future.result()
        return rollout

    def ahead(self, step: int) -> list[int]:
        """The batches launched for the steps after `step`, in order."""
        return sorted(later for later in self.rollouts if later > step)

    def trained(self, step: int) -> None:
        """Batch `step` has been trained on: no longer in flight."""
        del self.rollouts[step]

    # ---- checkpoints ----------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Any], list[SavedRollout]]:
        """The sampler as the first batch in flight found it, and the batches in flight (all generated at a step
        boundary): what a checkpoint holds to resume them. Cheap: the completions are shared, not copied."""
        rollouts = [self.wait(step) for step in sorted(self.rollouts)]
        sampler = rollouts[0].sampler_state if rollouts else self.sampler.state_dict()
        return sampler, [SavedRollout(r.step, r.policy_version, r.completions) for r in rollouts]

    def load(self, sampler: dict[str, Any], saved: list[SavedRollout]) -> None:
        """Restore `state()`: the sampler, then each batch's prompts drawn again with its completions."""
        self.abandon()
        self.sampler.load_state_dict(sampler)
        for record in saved:
            state = self.sampler.state_dict()
            prompts = self.sampler.next_batch(self.prompts_per_step)
            per_prompt, left = divmod(len(record.completions), len(prompts))
            if left or not per_prompt:
                raise ValueError(
                    f"the checkpoint's batch {record.step} holds {len(record.completions)} completions, not a whole "
                    f"number per prompt of {len(prompts)}: resume with the trainer.prompts_per_step it was made with"
                )
            completions = [
                replace(c, prompt_ids=prompts[i // per_prompt].token_ids) for i, c in enumerate(record.completions)
            ]
            self.rollouts[record.step] = Rollout(record.step, prompts, state, record.policy_version, completions)

    def abandon(self) -> None:
        """Forget every batch in flight, once the generation running now (if any) has ended: nothing else calls
        the engines meanwhile (a full resync after a lost train group would queue behind it). The next launch
        starts a new chain, whatever the last one's end: the caller brings the engines back first."""
        if self._last is not None:
            wait_for([self._last])
        self._last = None
        self.rollouts.clear()

    def _submit(self, rollout: Rollout) -> None:
        """Generate `rollout` on a daemon thread (a run that exits never waits for one) once the previous launch
        has ended; if that one failed, this one is abandoned instead of run on engines that need a resync."""
        previous, future = self._last, Future()
        prompts, step = rollout.prompts, rollout.step

        def generate() -> None:
            if previous is not None:
                wait_for([previous])
            future.set_running_or_notify_cancel()
            try:
                if previous is not None and previous.exception() is not None:
                    raise GenerationAbandoned(f"batch {step}: the generation before it failed")
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
    policy_version: int
    completions: list[Completion]


def pack_rollouts(saved: list[SavedRollout]) -> list[dict[str, Any]]:
    """Each batch's completions as flat tensors (a checkpoint's rollouts.pt; prompts are not stored)."""
    packed = []
    for record in saved:
        completions = record.completions
        packed.append(
            {
                "step": record.step,
                "policy_version": record.policy_version,
                "lengths": torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long),
                "token_ids": torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.int32),
                "logprobs": torch.tensor([p for c in completions for p in c.logprobs], dtype=torch.float32),
                "finished": torch.tensor([c.finished for c in completions], dtype=torch.bool),
                "completion_versions": torch.tensor([c.policy_version for c in completions], dtype=torch.long),
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
                bounds[:-1],
                bounds[1:],
                record["finished"].tolist(),
                record["completion_versions"].tolist(),
                strict=True,
            )
        ]
        saved.append(SavedRollout(int(record["step"]), int(record["policy_version"]), completions))
    return saved
