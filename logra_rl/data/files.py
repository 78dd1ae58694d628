"""Task `files`: prompts and answers from local jsonl/json/parquet files (verl's schema or a plain one).

Files written by scripts/tools/prepare_data.py carry what their grader needs in `extra_info`: `reward` (a registered
reward name, used unless data.reward is set) and `metadata` (a JSON object, e.g. a reasoning-gym entry), so a
prepared file of any task grades as that task did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.parquet as pq

from logra_rl.data.config import DataConfig
from logra_rl.data.task import Example, Task, register_task
from logra_rl.rewards import get_reward_function, usable_answer

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
DEFAULT_REWARD = "math"


@register_task("files")
def load_files_task(config: DataConfig) -> Task:
    get_reward_function(config.reward or DEFAULT_REWARD)
    train = [e for path in config.train_files for e in _read_examples(path, config)]
    if config.val_files:
        eval_ = [e for path in config.val_files for e in _read_examples(path, config)]
    elif config.eval_size:
        if config.eval_size >= len(train):
            raise ValueError(
                f"data.eval_size={config.eval_size} would hold out all {len(train)} training records; "
                "lower it or give data.val_files"
            )
        held_out = set(np.random.default_rng(config.seed).permutation(len(train))[: config.eval_size].tolist())
        eval_ = [e for i, e in enumerate(train) if i in held_out]
        train = [e for i, e in enumerate(train) if i not in held_out]
    else:
        eval_ = []
    return Task(name="files", train=train[: config.train_size], eval=eval_[: config.eval_size])


def read_records(path: str) -> datasets.Dataset:
    """A local data file's records; a missing or empty file is an error naming it (`datasets` fails obscurely)."""
    file_format = FILE_FORMATS.get(Path(path).suffix.lower())
    if file_format is None:
        raise ValueError(f"data file {path}: unsupported extension; use one of {sorted(FILE_FORMATS)}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path} does not exist; check data.train_files / data.val_files")
    if file_format == "parquet":
        empty = pq.read_metadata(path).num_rows == 0
    else:
        with open(path) as lines:
            empty = not any(line.strip() for line in lines)
    if empty:
        raise ValueError(f"data file {path} has no records; check the path, or the script that wrote it")
    return datasets.load_dataset(file_format, data_files=path, split="train")


def _read_examples(path: str, config: DataConfig) -> list[Example]:
    records = read_records(path)
    for key in (config.prompt_key, config.answer_key):
        lookup(records[0], key, path, 0)  # fail on a wrong key before reading every record
    examples, checked_rewards = [], {config.reward or DEFAULT_REWARD}
    for index, record in enumerate(records):
        messages = chat_messages(lookup(record, config.prompt_key, path, index), path, index, config)
        answer = lookup(record, config.answer_key, path, index)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(
                f"data file {path}, record {index}: answer {answer!r} at {config.answer_key!r} is not text"
            )
        data_source = record.get("data_source") or Path(path).stem
        extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
        reward = config.reward or extra.get("reward") or DEFAULT_REWARD
        if reward not in checked_rewards:
            _check_record_reward(reward, path, index)
            checked_rewards.add(reward)
        metadata = {
            "source": data_source,
            **extra_metadata(record, path, index),
            "data_source": data_source,
            "file": path,
            "index": index,
        }
        examples.append(Example(messages=messages, answer=str(answer), reward=reward, metadata=metadata))
    check_answers(examples, path, config.answer_key)
    return examples


def check_answers(examples: list[Example], path: str, key: str) -> None:
    """Refuse a file whose every ground truth is empty, and name the records of one with some: their responses
    score 0 whatever they say (counted in reward/bad_ground_truths), which trains on nothing. Graders that need
    no ground truth (reasoning-gym's puzzles with many solutions) are left out."""
    empty = [i for i, e in enumerate(examples) if not e.answer.strip() and not usable_answer(e.reward, e.answer)]
    if len(empty) == len(examples):
        raise ValueError(
            f"data file {path}: every record's {key!r} is empty, so no response can earn a reward; check "
            "data.answer_key, or the script that wrote the file"
        )
    if empty:
        rows = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        print(
            f"[logra] data file {path}: {len(empty)} of {len(examples)} records have an empty {key!r} (records "
            f"{rows}); their responses score 0 (counted in reward/bad_ground_truths). Fix the data file"
        )


def extra_metadata(record: dict[str, Any], path: str, index: int) -> dict[str, Any]:
    """The grader metadata scripts/tools/prepare_data.py stores as a JSON object string at `extra_info.metadata`."""
    extra = record.get("extra_info")
    text = extra.get("metadata") if isinstance(extra, dict) else None
    if text is None:
        return {}
    try:
        metadata = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        metadata = None
    if not isinstance(metadata, dict):
        raise ValueError(f"data file {path}, record {index}: extra_info.metadata must be a JSON object string")
    return metadata


def _check_record_reward(name: str, path: str, index: int) -> None:
    """A file may name registered rewards only: an import path in data would let a file choose code to run."""
    if ":" in name:
        raise ValueError(
            f"data file {path}, record {index}: extra_info.reward={name!r} is an import path; a file may only "
            "name a registered reward (give import paths with data.reward)"
        )
    try:
        get_reward_function(name)
    except ValueError as error:
        raise ValueError(f"data file {path}, record {index}: extra_info.reward: {error}") from error


def lookup(record: dict[str, Any], key: str, path: str, index: int) -> Any:
    """`record[a][b]` for key `a.b`; a missing key names the keys the record has."""
    value: Any = record
    for part in key.split("."):
        if not (isinstance(value, dict) and part in value):
            raise ValueError(
                f"data file {path}, record {index}: no key {key!r}; the record has {_key_paths(record)} "
                "(set data.prompt_key / data.answer_key)"
            )
        value = value[part]
    if value is None:
        raise ValueError(f"data file {path}, record {index}: {key!r} is null")
    return value


def _key_paths(record: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in record.items():
        paths.extend(_key_paths(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])
    return paths


def chat_messages(prompt: Any, path: str, index: int, config: DataConfig) -> tuple[dict[str, str], ...]:
    """A plain string is one user message; a list must be chat messages with role and content."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(
            f"data file {path}, record {index}: {config.prompt_key!r} must be a string or a list of "
            f"{{role, content}} messages, got {prompt!r:.200}"
        )
    if config.system_prompt is not None:
        if messages[0]["role"] == "system":
            messages = messages[1:]
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    return tuple(messages)
