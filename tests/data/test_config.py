import pytest
from omegaconf import OmegaConf

from logra_rl.data import DataConfig


def test_from_dict_accepts_an_omegaconf_node_and_a_single_file():
    node = OmegaConf.create({"task": "files", "train_files": "train.jsonl", "reward": "exact_match", "seed": 3})
    config = DataConfig.from_dict(node)
    assert (config.task, config.train_files, config.val_files, config.reward, config.seed) == (
        "files",
        ["train.jsonl"],
        [],
        "exact_match",
        3,
    )
    assert (config.prompt_key, config.answer_key) == ("prompt", "reward_model.ground_truth")


def test_defaults():
    config = DataConfig()
    assert config.task == "quickstart"
    assert (config.reward, config.system_prompt, config.train_size, config.eval_size) == (None, None, None, None)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"train_file": ["a.jsonl"]}, r"unknown key\(s\) \['data.train_file'\]"),
        ({"reasoning_gym": {"dataset": ["gcd"]}}, r"unknown key\(s\) \['data.reasoning_gym.dataset'\]"),
        ({"seed": -1}, "seed=-1"),
        ({"train_size": 2.5}, "train_size=2.5"),
        ({"task": ""}, "task=''"),
        ({"train_files": [1]}, "train_files="),
        ({"reward": 3}, "reward=3"),
        ({"reasoning_gym": ["gcd"]}, "reasoning_gym="),
    ],
)
def test_bad_values_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict(values)
