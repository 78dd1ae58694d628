"""Examples, tasks and the task registry.

A task turns a `DataConfig` into train and eval examples. Built-in tasks live in their own modules and
register themselves on import; `load_task` imports them on demand, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from logra_rl.data.config import DataConfig

TaskLoader = Callable[[DataConfig], "Task"]

_TASKS: dict[str, TaskLoader] = {}
BUILTIN_TASK_MODULES = (
    "logra_rl.data.files",
    "logra_rl.data.math",
    "logra_rl.data.reasoning_gym_task",
    "logra_rl.data.quickstart",
)


@dataclass(frozen=True)
class Example:
    """One prompt: chat messages, the reference answer, the reward that grades it, and what the grader needs.

    `metadata` holds plain JSON-serialisable values so an example pickles to Ray actors and grading processes.
    """

    messages: tuple[dict[str, str], ...]
    answer: str
    reward: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        if not self.messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in self.messages
        ):
            raise ValueError(
                f"example messages must be a non-empty list of {{role, content}} dicts, got {self.messages!r}"
            )
        if not isinstance(self.answer, str):
            raise ValueError(f"example answer must be a string, got {self.answer!r}")

    @property
    def question(self) -> tuple[tuple[str, str], ...]:
        """The prompt messages as a hashable key: two examples with the same key ask the same question."""
        return tuple((m["role"], m["content"]) for m in self.messages)


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]


def register_task(name: str) -> Callable[[TaskLoader], TaskLoader]:
    """Decorator: `load_task` calls `loader(config)` when `config.task == name`."""

    def decorator(loader: TaskLoader) -> TaskLoader:
        if name in _TASKS:
            raise ValueError(f"task {name!r} is already registered (by {_TASKS[name].__module__})")
        _TASKS[name] = loader
        return loader

    return decorator


def load_task(config: DataConfig) -> Task:
    """The examples of `config.task`; an unknown task raises ValueError listing the registered ones."""
    _import_builtin_tasks()
    if config.task not in _TASKS:
        raise ValueError(f"unknown task {config.task!r}; registered tasks are {sorted(_TASKS)} (set data.task=...)")
    task = _TASKS[config.task](config)
    if not task.train:
        raise ValueError(f"task {config.task!r} has no training examples; check data.train_files / data.train_size")
    if config.eval_unseen:
        task.eval = unseen(task.eval, task.train)
    if config.grade_thinking:  # the rewards read it from each example's metadata
        task.train = [replace(e, metadata={**e.metadata, "grade_thinking": True}) for e in task.train]
        task.eval = [replace(e, metadata={**e.metadata, "grade_thinking": True}) for e in task.eval]
    return task


def unseen(examples: list[Example], train: list[Example]) -> list[Example]:
    """The examples whose prompt messages no train example has (`data.eval_unseen`); the count dropped is printed."""
    seen = {example.question for example in train}
    kept = [example for example in examples if example.question not in seen]
    if len(kept) < len(examples):
        print(f"[logra] data.eval_unseen: dropped {len(examples) - len(kept)} eval examples the train set also has")
    if examples and not kept:
        raise ValueError(
            "data.eval_unseen=true dropped every eval example: the train set has them all; give eval examples of "
            "their own (data.val_files), a smaller data.train_size, or data.eval_unseen=false"
        )
    return kept


def _import_builtin_tasks() -> None:
    for module in BUILTIN_TASK_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise  # the task module exists but something it imports does not
