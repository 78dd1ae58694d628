r"""Task `math`: competition math graded by the `math` reward — DAPO-Math-17k to train, MATH-500 to evaluate.

Each entry of data.train_files / data.val_files is a hub dataset id (`BytedTsinghua-SIA/DAPO-Math-17k`,
`HuggingFaceH4/MATH-500`; fetched by `datasets` when the run starts, so only when you name one), a local directory
(a `save_to_disk` copy or a hub snapshot), or a local .parquet / .jsonl / .json file. Two record layouts are read:

- verl / DAPO-Math: the prompt at data.prompt_key (chat messages or a plain string) and the answer at
  data.answer_key (default `prompt` and `reward_model.ground_truth`); `data_source` names the source.
- MATH: `problem` and `answer` (MATH-500 adds `solution`, `subject`, `level`, `unique_id`).

Prompts ask for step-by-step reasoning and the answer in `\boxed{}` (PROMPT_TEMPLATE). A bare problem (MATH, or a
string prompt) is put into the template; DAPO-Math's own instruction (final line "Answer: ...") is swapped for the
template so training and evaluation ask for one answer format; other chat prompts (e.g. files written by
scripts/tools/prepare_data.py) are kept as they are. DAPO-Math-17k stores each of its ~17.9k problems 100 times: a
repeated (problem, answer) pair is kept once. Metadata: `source` (for per-source eval breakdowns) = `data_source`,
plus `subject` and `level` when the record has them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import datasets

from logra_rl.data.config import DataConfig
from logra_rl.data.files import FILE_FORMATS, chat_messages, extra_metadata, lookup, read_records
from logra_rl.data.task import Example, Task, register_task
from logra_rl.rewards import get_reward_function

DAPO_MATH = "BytedTsinghua-SIA/DAPO-Math-17k"
MATH_500 = "HuggingFaceH4/MATH-500"
PROMPT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
SPLIT_NAMES = {"train": ("train",), "eval": ("test", "validation", "eval")}  # preferred DatasetDict splits
METADATA_KEYS = ("subject", "level", "unique_id")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_GENERIC_STEMS = {"train", "test", "validation", "eval", "data"}


@register_task("math")
def load_math_task(config: DataConfig) -> Task:
    """Train on every data.train_files source, evaluate on every data.val_files source (none: no eval)."""
    if not config.train_files:
        raise ValueError(
            f"task 'math' needs data.train_files: a hub id (e.g. [{DAPO_MATH}]), a local directory or "
            f"parquet/jsonl files; data.val_files likewise (e.g. [{MATH_500}])"
        )
    reward = config.reward or "math"
    get_reward_function(reward)
    train = [e for source in config.train_files for e in load_math_examples(source, "train", config, reward)]
    eval_ = [e for source in config.val_files for e in load_math_examples(source, "eval", config, reward)]
    return Task(name="math", train=train[: config.train_size], eval=eval_[: config.eval_size])


def load_math_examples(source: str, split: str, config: DataConfig, reward: str = "math") -> list[Example]:
    """The examples of one source; `split` ("train" or "eval") picks the split of a multi-split dataset."""
    dataset, where = _open(source, split)
    if len(dataset) == 0:
        raise ValueError(f"data source {where} has no records; check the path or split")
    layout = _layout(dataset[0], config, where)
    name = _source_name(source)
    examples, seen = [], set()
    for index, record in enumerate(_records(dataset)):
        prompt, answer = (lookup(record, key, where, index) for key in layout)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"data source {where}, record {index}: answer {answer!r} is not text")
        messages = _messages(prompt, where, index, config)
        key = (tuple((m["role"], m["content"]) for m in messages), str(answer))
        if key in seen:
            continue
        seen.add(key)
        data_source = record.get("data_source") or name
        metadata = {
            **extra_metadata(record, where, index),
            **{k: record[k] for k in METADATA_KEYS if record.get(k) is not None},
            "data_source": data_source,
            "source": data_source,
        }
        examples.append(Example(messages=messages, answer=str(answer).strip(), reward=reward, metadata=metadata))
    return examples


def _open(source: str, split: str) -> tuple[datasets.Dataset, str]:
    """(the records, how to name them in errors): a local file or directory, else a hub id."""
    path = Path(source)
    if path.is_file():
        return read_records(source), source
    if path.is_dir():
        saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
        loaded = datasets.load_from_disk(source) if saved else datasets.load_dataset(source)
    elif _HUB_ID.fullmatch(source) and path.suffix.lower() not in FILE_FORMATS:
        try:
            loaded = datasets.load_dataset(source)
        except Exception as error:
            raise ValueError(
                f"data source {source!r} is not a local path and could not be loaded from the Hugging Face hub "
                f"({type(error).__name__}: {error}); check the id and the network, or give a local copy "
                "(scripts/tools/prepare_data.py writes one)"
            ) from error
    else:
        raise FileNotFoundError(
            f"data source {source} does not exist; give a local .parquet/.jsonl/.json file or directory, "
            f"or a hub id such as {DAPO_MATH}"
        )
    if isinstance(loaded, datasets.Dataset):
        return loaded, source
    names = list(loaded)
    chosen = names[0] if len(names) == 1 else next((n for n in SPLIT_NAMES[split] if n in loaded), None)
    if chosen is None:
        raise ValueError(
            f"data source {source} has splits {names} and none of {list(SPLIT_NAMES[split])} for {split}; "
            "save the split you want to a parquet file and give its path"
        )
    return loaded[chosen], f"{source} (split {chosen!r})"


def _records(dataset: datasets.Dataset):
    """Rows as dicts, read in batches (row-by-row reading of the 1.79M-row DAPO-Math file is much slower)."""
    for batch in dataset.iter(batch_size=4096):
        yield from (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))


def _layout(record: dict[str, Any], config: DataConfig, where: str) -> tuple[str, str]:
    """(prompt key, answer key): data.prompt_key / answer_key when the record has them, else MATH's columns."""
    for keys in [(config.prompt_key, config.answer_key), ("problem", "answer")]:
        try:
            for key in keys:
                lookup(record, key, where, 0)
        except ValueError:
            continue
        return keys
    raise ValueError(
        f"data source {where}: records have neither {config.prompt_key!r} and {config.answer_key!r} (verl / "
        f"DAPO-Math layout) nor 'problem' and 'answer' (MATH layout); their keys are {sorted(record)} "
        "(set data.prompt_key / data.answer_key)"
    )


def _messages(prompt: Any, where: str, index: int, config: DataConfig) -> tuple[dict[str, str], ...]:
    """A bare problem goes into the template, and so does the problem inside DAPO-Math's own instruction."""
    if isinstance(prompt, str):
        prompt = PROMPT_TEMPLATE.format(problem=prompt.strip())
    messages = list(chat_messages(prompt, where, index, config))
    last = messages[-1]["content"]
    if last.startswith(DAPO_PREFIX) and last.endswith(DAPO_SUFFIX):
        problem = last[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)].strip()
        messages[-1] = {**messages[-1], "content": PROMPT_TEMPLATE.format(problem=problem)}
    return tuple(messages)


def _source_name(source: str) -> str:
    """`math-500` for HuggingFaceH4/MATH-500 or .../math-500/test.parquet: what `source` says when records don't."""
    path = Path(source)
    name = path.stem if path.suffix.lower() in FILE_FORMATS else path.name
    if name.lower() in _GENERIC_STEMS and path.parent.name:
        name = path.parent.name
    return name.lower()
