import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from logra_rl.data import DataConfig, load_task
from logra_rl.rewards import get_reward_function
from tests.data.math_files import DAPO_PROBLEMS, MATH500_ROWS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "prepare_data.py"
VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@pytest.fixture(scope="module")
def prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _files(path) -> list:
    return load_task(DataConfig(task="files", train_files=[str(path)])).train


def _reward(example, response: str) -> float:
    return get_reward_function(example.reward)(response, example.answer, example.metadata)


def test_dapo_math_round_trips_through_the_files_task(prepare_data, dapo_file, tmp_path):
    out = prepare_data(["--task", "dapo_math", "--source", dapo_file, "--out", str(tmp_path / "dapo.parquet")])
    table = pq.read_table(out)
    assert table.column_names == VERL_COLUMNS
    row = table.to_pylist()[0]
    assert (row["data_source"], row["ability"], row["reward_model"]) == (
        "math_dapo",
        "math",
        {"style": "rule", "ground_truth": DAPO_PROBLEMS[0][1]},
    )
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["reward"] == "math"
    original = load_task(DataConfig(task="math", train_files=[dapo_file])).train
    loaded = _files(out)
    assert [(e.messages, e.answer, e.reward) for e in loaded] == [(e.messages, e.answer, e.reward) for e in original]
    assert all(e.metadata["source"] == "math_dapo" for e in loaded)
    assert [_reward(e, rf"so \boxed{{{e.answer}}}") for e in loaded] == [1.0] * len(DAPO_PROBLEMS)
    assert _reward(loaded[0], r"\boxed{999}") == 0.0


def test_math500_keeps_its_metadata_and_grades_its_solutions(prepare_data, math500_file, tmp_path):
    out = prepare_data(
        ["--task", "math500", "--source", math500_file, "--out", str(tmp_path / "m.parquet"), "--size", "3"]
    )
    loaded = _files(out)
    assert [e.answer for e in loaded] == [row["answer"] for row in MATH500_ROWS[:3]]
    for example, row in zip(loaded, MATH500_ROWS, strict=False):
        assert (example.metadata["source"], example.metadata["subject"]) == ("math500", row["subject"])
        assert _reward(example, row["solution"]) == 1.0
    assert pq.read_table(out).to_pylist()[0]["extra_info"]["split"] == "eval"


def test_the_reasoning_gym_hard_mixture_grades_with_its_own_scorers(prepare_data, tmp_path):
    out = prepare_data(
        ["--task", "reasoning_gym_hard", "--split", "eval", "--size", "16", "--out", str(tmp_path / "rg.parquet")]
    )
    loaded = _files(out)
    assert len(loaded) == 16 and {e.reward for e in loaded} == {"reasoning_gym"}
    assert all(e.metadata["dataset_config"] for e in loaded)
    for example in loaded:
        assert _reward(example, f"<answer>{example.answer}</answer>") == 1.0
        assert _reward(example, example.answer) == 0.0  # untagged: never scored
    rows = pq.read_table(out).to_pylist()
    assert {row["ability"] for row in rows} == {"reasoning"}
    assert json.loads(rows[0]["extra_info"]["metadata"])["dataset"] == loaded[0].metadata["dataset"]


def test_any_registered_task_with_settings(prepare_data, tmp_path):
    out = prepare_data(
        [
            "--task",
            "reasoning_gym",
            "--set",
            "reasoning_gym.datasets=[gcd]",
            "--size",
            "4",
            "--out",
            str(tmp_path / "g.parquet"),
        ]
    )
    assert [e.metadata["dataset"] for e in _files(out)] == ["gcd"] * 4
    loaded = _files(prepare_data(["--task", "quickstart", "--size", "5", "--out", str(tmp_path / "q.parquet")]))
    assert len(loaded) == 5 and all(e.reward == "exact_match" for e in loaded)
    assert all(_reward(e, e.answer) == 1.0 for e in loaded)
    with pytest.raises(SystemExit, match="--source is for"):
        prepare_data(["--task", "quickstart", "--source", "x", "--out", str(tmp_path / "x.parquet")])
