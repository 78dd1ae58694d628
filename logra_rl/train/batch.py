"""The tensors a TrainWorker trains on: built from the engines' completions, split into token-budgeted
microbatches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from logra_rl.rollout import Completion


@dataclass
class TrainBatch:
    """Right-padded rows of prompt + response. Per-token tensors are aligned with `input_ids`:
    `loss_mask[b, t]` marks response token t, `rollout_logprobs[b, t]` is its sampling log-prob."""

    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L) float
    rollout_logprobs: torch.Tensor  # (B, L) float
    advantages: torch.Tensor  # (B,) float
    finished: torch.Tensor  # (B,) bool: the response ended with end-of-turn (Completion.finished)
    old_logprobs: torch.Tensor | None = None  # (B, L): π at the start of the step, for PPO epochs
    # (B,) long: the policy version that sampled each row (Completion.policy_version); None: the current policy
    policy_version: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice | torch.Tensor) -> TrainBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: None if v is None else v[index] for k, v in values.items()})

    def trimmed(self) -> TrainBatch:
        """Drop trailing columns that are padding in every row."""
        length = int(self.attention_mask.sum(dim=1).max())
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(
            **{k: v if v is None or v.dim() == 1 else v[:, :length].contiguous() for k, v in values.items()}
        )

    def microbatches(self, max_tokens: int) -> list[TrainBatch]:
        """Consecutive rows packed greedily so each microbatch holds at most `max_tokens` padded tokens
        (a single longer row is its own microbatch)."""
        lengths = self.attention_mask.sum(dim=1).tolist()
        batches, start, widest = [], 0, 0
        for end, length in enumerate(lengths):
            widest_with = max(widest, length)
            if end > start and widest_with * (end - start + 1) > max_tokens:
                batches.append(self.rows(slice(start, end)).trimmed())
                start, widest_with = end, length
            widest = widest_with
        batches.append(self.rows(slice(start, len(lengths))).trimmed())
        return batches


def pack_batch(completions: Sequence[Completion], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Right-padded prompt + response rows; response positions carry the loss mask and sampling log-probs."""
    rows = [c.prompt_ids + c.token_ids for c in completions]
    shape = (len(rows), max(len(r) for r in rows))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape)
    rollout_logprobs = torch.zeros(shape)
    for i, (row, c) in enumerate(zip(rows, completions, strict=True)):
        start = len(c.prompt_ids)
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        loss_mask[i, start : len(row)] = 1
        rollout_logprobs[i, start : len(row)] = torch.tensor(c.logprobs)
    finished = torch.tensor([c.finished for c in completions])
    versions = torch.tensor([c.policy_version for c in completions], dtype=torch.long)
    return TrainBatch(
        input_ids, attention_mask, loss_mask, rollout_logprobs, advantages, finished, policy_version=versions
    )
