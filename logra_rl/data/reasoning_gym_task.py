"""Task `reasoning_gym`: procedurally generated problems, graded by each dataset's own scorer.

Train and eval are generated with disjoint seed ranges: reasoning-gym draws item i of a dataset seeded s
from `Random(s + i)`, so seeds s and s+1 share all but one item. Train uses seed s for items [0, train_size)
and eval uses seed s + EVAL_SEED_OFFSET, which never reuses a train item's generator while train_size stays
below the offset, and keeps the eval set the same whatever train_size is (tiny problem spaces can still repeat
a question by chance). In a mixture, the composite picks item i's dataset with `Random(s + i)` and seeds its
k-th dataset s + k + 1, so the pick and the item are drawn from different generators.

`data.reasoning_gym.datasets: hard` names the preset HARD_MIXTURE: eight tasks at settings above their
defaults, chosen so each generates an item in a few milliseconds (docs/data.md has the table);
`data.reasoning_gym.config.<name>` keys override the preset's settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from reasoning_gym import create_dataset
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.factory import DATASETS

from logra_rl.data.config import DataConfig
from logra_rl.data.task import Example, Task, register_task
from logra_rl.rewards import get_reward_function

DEFAULT_TRAIN_SIZE = 10_000
DEFAULT_EVAL_SIZE = 200
EVAL_SEED_OFFSET = 10**9  # below 2**32 with the seed: one dataset seeds numpy with seed + index
UNSEEN_DRAWS = 20  # data.eval_unseen: at most this many eval draws per eval example kept
# The "hard" mixture: equal weights; every reference answer scores 1.0 with its own scorer.
HARD_MIXTURE = {
    "arc_1d": {"min_size": 25, "max_size": 40},  # above 40 one of its generators can loop forever
    "cryptarithm": {"min_words": 3, "max_words": 5},
    "kakurasu": {"min_rows": 6, "max_rows": 7, "min_cols": 6, "max_cols": 7},
    "knights_knaves": {"n_people": 4, "depth_constraint": 3, "width_constraint": 3},
    "maze": {"min_dist": 15, "max_dist": 25, "min_grid_size": 15, "max_grid_size": 25},
    "mini_sudoku": {"min_empty": 10, "max_empty": 12},
    "string_manipulation": {"min_string_length": 20, "max_string_length": 40, "min_num_rules": 8, "max_num_rules": 12},
    "word_ladder": {"min_word_length": 5, "max_word_length": 5},
}
PRESETS = {"hard": HARD_MIXTURE}
ANSWER_INSTRUCTIONS = {
    "tags": "Give your final answer inside <answer></answer> tags, with nothing else inside the tags.",
    "boxed": "Put your final answer within \\boxed{}.",
}


@register_task("reasoning_gym")
def load_reasoning_gym_task(config: DataConfig) -> Task:
    weights, generator_kwargs = _mixture(config.reasoning_gym)
    answer_format = config.reasoning_gym.get("answer_format", "tags")
    if answer_format not in ANSWER_INSTRUCTIONS:
        raise ValueError(
            f"data.reasoning_gym.answer_format={answer_format!r} is invalid; "
            f"choose one of {sorted(ANSWER_INSTRUCTIONS)}"
        )
    reward = config.reward or "reasoning_gym"
    get_reward_function(reward)
    train_size = DEFAULT_TRAIN_SIZE if config.train_size is None else config.train_size
    eval_size = DEFAULT_EVAL_SIZE if config.eval_size is None else config.eval_size
    common = generator_kwargs, config, reward, answer_format
    train = list(_generate(weights, config.seed, train_size, *common))
    draws = _generate(weights, config.seed + EVAL_SEED_OFFSET, UNSEEN_DRAWS * eval_size, *common)
    if not config.eval_unseen:
        return Task(name="reasoning_gym", train=train, eval=list(itertools.islice(draws, eval_size)))
    # draw eval items in order, skipping the train set's questions, until eval_size remain
    seen = {example.question for example in train}
    eval_ = list(itertools.islice((e for e in draws if e.question not in seen), eval_size))
    if len(eval_) < eval_size:
        raise ValueError(
            f"data.eval_unseen: only {len(eval_)} of {UNSEEN_DRAWS * eval_size} eval draws ask a question the "
            f"{train_size} train examples do not; the question space is too small for data.eval_size={eval_size}: "
            "lower data.train_size or data.eval_size, or widen the generator's settings"
        )
    return Task(name="reasoning_gym", train=train, eval=eval_)


def _mixture(spec: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(name → weight, name → generator kwargs) from `data.reasoning_gym`, with every name checked."""
    datasets = spec.get("datasets")
    generator_kwargs = dict(spec.get("config") or {})
    if isinstance(datasets, str):
        if datasets not in PRESETS:
            raise ValueError(
                f"unknown reasoning-gym preset {datasets!r}; presets are {sorted(PRESETS)}, or give a list of "
                "dataset names or a mapping name → weight"
            )
        preset = PRESETS[datasets]
        user_kwargs, datasets = generator_kwargs, list(preset)
        generator_kwargs = {name: {**kwargs, **user_kwargs.get(name, {})} for name, kwargs in preset.items()}
        generator_kwargs |= {name: kwargs for name, kwargs in user_kwargs.items() if name not in preset}
    if isinstance(datasets, list | tuple):
        datasets = dict.fromkeys(datasets, 1.0)
    if not isinstance(datasets, Mapping) or not datasets:
        raise ValueError(
            "task 'reasoning_gym' needs data.reasoning_gym.datasets: a list of names, a mapping name → weight, "
            f"e.g. data.reasoning_gym.datasets={{basic_arithmetic: 1.0, gcd: 0.5}}, or a preset {sorted(PRESETS)}"
        )
    for name in [*datasets, *generator_kwargs]:
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(str(name), DATASETS, n=3)
            raise ValueError(
                f"unknown reasoning-gym dataset {name!r}"
                + (f" (did you mean {close}?)" if close else "")
                + f"; available: {sorted(set(DATASETS) - {'composite'})}"
            )
    for name, kwargs in generator_kwargs.items():
        if name not in datasets:
            raise ValueError(f"data.reasoning_gym.config has {name!r}, which is not in data.reasoning_gym.datasets")
        _check_generator_kwargs(name, kwargs)
    for name, weight in datasets.items():
        if not (isinstance(weight, int | float) and weight > 0):
            raise ValueError(f"data.reasoning_gym.datasets.{name}={weight!r} is invalid; a weight must be > 0")
    return {name: float(w) for name, w in datasets.items()}, {name: dict(kw) for name, kw in generator_kwargs.items()}


