"""The tensors a TrainWorker trains on, and their split into token-budgeted microbatches."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TrainBatch:
    """Right-padded rows of prompt + response. Per-token tensors are aligned with `input_ids`:
    `loss_mask[b, t]` marks response token t, `rollout_logprobs[b, t]` is its sampling log-prob."""

    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L) float
    rollout_logprobs: torch.Tensor  # (B, L) float
    advantages: torch.Tensor  # (B,) float
    completed: torch.Tensor  # (B,) bool: the response ended with end-of-turn
    old_logprobs: torch.Tensor | None = None  # (B, L): π at the start of the step, for PPO epochs

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
