import pytest
from reasoning_gym import create_dataset

from logra_rl.data import DataConfig, load_task
from logra_rl.rewards import (
    exact_match_reward,
    final_text,
    get_reward_function,
    last_boxed,
    math_reward,
    math_verify_reward,
    reasoning_gym_reward,
    register_reward,
    strip_end_of_text,
    usable_answer,
)

ONE_DECIMAL_PLACE = {"min_num_decimal_places": 1, "max_num_decimal_places": 1}


def _unit_reward(response, answer, metadata):
    return 1.0


def test_registry_has_the_builtin_rewards_and_names_them_on_a_typo():
    assert get_reward_function("exact_match") is exact_match_reward
    assert get_reward_function("math") is math_reward
    assert get_reward_function("math_verify") is math_verify_reward is math_reward  # the old name is an alias
    assert get_reward_function("reasoning_gym") is reasoning_gym_reward
    with pytest.raises(ValueError, match=r"unknown reward 'math_verfy'.*'exact_match', 'math', 'math_verify', 'reason"):
        get_reward_function("math_verfy")


def test_import_path_rewards_resolve_and_bad_paths_are_named():
    assert get_reward_function("tests.rewards.test_graders:_unit_reward") is _unit_reward
    with pytest.raises(ValueError, match=r"cannot import 'missing' from 'tests\.rewards\.test_graders'"):
        get_reward_function("tests.rewards.test_graders:missing")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(_unit_reward)


def test_exact_match_strips_whitespace_and_end_of_text_markers():
    assert exact_match_reward("  42 <|im_end|>", " 42\n", {}) == 1.0
    assert exact_match_reward("42<|endoftext|></s>", "42", {}) == 1.0
    assert exact_match_reward("42.", "42", {}) == 0.0
    assert strip_end_of_text("a <|eot_id|>\n") == "a"


def test_last_boxed_takes_the_last_balanced_box():
    assert last_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off mid-answer
    assert last_boxed(r"\fbox{3} and \boxed{4}", "\\fbox") == "3"


def test_reasoning_gym_scores_tagged_answers_and_not_raw_text():
    dataset = create_dataset("basic_arithmetic", size=5, seed=7)
    for entry in dataset:
        metadata = {"dataset": "basic_arithmetic", "entry": entry}
        answer = entry["answer"]
        assert reasoning_gym_reward(f"Thinking...\n<answer>{answer}</answer>", answer, metadata) == 1.0
        assert reasoning_gym_reward(f"<answer>{int(answer) + 1}</answer>", answer, metadata) == 0.0
        # The dataset's own scoring passes through: a superstring of the answer gets partial credit.
        assert 0.0 < reasoning_gym_reward(f"<answer>{answer}1</answer>", answer, metadata) < 1.0
        raw = f"The answer is {answer}"
        assert dataset.score_answer(raw, entry) > 0  # reasoning-gym's own partial credit for raw text...
        assert reasoning_gym_reward(raw, answer, metadata) == 0.0  # ...which the reward never gives


def test_reasoning_gym_scores_with_the_generator_config():
    # decimal_arithmetic accepts answers within 10^-max_num_decimal_places: the config changes the score.
    config = DataConfig(
        task="reasoning_gym",
        train_size=3,
        eval_size=0,
        reasoning_gym={"datasets": ["decimal_arithmetic"], "config": {"decimal_arithmetic": ONE_DECIMAL_PLACE}},
    )
    for example in load_task(config).train:
        near = str(float(example.answer) + 0.05)
        assert reasoning_gym_reward(f"<answer>{near}</answer>", example.answer, example.metadata) == 1.0
        default_config = {**example.metadata, "dataset_config": {}}
        assert reasoning_gym_reward(f"<answer>{near}</answer>", example.answer, default_config) == 0.0


def test_reasoning_gym_names_missing_metadata():
    with pytest.raises(ValueError, match=r"needs metadata keys \['dataset', 'entry'\]"):
        reasoning_gym_reward("<answer>1</answer>", "1", {})


def test_final_text_grades_what_follows_the_thinking():
    assert final_text("<think>a</think>\n b <|im_end|>") == "b"
    assert final_text("the template opened it</think>b") == "b"  # `<think>` was in the prompt
    assert final_text("<think>a</think>b<think>c</think>d") == "d"
    assert final_text("<think>never closed") is None
    assert final_text("<think>never closed", grade_thinking=True) == "<think>never closed"
    assert final_text("no thinking at all") == "no thinking at all"


def test_thinking_earns_no_reward_in_any_builtin_reward():
    entry = next(iter(create_dataset("basic_arithmetic", size=1, seed=7)))
    metadata, answer = {"dataset": "basic_arithmetic", "entry": entry}, entry["answer"]
    inside = f"<think><answer>{answer}</answer></think> I do not know"
    assert reasoning_gym_reward(inside, answer, metadata) == 0.0
    assert reasoning_gym_reward(inside, answer, {**metadata, "grade_thinking": True}) == 1.0
    boxed = {**metadata, "answer_format": "boxed"}
    assert reasoning_gym_reward(f"<think>\\boxed{{0}}</think>\\boxed{{{answer}}}", answer, boxed) == 1.0
    assert reasoning_gym_reward(f"<think>\\boxed{{{answer}}}", answer, boxed) == 0.0
    assert exact_match_reward("<think>7</think>7", "7", {}) == 1.0
    assert exact_match_reward("<think>7", "7", {"grade_thinking": True}) == 0.0  # the tag is part of the text
    assert exact_match_reward("<think>7", "7", {}) == 0.0


def test_data_grade_thinking_reaches_every_example():
    datasets = {"datasets": ["basic_arithmetic"]}
    config = DataConfig(task="reasoning_gym", train_size=3, eval_size=2, reasoning_gym=datasets, grade_thinking=True)
    task = load_task(config)
    assert [e.metadata["grade_thinking"] for e in task.train + task.eval] == [True] * 5
    assert all("grade_thinking" not in e.metadata for e in load_task(DataConfig(task="quickstart")).train)
    with pytest.raises(ValueError, match=r"data\.grade_thinking"):
        DataConfig(grade_thinking="yes")


def test_usable_answer_is_each_graders_own_check_of_a_ground_truth():
    assert usable_answer("math", " 42 ") and usable_answer("math_verify", r"\frac{1}{2}")
    assert not usable_answer("math", " ") and not usable_answer("math", "???")  # math-verify reads nothing in it
    assert usable_answer("exact_match", "yes") and not usable_answer("exact_match", "\n")
    assert usable_answer("reasoning_gym", "")  # its scorers verify puzzles with many solutions without one
    assert usable_answer(f"{__name__}:_unit_reward", "")  # a grader of your own checks what it needs itself
