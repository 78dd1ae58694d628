"""A run's prompts, tokenised once with the policy's chat template: what the engines are asked to continue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from logra_rl.data.config import DataConfig
from logra_rl.data.task import Example, load_task

if TYPE_CHECKING:  # transformers takes seconds to import: a command that stops on a bad setting never needs it
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    example: Example
    token_ids: list[int]


@dataclass(frozen=True)
class Workload:
    """The task's train and eval prompts under one tokenizer."""

    task_name: str
    tokenizer: Any  # a transformers tokenizer (decodes responses for grading)
    train: list[Prompt]
    eval: list[Prompt]

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest train or eval prompt (what generation buffers are sized for)."""
        return max(len(prompt.token_ids) for prompt in (*self.train, *self.eval))

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id


def load_workload(config: DataConfig, model_path: str) -> Workload:
    """Load the task and tokenise its prompts; train prompts longer than `max_prompt_length` are dropped."""
    from transformers import AutoTokenizer

    task = load_task(config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train = encode_prompts(tokenizer, task.train, config.max_prompt_length, "train")
    if not train:
        raise ValueError(f"every train prompt is longer than data.max_prompt_length={config.max_prompt_length} tokens")
    return Workload(task.name, tokenizer, train, encode_prompts(tokenizer, task.eval, config.max_prompt_length, "eval"))


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int, split: str
) -> list[Prompt]:
    prompts, too_long = [], 0
    for example in examples:
        encoded = tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True)
        ids = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
        if len(ids) > max_length:
            too_long += 1
            continue
        prompts.append(Prompt(example, ids))
    if too_long:
        print(f"[logra] dropped {too_long} {split} prompts longer than data.max_prompt_length={max_length}")
    return prompts
