"""Data configuration (the `data` group of the Hydra config; verl's key names where the meaning matches)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from logra_rl.utils.structs import check, check_positive_int, check_required, from_mapping

REASONING_GYM_KEYS = ("datasets", "config", "answer_format")


@dataclass(frozen=True)
class DataConfig:
    """Which prompts to train and evaluate on, and how to grade them.

    task: a registered task name: `files` (local jsonl/parquet), `math` (DAPO-Math / MATH-500: hub ids, local
        directories or files), `reasoning_gym` (procedural), `quickstart`. docs/data.md describes each.
    train_files / val_files (task `files`): local .jsonl/.json/.parquet paths; one string is one file.
        verl's schema works as is: `prompt` (chat messages, or a plain string → one user message) and the answer
        at `reward_model.ground_truth`; `data_source` is kept in the metadata when present. With no val_files,
        `eval_size` records are held out of the training files (a seeded random slice), or eval is empty when
        `eval_size` is unset.
    prompt_key / answer_key: where the prompt and the reference answer live in a record; dotted paths walk
        into nested records (`reward_model.ground_truth`). A plain schema: prompt_key=input answer_key=output.
    reward: the reward function name (see logra_rl.rewards); None → the task's default (`math` for files and
        math — or a prepared file's own `extra_info.reward` — and `reasoning_gym` for reasoning_gym).
    grade_thinking: grade the whole response, `<think>...</think>` included. Off (the default), only what follows
        the last `</think>` earns a reward and a response whose thinking never closes has no answer (every
        built-in reward; docs/data.md).
    system_prompt: prepended as a system message to every prompt (replacing a record's own system message).
    seed: generator seed (reasoning_gym) and hold-out split seed (files).
    train_size / eval_size: how many examples; None → all records (files) or 10000 / 200 (reasoning_gym).
    eval_unseen: hold out only questions the train set does not contain: an eval example whose prompt messages
        equal a train example's is dropped (the count is printed); task `reasoning_gym` draws further eval items
        until `eval_size` unseen ones remain. Off, a small question space (one-digit products: 100 questions)
        shares questions between the two sets and the eval measures recall as well as generalisation.
    max_prompt_length / max_response_length: tokens (verl's names); longer prompts are dropped at start (the
        count is printed), responses are cut at max_response_length (and count in response_length/clip_ratio).
    reasoning_gym (task `reasoning_gym`): `datasets` is a list of reasoning-gym names (equal weights), a
        mapping name → sampling weight (several names make a weighted mixture), or the preset `hard` (eight
        tasks at hard settings); the optional `config` maps a name to its generator kwargs, e.g.
        `{"datasets": {"basic_arithmetic": 1.0, "gcd": 0.5}, "config": {"gcd": {"max_value": 1000}}}`;
        `answer_format` is what the prompt asks for: `tags` (`<answer></answer>`, the default) or `boxed`
        (`\\boxed{}`, what math-tuned and small instruct models tend to write); the reward reads the same.
    """

    task: str = "quickstart"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    reward: str | None = None
    grade_thinking: bool = False
    system_prompt: str | None = None
    seed: int = 42
    train_size: int | None = None
    eval_size: int | None = None
    eval_unseen: bool = False
    reasoning_gym: dict[str, Any] = field(default_factory=dict)
    max_prompt_length: int = 1024
    max_response_length: int = 4096

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            files = [value] if isinstance(value, str) else list(value)
            check(all(isinstance(f, str) and f for f in files), f"data.{name}", value, "give a list of file paths")
            object.__setattr__(self, name, files)
        check_required(self.task != "files" or bool(self.train_files), "data.train_files", "data.task is files")
        for name in ("task", "prompt_key", "answer_key"):
            value = getattr(self, name)
            check(isinstance(value, str) and bool(value), f"data.{name}", value, "give a non-empty string")
        for name in ("reward", "system_prompt"):
            value = getattr(self, name)
            check(value is None or isinstance(value, str), f"data.{name}", value, "give a string or null")
        for name in ("grade_thinking", "eval_unseen"):
            check(isinstance(getattr(self, name), bool), f"data.{name}", getattr(self, name), "give true or false")
        check(isinstance(self.seed, int) and self.seed >= 0, "data.seed", self.seed, "give a non-negative integer")
        for name in ("train_size", "eval_size"):
            value = getattr(self, name)
            ok = value is None or (isinstance(value, int) and value >= 0)
            check(ok, f"data.{name}", value, "give a non-negative integer or null")
        for name in ("max_prompt_length", "max_response_length"):
            check_positive_int(f"data.{name}", getattr(self, name))
        check(
            isinstance(self.reasoning_gym, Mapping),
            "data.reasoning_gym",
            self.reasoning_gym,
            f"give a mapping with keys {list(REASONING_GYM_KEYS)}",
        )
        unknown = sorted(set(self.reasoning_gym) - set(REASONING_GYM_KEYS))
        if unknown:
            raise ValueError(
                f"config: unknown key(s) {['data.reasoning_gym.' + k for k in unknown]}; valid keys are "
                f"{['data.reasoning_gym.' + k for k in REASONING_GYM_KEYS]}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataConfig:
        """Build from a plain mapping (an OmegaConf node as a container); unknown keys are an error."""
        return from_mapping(cls, values, "data.")
