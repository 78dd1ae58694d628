"""Task `files`: prompts and answers from local jsonl/json/parquet files (verl's schema or a plain one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np

from logra_rl.data.config import DataConfig
from logra_rl.data.task import Example, Task, register_task
from logra_rl.rewards import get_reward_function

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@register_task("files")
def load_files_task(config: DataConfig) -> Task:
    if not config.train_files:
        raise ValueError("task 'files' needs data.train_files, e.g. data.train_files=[data/train.parquet]")
    reward = config.reward or "math_verify"
    get_reward_function(reward)
    train = [e for path in config.train_files for e in _read_examples(path, config, reward)]
    if config.val_files:
        eval_ = [e for path in config.val_files for e in _read_examples(path, config, reward)]
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


def _read_examples(path: str, config: DataConfig, reward: str) -> list[Example]:
    file_format = FILE_FORMATS.get(Path(path).suffix.lower())
    if file_format is None:
        raise ValueError(f"data file {path}: unsupported extension; use one of {sorted(FILE_FORMATS)}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path} does not exist; check data.train_files / data.val_files")
    records = datasets.load_dataset(file_format, data_files=path, split="train")
    if len(records) == 0:
        raise ValueError(f"data file {path} has no records")
    for key in (config.prompt_key, config.answer_key):
        _lookup(records[0], key, path, 0)  # fail on a wrong key before reading every record
    data_source = Path(path).stem
    examples = []
    for index, record in enumerate(records):
        messages = _messages(_lookup(record, config.prompt_key, path, index), path, index, config)
        answer = _lookup(record, config.answer_key, path, index)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(
                f"data file {path}, record {index}: answer {answer!r} at {config.answer_key!r} is not text"
            )
        metadata = {"data_source": record.get("data_source") or data_source, "file": path, "index": index}
        examples.append(Example(messages=messages, answer=str(answer), reward=reward, metadata=metadata))
    return examples


def _lookup(record: dict[str, Any], key: str, path: str, index: int) -> Any:
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


def _messages(prompt: Any, path: str, index: int, config: DataConfig) -> tuple[dict[str, str], ...]:
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
