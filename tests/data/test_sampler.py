import itertools

import pytest

from logra_rl.data import Example, PromptSampler

EXAMPLES = [
    Example(messages=({"role": "user", "content": str(i)},), answer=str(i), reward="exact_match") for i in range(7)
]


def _answers(batch):
    return [e.answer for e in batch]


def test_each_epoch_is_a_fresh_permutation():
    sampler = PromptSampler(EXAMPLES, seed=0)
    epochs = [_answers(sampler.next_batch(7)) for _ in range(3)]
    assert all(sorted(epoch) == sorted(e.answer for e in EXAMPLES) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    assert _answers(PromptSampler(EXAMPLES, seed=0).next_batch(21)) == list(itertools.chain(*epochs))
    assert _answers(PromptSampler(EXAMPLES, seed=1).next_batch(21)) != list(itertools.chain(*epochs))


def test_a_resumed_sampler_continues_with_the_same_prompts():
    sampler = PromptSampler(EXAMPLES, seed=5)
    sampler.next_batch(3)
    sampler.next_batch(3)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (0, 6)
    expected = [_answers(sampler.next_batch(3)) for _ in range(5)]  # crosses two epoch boundaries

    resumed = PromptSampler(EXAMPLES, seed=5)
    resumed.load_state_dict(state)
    assert [_answers(resumed.next_batch(3)) for _ in range(5)] == expected
    assert resumed.state_dict() == sampler.state_dict()
    assert next(iter(resumed)).answer == sampler.next_batch(1)[0].answer


def test_bad_use_is_named():
    with pytest.raises(ValueError, match="at least one example"):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError, match="batch size must be positive"):
        PromptSampler(EXAMPLES, seed=0).next_batch(0)
    state = PromptSampler(EXAMPLES, seed=0).state_dict()
    with pytest.raises(ValueError, match="resume with the same data config"):
        PromptSampler(EXAMPLES[:5], seed=0).load_state_dict(state)
