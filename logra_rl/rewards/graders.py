"""Reward functions: `fn(response, answer, metadata) -> float` in [0, 1], looked up by name.

A name is either registered (`exact_match` and `reasoning_gym` here, `math` and its alias `math_verify` in
logra_rl.rewards.math, or your own via `register_reward`) or an import path `package.module:function`, so a
custom grader also resolves inside a fresh grading process. A grader that gives up on an item at its own
time limit raises GraderTimeout: the pool scores it 0 and counts it as a timeout. A registered grader that
grades against the answer text names the answers it can use (`answer_check`), so a blank or unreadable ground
truth is counted (`reward/bad_ground_truths`) instead of silently scoring every response to it 0.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

RewardFunction = Callable[[str, str, Mapping[str, Any]], float]

_REWARDS: dict[str, RewardFunction] = {}
_ANSWER_CHECKS: dict[str, Callable[[str], bool]] = {}  # reward name -> whether it can grade against an answer
# Tokens a decoder may leave at the end of a response when it is not told to skip special tokens.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
END_OF_TEXT_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>", "<|end|>")


class GraderTimeout(Exception):
    """A grader stopped itself at its time limit (the item scores 0 and counts in `reward/grader_timeouts`)."""


def register_reward(
    name: str, answer_check: Callable[[str], bool] | None = None
) -> Callable[[RewardFunction], RewardFunction]:
    """Decorator: make `fn` available as `name` (in a config's `reward` field). `answer_check(answer)` says
    whether `fn` can grade against a ground truth (none: a grader that verifies without one, as reasoning-gym's
    scorers of puzzles with many solutions do)."""

    def decorator(fn: RewardFunction) -> RewardFunction:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered (by {_REWARDS[name].__module__})")
        _REWARDS[name] = fn
        if answer_check is not None:
            _ANSWER_CHECKS[name] = answer_check
        return fn

    return decorator


def usable_answer(reward: str, answer: str) -> bool:
    """Whether the grader `reward` can grade against the ground truth `answer` (its `answer_check`; True for
    graders without one). Against one it cannot use, a response scores 0 whatever it says."""
    check = _ANSWER_CHECKS.get(reward)
    return check is None or check(answer)


def not_blank(answer: str) -> bool:
    return bool(answer.strip())


def get_reward_function(name: str) -> RewardFunction:
    """The reward function called `name`, or the function at import path `module:function`."""
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r}: cannot import {attribute!r} from {module_name!r} ({error})") from error
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(
        f"unknown reward {name!r}; registered rewards are {sorted(_REWARDS)}, "
        "or give an import path 'package.module:function'"
    )


def strip_end_of_text(response: str) -> str:
    """The response without surrounding whitespace and trailing end-of-text markers."""
    text = response.strip()
    while marker := next((m for m in END_OF_TEXT_MARKERS if text.endswith(m)), None):
        text = text[: -len(marker)].rstrip()
    return text


def final_text(response: str, grade_thinking: bool = False) -> str | None:
    """The part of `response` a reward grades: what follows the thinking, end-of-text markers off.

    Text inside `<think>...</think>` earns nothing: only what follows the last `</think>` counts (a chat template
    may open the thinking in the prompt, so a lone `</think>` counts too), and a response whose thinking never
    closes has no answer (None). `grade_thinking` keeps the whole response (data.grade_thinking).
    """
    text = strip_end_of_text(response)
    if grade_thinking:
        return text
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :].strip()
    return None if THINK_OPEN in text else text


def last_boxed(text: str, command: str = "\\boxed") -> str | None:
    r"""Content of the last `\boxed{...}` (or `command{...}`; balanced braces), or None if none or it is unclosed."""
    start = text.rfind(command + "{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len(command) + 1
    for i in range(content_start - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[content_start:i]
    return None


@register_reward("exact_match", answer_check=not_blank)
def exact_match_reward(response: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the stripped response (after any thinking) is exactly the stripped answer."""
    return float(final_text(response, metadata.get("grade_thinking", False)) == answer.strip())


@cache
def _reasoning_gym_dataset(name: str, config_json: str):
    """A dataset instance to score with (scoring never depends on its seed or size, only on its config)."""
    from reasoning_gym import create_dataset

    return create_dataset(name, **json.loads(config_json))


@register_reward("reasoning_gym")
def reasoning_gym_reward(response: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """The dataset's own `score_answer` on the text inside the last `<answer>` tags (or the last `\\boxed{}`
    when the prompt asked for it: metadata `answer_format: boxed`) after any thinking; no tags scores 0.

    `metadata` carries `dataset` (the reasoning-gym name), `entry` (its question/answer/metadata record) and
    optionally `dataset_config` (the generator kwargs: some scorers read them). Raw text is never passed to
    the scorer: reasoning-gym gives partial credit to near-misses such as a whole sentence containing the answer.
    """
    # imported here: reasoning-gym (1.2 s, matplotlib) would load in every grading process of every reward
    from reasoning_gym.utils import extract_answer

    missing = [key for key in ("dataset", "entry") if key not in metadata]
    if missing:
        raise ValueError(
            f"reasoning_gym reward needs metadata keys {missing} (have {sorted(metadata)}); "
            "build examples with the reasoning_gym task"
        )
    text = final_text(response, metadata.get("grade_thinking", False))
    if text is None:
        extracted = None
    elif metadata.get("answer_format", "tags") == "boxed":
        extracted = last_boxed(text)
    else:
        extracted = extract_answer(text, tag_name="answer")
    if extracted is None:
        return 0.0
    config_json = json.dumps(metadata.get("dataset_config", {}), sort_keys=True)
    dataset = _reasoning_gym_dataset(metadata["dataset"], config_json)
    return float(dataset.score_answer(answer=extracted, entry=metadata["entry"]))
