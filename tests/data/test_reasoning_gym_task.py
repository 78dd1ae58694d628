import dataclasses
import json
import pickle
from collections import Counter

import pytest

from logra_rl.data import DataConfig, load_task
from logra_rl.data.reasoning_gym_task import HARD_MIXTURE
from logra_rl.rewards import reasoning_gym_reward


def _config(**values):
    return DataConfig(task="reasoning_gym", **values)


def test_single_dataset_train_and_eval_are_disjoint_and_deterministic():
    config = _config(reasoning_gym={"datasets": ["basic_arithmetic"]}, train_size=60, eval_size=20, seed=3)
    task = load_task(config)
    assert (task.name, len(task.train), len(task.eval)) == ("reasoning_gym", 60, 20)
    train_questions = {e.metadata["entry"]["question"] for e in task.train}
    assert not train_questions & {e.metadata["entry"]["question"] for e in task.eval}
    assert [e.messages for e in load_task(config).train] == [e.messages for e in task.train]
    other_seed = load_task(dataclasses.replace(config, seed=4))
    assert [e.messages for e in other_seed.train] != [e.messages for e in task.train]


def test_examples_instruct_answer_tags_and_carry_what_the_grader_needs():
    task = load_task(_config(reasoning_gym={"datasets": {"gcd": 1.0}}, train_size=5, eval_size=2, system_prompt="S"))
    for example in task.train + task.eval:
        system, user = example.messages
        assert system == {"role": "system", "content": "S"}
        assert user["content"].startswith(example.metadata["entry"]["question"])
        assert "<answer></answer>" in user["content"]
        assert (example.reward, example.metadata["dataset"]) == ("reasoning_gym", "gcd")
        json.dumps(example.metadata)
        copy = pickle.loads(pickle.dumps(example))
        assert reasoning_gym_reward(f"<answer>{copy.answer}</answer>", copy.answer, copy.metadata) == 1.0
        assert reasoning_gym_reward(copy.answer, copy.answer, copy.metadata) == 0.0  # no tags


def test_boxed_answer_format_asks_for_and_grades_the_last_box():
    spec = {"datasets": ["gcd"], "answer_format": "boxed"}
    task = load_task(_config(reasoning_gym=spec, train_size=4, eval_size=2))
    for example in task.train + task.eval:
        [user] = example.messages
        assert user["content"].endswith("Put your final answer within \\boxed{}.") and "<answer>" not in user["content"]
        answer = example.answer
        assert reasoning_gym_reward(f"so \\boxed{{0}} then \\boxed{{{answer}}}", answer, example.metadata) == 1.0
        assert reasoning_gym_reward(f"<answer>{answer}</answer>", answer, example.metadata) == 0.0  # no box
        assert reasoning_gym_reward(f"\\boxed{{{answer}}} or \\boxed{{-1}}", answer, example.metadata) == 0.0


