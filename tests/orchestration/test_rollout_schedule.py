"""The rollout schedule without Ray: which policy samples each batch, in which order, and what a checkpoint of
the batches in flight restores."""

import threading
import time

import pytest
import torch

from logra_rl.data import PromptSampler
from logra_rl.data.prompts import Prompt
from logra_rl.orchestration.rollout_schedule import (
    GenerationAbandoned,
    RolloutSchedule,
    pack_rollouts,
    unpack_rollouts,
)
from logra_rl.rollout import Completion

N = 2  # responses per prompt


class FakeEngines:
    """Completions that say which prompt, step and policy version made them; records the order of the calls."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[int, int]] = []  # (step, version) in the order the engines ran them
        self.fail_step: int | None = None

    def __call__(self, prompts: list[Prompt], step: int) -> list[Completion]:
        time.sleep(0.01)
        self.calls.append((step, self.version))
        if step == self.fail_step:
            raise RuntimeError(f"engine lost during batch {step}")
        return [
            Completion(p.token_ids, [step, i], [-0.5 * i, -0.25], i % 2 == 0, self.version)
            for p in prompts
            for i in range(N)
        ]


def prompts(count: int) -> list[Prompt]:
    return [Prompt(example=None, token_ids=[i, i + 1]) for i in range(count)]


def schedule(max_staleness: int, engines: FakeEngines, seed: int = 3) -> RolloutSchedule:
    return RolloutSchedule(max_staleness, PromptSampler(prompts(10), seed), 4, engines)


def run(max_staleness: int, steps: int, engines: FakeEngines) -> list[tuple[int, list[list[int]], int]]:
    """The loop's use of the schedule: launch, take this step's batch, then (training; the weight sync moves the
    engines one version on) every batch ahead collected before the sync."""
    rollouts = schedule(max_staleness, engines)
    trained = []
    for step in range(steps):
        rollouts.launch(step, engines.version, last_step=steps - 1)
        batch = rollouts.wait(step)
        trained.append((step, [p.token_ids for p in batch.prompts], batch.policy_version))
        for later in rollouts.ahead(step):
            rollouts.wait(later)
        rollouts.trained(step)
        engines.version += 1  # the step's update reaches the engines after the generations launched before it
    return trained


def test_batch_t_is_sampled_by_the_weights_after_step_t_minus_1_minus_k():
    synchronous, one_off, two_off = FakeEngines(), FakeEngines(), FakeEngines()
    straight = run(0, 5, synchronous)
    assert [version for _, _, version in straight] == [0, 1, 2, 3, 4]
    assert synchronous.calls == [(t, t) for t in range(5)]
    ahead = run(1, 5, one_off)
    assert [version for _, _, version in ahead] == [0, 0, 1, 2, 3]  # batch t by the weights after step t − 2
    assert one_off.calls == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]  # nothing launched past the last step
    assert [version for _, _, version in run(2, 5, two_off)] == [0, 0, 0, 1, 2]
    # the prompts follow the batch, not the schedule: every mode trains on the same prompts in the same order
    assert [p for _, p, _ in ahead] == [p for _, p, _ in straight]


def test_generations_run_on_a_background_thread_one_at_a_time_in_batch_order():
    engines = FakeEngines()
    seen_threads = set()
    inner = engines.__call__

    def generate(prompts, step):
        seen_threads.add(threading.current_thread().name)
        return inner(prompts, step)

    rollouts = RolloutSchedule(1, PromptSampler(prompts(10), 3), 4, generate)
    rollouts.max_staleness = 3  # the schedule itself takes any depth (the config allows 0 or 1)
    rollouts.launch(0, 0, last_step=9)  # four batches queued at once
    assert [rollouts.wait(step).step for step in range(4)] == [0, 1, 2, 3]
    assert [step for step, _ in engines.calls] == [0, 1, 2, 3]
    assert threading.current_thread().name not in seen_threads
    assert all(r.generation_s > 0 and r.ended < float("inf") for r in rollouts.rollouts.values())


def test_a_failed_generation_raises_in_the_driver_abandons_the_next_and_a_relaunch_samples_them_again():
    engines = FakeEngines()
    engines.fail_step = 1
    rollouts = schedule(1, engines)
    rollouts.max_staleness = 2  # batches 0, 1 and 2 queued at once
    rollouts.launch(0, 0, last_step=9)
    assert rollouts.wait(0).completions
    with pytest.raises(RuntimeError, match="engine lost during batch 1"):
        rollouts.wait(1)
    with pytest.raises(GenerationAbandoned, match="batch 2"):
        rollouts.wait(2)
    assert [step for step, _ in engines.calls] == [0, 1]  # batch 2 never reached the engines
    engines.fail_step, engines.version = None, 1
    for step in (1, 2):
        rollouts.relaunch(step, policy_version=1)
    again = [rollouts.wait(step) for step in (1, 2)]
    assert [r.policy_version for r in again] == [1, 1] and {c.policy_version for r in again for c in r.completions} == {
        1
    }
    assert [step for step, _ in engines.calls] == [0, 1, 1, 2]


def test_a_checkpoint_of_the_batches_in_flight_restores_the_same_prompts_and_samples():
    engines = FakeEngines()
    rollouts = schedule(2, engines)
    rollouts.launch(0, 0, last_step=9)
    rollouts.wait(0)
    rollouts.trained(0)
    sampler, saved = rollouts.state()  # batches 1 and 2 in flight, generated
    assert [r.step for r in saved] == [1, 2]
    packed = pack_rollouts(saved)
    assert packed[0]["token_ids"].dtype == torch.int32 and packed[0]["lengths"].tolist() == [2] * 4 * N
    restored = schedule(2, FakeEngines())
    restored.sampler.next_batch(7)  # wherever the new sampler was: the checkpoint's state wins
    restored.load(sampler, unpack_rollouts(packed))
    for step in (1, 2):
        a, b = rollouts.rollouts[step], restored.rollouts[step]
        assert [p.token_ids for p in a.prompts] == [p.token_ids for p in b.prompts]
        assert a.completions == b.completions and a.policy_version == b.policy_version
    with pytest.raises(ValueError, match=r"trainer\.prompts_per_step it was made with"):
        RolloutSchedule(2, PromptSampler(prompts(10), 3), 3, FakeEngines()).load(sampler, unpack_rollouts(packed))
    # and the next prompts drawn are the ones the uninterrupted schedule draws next
    rollouts.launch(1, 1, last_step=9)
    restored.launch(1, 1, last_step=9)
    assert [p.token_ids for p in restored.wait(3).prompts] == [p.token_ids for p in rollouts.wait(3).prompts]