def _check_generator_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Build the dataset's config once so a bad kwarg fails here, named, rather than deep in generation."""
    config_cls = DATASETS[name][1]
    valid = sorted({f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"})
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"data.reasoning_gym.config.{name}: unknown or reserved key(s) {unknown} (seed and size come from "
            f"data.seed / data.train_size / data.eval_size); valid keys are {valid}"
        )
    try:
        generator_config = config_cls(**kwargs)
        if hasattr(generator_config, "validate"):  # a few configs have no validate()
            generator_config.validate()
    except AssertionError as error:  # reasoning-gym validates configs with asserts
        raise ValueError(f"data.reasoning_gym.config.{name}={dict(kwargs)} is invalid: {error}") from error


def _generate(
    weights: dict[str, float],
    seed: int,
    size: int,
    generator_kwargs: dict[str, dict[str, Any]],
    config: DataConfig,
    reward: str,
    answer_format: str,
) -> Iterator[Example]:
    """Items 0..size-1 of the dataset seeded `seed`, as examples, each generated when it is read."""
    if size == 0:
        return
    if len(weights) == 1:
        [name] = weights
        dataset = create_dataset(name, **generator_kwargs.get(name, {}), seed=seed, size=size)
    else:
        specs = [DatasetSpec(name=name, weight=w, config=generator_kwargs.get(name, {})) for name, w in weights.items()]
        dataset = create_dataset("composite", datasets=specs, seed=seed, size=size)
    for i in range(size):
        yield _example(dataset[i], generator_kwargs, config, reward, answer_format)


def _example(
    entry: dict[str, Any],
    generator_kwargs: dict[str, dict[str, Any]],
    config: DataConfig,
    reward: str,
    answer_format: str,
) -> Example:
    name = entry["metadata"]["source_dataset"]
    messages = [{"role": "user", "content": f"{entry['question']}\n\n{ANSWER_INSTRUCTIONS[answer_format]}"}]
    if config.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    # A few datasets (e.g. rubiks_cube, rush_hour) have no single reference answer: their scorers verify.
    answer = "" if entry["answer"] is None else str(entry["answer"])
    metadata = {
        "data_source": f"reasoning_gym/{name}",
        "source": f"reasoning_gym/{name}",
        "dataset": name,
        "dataset_config": generator_kwargs.get(name, {}),
        "entry": entry,
        "answer_format": answer_format,
    }
    return Example(messages=tuple(messages), answer=answer, reward=reward, metadata=metadata)
