"""The CPU quickstart task: name the next digit (mod 10).

The prompt is `"{a}+1=?"`, the answer the single digit (a + 1) mod 10, graded by exact match.
The quickstart's base model (`logra_rl.models.tiny.build_quickstart_model`) is pre-trained on
the answer *format* only — a digit, then end of turn — with random digits, so a fresh policy
answers at chance (1 in 10) and everything above that is learned by RL.
"""

from __future__ import annotations

import random

from logra_rl.data.config import DataConfig
from logra_rl.data.task import Example, Task, register_task

ALPHABET = "0123456789+=?"
DEFAULT_TRAIN_SIZE = 1000


def prompt_text(a: int) -> str:
    return f"{a}+1=?"


def example(a: int, reward: str) -> Example:
    return Example(
        messages=({"role": "user", "content": prompt_text(a)},),
        answer=str((a + 1) % 10),
        reward=reward,
        metadata={"a": a},
    )


@register_task("quickstart")
def load_quickstart(config: DataConfig) -> Task:
    rng = random.Random(config.seed)
    reward = config.reward or "exact_match"
    train = [example(rng.randrange(10), reward) for _ in range(config.train_size or DEFAULT_TRAIN_SIZE)]
    evaluation = [example(a, reward) for a in range(10)][: config.eval_size or 10]
    return Task(name="quickstart", train=train, eval=evaluation)
