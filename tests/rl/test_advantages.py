import pytest
import torch

from logra_rl.rl import RunningBaseline, group_advantages, length_weighted, prompt_hash


def test_running_baseline_uses_only_previous_batches():
    baseline = RunningBaseline(weight=0.1, failure_reward=-0.01)
    first = baseline.advantages(torch.tensor([1.0, 0.0]))
    assert first.tolist() == pytest.approx([1.0, -0.01])
    assert baseline.value == pytest.approx(0.0495)  # 0.1 · mean(1, −0.01)
    second = baseline.advantages(torch.tensor([1.0, 0.3]))  # partial credit below 1 is a failure
    assert second.tolist() == pytest.approx([1 - 0.0495, -0.01 - 0.0495])


def test_invalid_rows_do_not_move_the_baseline():
    baseline = RunningBaseline()
    advantages = baseline.advantages(torch.tensor([1.0, float("nan")]), valid=torch.tensor([True, False]))
    assert advantages.tolist() == [1.0, 0.0]
    assert baseline.value == pytest.approx(0.1)
    with pytest.raises(FloatingPointError):
        baseline.advantages(torch.tensor([float("nan")]))


def test_length_weighting_after_the_baseline_update():
    baseline = RunningBaseline()
    baseline.value = 0.2
    advantages = length_weighted(baseline.advantages(torch.tensor([1.0, 0.0])), torch.tensor([2, 6]), 1024)
    assert baseline.value == pytest.approx(0.2295)  # 0.9·0.2 + 0.1·0.495: lengths do not bias b
    assert advantages.tolist() == pytest.approx([0.8 * 512, -0.21 * 1024 / 6])


def test_grpo_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=3, normalize_std=False)
    assert advantages.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    normalised = group_advantages(rewards, group_size=3)
    assert normalised[:3].std().item() == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(rewards, group_size=4)


def test_a_per_prompt_baseline_follows_each_prompts_own_outcomes():
    baseline = RunningBaseline(weight=0.5, failure_reward=0.0, per_prompt=True)
    baseline.value = 0.2
    solved, unsolved, new = [5, 1], [5, 2], [7]  # each row's prompt token ids
    first = baseline.advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), prompts=[solved, solved, unsolved, unsolved])
    assert first.tolist() == pytest.approx([0.8, 0.8, -0.2, 0.8])  # both start from the batch-wide 0.2
    assert baseline.prompt_values == pytest.approx({prompt_hash(solved): 0.6, prompt_hash(unsolved): 0.35})
    assert baseline.value == pytest.approx(0.475)  # the batch-wide one moves as before
    second = baseline.advantages(torch.tensor([1.0, 1.0, 1.0]), prompts=[solved, unsolved, new])
    assert second.tolist() == pytest.approx([0.4, 0.65, 0.525])  # a new prompt starts from the batch-wide one


def test_a_per_prompt_baseline_skips_invalid_rows_needs_prompts_and_survives_a_checkpoint():
    baseline = RunningBaseline(weight=0.5, failure_reward=0.0, per_prompt=True)
    baseline.advantages(torch.tensor([1.0, float("nan")]), valid=torch.tensor([True, False]), prompts=[[1], [2]])
    assert baseline.prompt_values == {prompt_hash([1]): 0.5}  # the invalid row's prompt keeps no baseline
    with pytest.raises(ValueError, match="needs each row's prompt"):
        baseline.advantages(torch.tensor([1.0]))
    restored = RunningBaseline(weight=0.5, failure_reward=0.0, per_prompt=True)
    restored.load_state_dict(baseline.state_dict())
    rewards, prompts = torch.tensor([0.0, 1.0]), [[1], [3]]
    after_restore = restored.advantages(rewards, prompts=prompts)
    assert after_restore.tolist() == baseline.advantages(rewards, prompts=prompts).tolist()
    old = RunningBaseline()
    old.load_state_dict({"value": 0.3})  # a checkpoint from before per-prompt baselines
    assert (old.value, old.prompt_values) == (0.3, {})


def test_a_batch_wide_baseline_ignores_the_prompts():
    rewards = torch.tensor([1.0, 0.0, 1.0])
    assert (
        RunningBaseline().advantages(rewards, prompts=[[1], [1], [2]]).tolist()
        == RunningBaseline().advantages(rewards).tolist()
    )


def test_prompt_hashes_tell_prompts_apart_and_are_stable():
    assert prompt_hash([1, 2, 3]) == prompt_hash([1, 2, 3])
    assert prompt_hash([1, 2, 3]) != prompt_hash([12, 3])
    assert len(prompt_hash(list(range(10_000)))) == 16
