"""The LM head's input, made contiguous before the product."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _contiguous_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0].contiguous(), *args[1:])


def fold_head_inputs(model: nn.Module) -> None:
    """Give the LM head a contiguous input. HF models apply the head to `hidden[:, -k:, :]` (`logits_to_keep`,
    which generation and the trainer's hidden-state pass use), a strided slice of a batch; torch's matmul then
    cannot fold the rows into one GEMM, broadcasts the (vocab × hidden) weight over the batch and copies it:
    rows × vocab × hidden elements, 1.9 GB for 4 rows of Qwen2.5-1.5B in bf16, for a (rows × vocab) result.
    A contiguous copy of the slice costs rows × hidden."""
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Module):
        head.register_forward_pre_hook(_contiguous_input)
