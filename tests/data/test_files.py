import json

import datasets
import pytest

from logra_rl.data import DataConfig, load_task

VERL_RECORDS = [
    {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i},
    }
    for i in range(10)
]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _files_config(**values):
    return DataConfig(task="files", **values)


def test_verl_schema_in_jsonl_and_parquet(tmp_path):
    jsonl = _write_jsonl(tmp_path / "train.jsonl", VERL_RECORDS)
    parquet = str(tmp_path / "val.parquet")
    datasets.Dataset.from_list(VERL_RECORDS[:3]).to_parquet(parquet)
    task = load_task(_files_config(train_files=[jsonl], val_files=[parquet]))
    assert (task.name, len(task.train), len(task.eval)) == ("files", 10, 3)
    example = task.train[4]
    assert example.messages == ({"role": "user", "content": "What is 4 + 4?"},)
    assert (example.answer, example.reward) == ("8", "math")
    assert example.metadata == {"source": "gsm8k", "data_source": "gsm8k", "file": jsonl, "index": 4}
    assert task.eval[2].answer == "4" and task.eval[2].metadata["file"] == parquet


def test_plain_schema_string_prompts_and_system_prompt(tmp_path):
    path = _write_jsonl(
        tmp_path / "plain.jsonl", [{"input": "Say hi", "output": "hi"}, {"input": "Say yo", "output": 7}]
    )
    config = _files_config(
        train_files=path, prompt_key="input", answer_key="output", reward="exact_match", system_prompt="Be brief."
    )
    task = load_task(config)
    assert task.train[0].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"})
    assert [e.answer for e in task.train] == ["hi", "7"]
    assert task.train[0].reward == "exact_match"
    assert task.train[0].metadata["data_source"] == "plain"  # no data_source column: the file name
    assert task.eval == []  # no val_files and no eval_size


def test_system_prompt_replaces_a_records_own(tmp_path):
    record = {"prompt": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}], "answer": "1"}
    path = _write_jsonl(tmp_path / "sys.jsonl", [record])
    task = load_task(_files_config(train_files=[path], answer_key="answer", system_prompt="new"))
    assert task.train[0].messages == ({"role": "system", "content": "new"}, {"role": "user", "content": "q"})


def test_without_val_files_eval_size_holds_out_a_seeded_slice(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", VERL_RECORDS)
    task = load_task(_files_config(train_files=[path], eval_size=3, seed=1))
    again = load_task(_files_config(train_files=[path], eval_size=3, seed=1))
    train, eval_ = [e.answer for e in task.train], [e.answer for e in task.eval]
    assert len(train) == 7 and len(eval_) == 3 and not set(train) & set(eval_)
    assert [e.answer for e in again.eval] == eval_
    assert len(load_task(_files_config(train_files=[path], eval_size=3, train_size=4)).train) == 4
    with pytest.raises(ValueError, match="would hold out all 10 training records"):
        load_task(_files_config(train_files=[path], eval_size=10))


def test_missing_file_is_named(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match=f"data file {missing} does not exist"):
        load_task(_files_config(train_files=[missing]))
    with pytest.raises(ValueError, match="unsupported extension"):
        load_task(_files_config(train_files=[str(tmp_path / "data.csv")]))
    with pytest.raises(ValueError, match=r"data\.train_files is required by the chosen config \(data\.task is files\)"):
        load_task(_files_config())
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no records"):
        load_task(_files_config(train_files=[str(tmp_path / "empty.jsonl")]))


def test_missing_key_names_the_keys_that_exist(tmp_path):
    path = _write_jsonl(tmp_path / "plain.jsonl", [{"input": "q", "output": "a"}])
    with pytest.raises(ValueError, match=r"no key 'prompt'; the record has \['input', 'output'\]"):
        load_task(_files_config(train_files=[path]))
    verl = _write_jsonl(tmp_path / "verl.jsonl", VERL_RECORDS)
    with pytest.raises(
        ValueError, match=r"no key 'reward_model.answer'.*'reward_model.style', 'reward_model.ground_truth'"
    ):
        load_task(_files_config(train_files=[verl], answer_key="reward_model.answer"))


def test_malformed_prompts_and_unknown_rewards_are_named(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "q"}], "answer": "a"}])
    with pytest.raises(ValueError, match="must be a string or a list of"):
        load_task(_files_config(train_files=[path], answer_key="answer"))
    good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "q", "answer": "a"}])
    with pytest.raises(ValueError, match="unknown reward 'mathverify'"):
        load_task(_files_config(train_files=[good], answer_key="answer", reward="mathverify"))


def test_a_prepared_files_extra_info_sets_reward_and_grader_metadata(tmp_path):
    records = [
        {**VERL_RECORDS[0], "extra_info": {"reward": "exact_match", "metadata": '{"source": "toy", "k": [1]}'}},
        {**VERL_RECORDS[1], "extra_info": {"reward": None, "metadata": None}},
    ]
    path = _write_jsonl(tmp_path / "prepared.jsonl", records)
    first, second = load_task(_files_config(train_files=[path])).train
    assert (first.reward, first.metadata["source"], first.metadata["k"]) == ("exact_match", "toy", [1])
    assert (second.reward, second.metadata["source"]) == ("math", "gsm8k")
    assert load_task(_files_config(train_files=[path], reward="math")).train[0].reward == "math"  # config wins
    bad = [{**VERL_RECORDS[0], "extra_info": {"reward": "os:system"}}]
    with pytest.raises(ValueError, match=r"record 0: extra_info.reward='os:system' is an import path"):
        load_task(_files_config(train_files=[_write_jsonl(tmp_path / "bad.jsonl", bad)]))
    bad = [{**VERL_RECORDS[0], "extra_info": {"metadata": "[1, 2]"}}]
    with pytest.raises(ValueError, match=r"extra_info\.metadata must be a JSON object string"):
        load_task(_files_config(train_files=[_write_jsonl(tmp_path / "bad2.jsonl", bad)]))


def test_empty_answers_are_named_in_one_line_and_a_file_of_only_empty_ones_is_refused(tmp_path, capsys):
    records = [{**r, "reward_model": {"ground_truth": " "}} if i in (3, 7) else r for i, r in enumerate(VERL_RECORDS)]
    path = _write_jsonl(tmp_path / "some_empty.jsonl", records)
    task = load_task(_files_config(train_files=[path]))
    assert len(task.train) == 10  # kept: their responses are counted in reward/bad_ground_truths
    [line] = capsys.readouterr().out.splitlines()
    assert line == (
        f"[logra] data file {path}: 2 of 10 records have an empty 'reward_model.ground_truth' (records 3, 7); "
        "their responses score 0 (counted in reward/bad_ground_truths). Fix the data file"
    )
    empty = _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": f"q{i}", "answer": ""} for i in range(3)])
    with pytest.raises(ValueError, match=rf"^data file {empty}: every record's 'answer' is empty"):
        load_task(_files_config(train_files=[empty], answer_key="answer"))


def test_empty_answers_of_graders_that_need_none_pass_quietly(tmp_path, capsys):
    records = [{"prompt": "solve the cube", "answer": "", "extra_info": {"reward": "reasoning_gym"}}]
    load_task(_files_config(train_files=[_write_jsonl(tmp_path / "cube.jsonl", records)], answer_key="answer"))
    assert capsys.readouterr().out == ""
