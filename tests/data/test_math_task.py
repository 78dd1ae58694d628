import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from logra_rl.data import DataConfig, load_task
from logra_rl.rewards import get_reward_function
from tests.data.math_files import DAPO_COPIES, DAPO_PROBLEMS, MATH500_ROWS

INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def _config(**values):
    return DataConfig(task="math", **values)


def test_dapo_math_trains_and_math500_evaluates(dapo_file, math500_file):
    task = load_task(_config(train_files=[dapo_file], val_files=[math500_file]))
    assert (task.name, len(task.train), len(task.eval)) == ("math", len(DAPO_PROBLEMS), len(MATH500_ROWS))
    # DAPO's repeated problems are kept once, and its "Answer:" instruction becomes the boxed template.
    for example, (problem, answer) in zip(task.train, DAPO_PROBLEMS, strict=True):
        assert example.messages == ({"role": "user", "content": problem + INSTRUCTION},)
        assert (example.answer, example.reward) == (answer, "math")
        assert example.metadata == {"source": "math_dapo", "data_source": "math_dapo"}
    for example, row in zip(task.eval, MATH500_ROWS, strict=True):
        assert example.messages == ({"role": "user", "content": row["problem"] + INSTRUCTION},)
        assert example.answer == row["answer"]
        assert example.metadata == {
            "subject": row["subject"],
            "level": row["level"],
            "unique_id": row["unique_id"],
            "data_source": "math500",  # named after the directory: the file is just "test"
            "source": "math500",
        }
        json.dumps(example.metadata)


def test_examples_grade_with_their_reward(dapo_file, math500_file):
    task = load_task(_config(train_files=[dapo_file], val_files=[math500_file]))
    for example in task.eval:
        reward = get_reward_function(example.reward)
        solutions = [row["solution"] for row in MATH500_ROWS]
        own = next(s for s, row in zip(solutions, MATH500_ROWS, strict=True) if row["answer"] == example.answer)
        assert reward(own, example.answer, example.metadata) == 1.0
        assert sum(reward(s, example.answer, example.metadata) for s in solutions) == 1.0
    for example in task.train:  # DAPO's own "Answer:" line still grades
        assert get_reward_function(example.reward)(f"...\n\nAnswer: {example.answer}", example.answer, {}) == 1.0


def test_sizes_and_system_prompt(dapo_file, math500_file):
    config = _config(train_files=[dapo_file], val_files=[math500_file], train_size=2, eval_size=1, system_prompt="S")
    task = load_task(config)
    assert (len(task.train), len(task.eval)) == (2, 1)
    assert task.train[0].messages[0] == {"role": "system", "content": "S"}
    assert load_task(_config(train_files=[dapo_file])).eval == []


def test_string_prompts_and_other_chat_prompts(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "reward_model": {"ground_truth": "4"}, "data_source": "plain"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3? Box it."}],
         "reward_model": {"ground_truth": "6"}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    string_prompt, chat_prompt = load_task(_config(train_files=[str(path)])).train
    assert string_prompt.messages == ({"role": "user", "content": "What is 2+2?" + INSTRUCTION},)
    assert chat_prompt.messages == tuple(rows[1]["prompt"])  # already an instruction: kept as it is
    assert (string_prompt.metadata["source"], chat_prompt.metadata["source"]) == ("plain", "mixed")


def test_a_saved_dataset_dict_gives_train_and_test_splits(tmp_path):
    def split(rows):
        return datasets.Dataset.from_list(rows)

    directory = str(tmp_path / "saved")
    datasets.DatasetDict({"train": split(MATH500_ROWS[:3]), "test": split(MATH500_ROWS[3:])}).save_to_disk(directory)
    task = load_task(_config(train_files=[directory], val_files=[directory]))
    assert [e.answer for e in task.train] == [row["answer"] for row in MATH500_ROWS[:3]]
    assert [e.answer for e in task.eval] == [MATH500_ROWS[3]["answer"]]
    assert task.eval[0].metadata["source"] == "saved"

    odd = str(tmp_path / "odd")
    datasets.DatasetDict({"first": split(MATH500_ROWS), "second": split(MATH500_ROWS)}).save_to_disk(odd)
    with pytest.raises(ValueError, match=r"has splits \['first', 'second'\] and none of \['train'\] for train"):
        load_task(_config(train_files=[odd]))


def test_bad_sources_are_named_with_the_fix(tmp_path, dapo_file):
    missing = str(tmp_path / "nope" / "train.parquet")
    with pytest.raises(FileNotFoundError, match=f"data source {missing} does not exist; give a local"):
        load_task(_config(train_files=[missing]))
    with pytest.raises(ValueError, match=r"task 'math' needs data.train_files: a hub id \(e.g. \[BytedTsinghua"):
        load_task(_config())
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "q", "final": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"neither 'prompt' and 'reward_model.ground_truth'.*nor 'problem' and 'an"):
        load_task(_config(train_files=[str(plain)]))
    assert load_task(_config(train_files=[str(plain)], prompt_key="question", answer_key="final")).train
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(ValueError, match=f"data file {empty} has no records"):
        load_task(_config(train_files=[dapo_file], val_files=[empty]))
    with pytest.raises(ValueError, match="unsupported extension"):
        (tmp_path / "data.csv").write_text("problem,answer\n")
        load_task(_config(train_files=[str(tmp_path / "data.csv")]))


def test_a_hub_id_that_cannot_be_loaded_says_so():
    assert datasets.config.HF_HUB_OFFLINE  # tests/conftest.py: the hub is never contacted
    with pytest.raises(ValueError, match="'nobody-here/no-such-dataset' is not a local path and could not be loaded"):
        load_task(_config(train_files=["nobody-here/no-such-dataset"]))


def test_repeated_problems_are_kept_once_per_source(dapo_file):
    records = datasets.load_dataset("parquet", data_files=dapo_file, split="train")
    assert len(records) == len(DAPO_PROBLEMS) * DAPO_COPIES
    assert len(load_task(_config(train_files=[dapo_file, dapo_file])).train) == 2 * len(DAPO_PROBLEMS)