def test_weighted_mixture_samples_by_weight():
    spec = {"datasets": {"basic_arithmetic": 3.0, "gcd": 1.0}, "config": {"gcd": {"max_value": 50}}}
    task = load_task(_config(reasoning_gym=spec, train_size=200, eval_size=40))
    counts = Counter(e.metadata["dataset"] for e in task.train)
    assert set(counts) == {"basic_arithmetic", "gcd"}
    assert 110 < counts["basic_arithmetic"] < 190
    arithmetic = {e.metadata["entry"]["question"] for e in task.train if e.metadata["dataset"] == "basic_arithmetic"}
    assert not arithmetic & {e.metadata["entry"]["question"] for e in task.eval}
    gcd = [e for e in task.train if e.metadata["dataset"] == "gcd"]
    assert all(e.metadata["dataset_config"] == {"max_value": 50} for e in gcd)
    assert all(reasoning_gym_reward(f"<answer>{e.answer}</answer>", e.answer, e.metadata) == 1.0 for e in task.train)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "needs data.reasoning_gym.datasets"),
        ({"datasets": ["basic_arithmetc"]}, r"unknown reasoning-gym dataset 'basic_arithmetc' \(did you mean"),
        ({"datasets": {"gcd": 0}}, "a weight must be > 0"),
        ({"datasets": ["gcd"], "config": {"lcm": {}}}, "not in data.reasoning_gym.datasets"),
        ({"datasets": ["gcd"], "config": {"gcd": {"max_valu": 5}}}, r"unknown or reserved key\(s\) \['max_valu'\]"),
        ({"datasets": ["gcd"], "config": {"gcd": {"seed": 5}}}, r"unknown or reserved key\(s\) \['seed'\]"),
        ({"datasets": ["gcd"], "config": {"gcd": {"min_value": 0}}}, "config.gcd=.* is invalid"),
        ({"datasets": "hardd"}, r"unknown reasoning-gym preset 'hardd'; presets are \['hard'\]"),
        ({"datasets": ["gcd"], "answer_format": "xml"}, r"answer_format='xml' is invalid; choose one of \['boxed'"),
        ({"datasets": "hard", "config": {"maze": {"max_dst": 3}}}, r"config.maze: unknown or reserved key\(s\) \['max"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        load_task(_config(reasoning_gym=spec, train_size=2, eval_size=1))


def test_the_hard_preset_mixes_eight_tasks_whose_reference_answers_score_one():
    spec = {"datasets": "hard", "config": {"maze": {"max_dist": 20}}}  # the user's keys override the preset's
    task = load_task(_config(reasoning_gym=spec, train_size=48, eval_size=16))
    assert {e.metadata["dataset"] for e in task.train} == set(HARD_MIXTURE)
    for example in task.train + task.eval:
        name = example.metadata["dataset"]
        expected = {**HARD_MIXTURE[name], "max_dist": 20} if name == "maze" else HARD_MIXTURE[name]
        assert example.metadata["dataset_config"] == expected
        assert example.metadata["source"] == f"reasoning_gym/{name}"
        tagged = f"<answer>{example.answer}</answer>"
        assert reasoning_gym_reward(tagged, example.answer, example.metadata) == 1.0, name


def test_the_eval_split_does_not_depend_on_train_size():
    small, large = (_config(reasoning_gym={"datasets": ["gcd"]}, train_size=n, eval_size=5) for n in (3, 50))
    assert [e.messages for e in load_task(small).eval] == [e.messages for e in load_task(large).eval]


def test_eval_unseen_holds_out_only_questions_the_train_set_lacks():
    # one-digit products: 100 questions, all of which 1000 train examples ask; a plain eval repeats them
    spec = {"datasets": ["products"], "config": {"products": {"min_digits": 1, "max_digits": 1}}}
    plain = load_task(_config(reasoning_gym=spec, train_size=1000, eval_size=10))
    train_questions = {e.question for e in plain.train}
    assert len(train_questions) == 100 and all(e.question in train_questions for e in plain.eval)
    small_space = _config(reasoning_gym=spec, train_size=1000, eval_size=10, eval_unseen=True)
    with pytest.raises(ValueError, match=r"question space is too small for data.eval_size=10: lower data.train_size"):
        load_task(small_space)
    # two-digit sums: 8100 questions; the unseen eval keeps the plain eval's unseen items, in order, and fills up
    spec = {"datasets": ["chain_sum"], "config": {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 2}}}
    spec["config"]["chain_sum"]["max_digits"] = 2
    plain = load_task(_config(reasoning_gym=spec, train_size=2000, eval_size=200))
    unseen = load_task(_config(reasoning_gym=spec, train_size=2000, eval_size=200, eval_unseen=True))
    train_questions = {e.question for e in unseen.train}
    assert len(unseen.eval) == 200 and not {e.question for e in unseen.eval} & train_questions
    kept = [e.question for e in plain.eval if e.question not in train_questions]
    assert 0 < len(kept) < 200 and [e.question for e in unseen.eval][: len(kept)] == kept
