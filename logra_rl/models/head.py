"""The LM head as the policy applies it (soft-cap included), and its input made contiguous before the product."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from logra_rl.utils.shards import full_tensor


@dataclass(frozen=True)
class LMHead:
    """hidden states → logits: the model's output embedding (under FSDP2 its weight is the gathered one while the
    root's forward has left it so), then the logit soft-cap of Gemma 2 and 3 where the model has one."""

    module: nn.Module
    softcap: float | None = None

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return self._capped(self.module(states))

    def frozen(self) -> FrozenHead:
        """The head as it is now, its weight copied: the logits of the policy before an update that moves the head
        (dense AdamW). A sharded weight is gathered (a collective: call it on every rank)."""
        weight = full_tensor(self.module.weight.detach()).clone()
        bias = getattr(self.module, "bias", None)
        return FrozenHead(weight, None if bias is None else full_tensor(bias.detach()).clone(), self.softcap)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)


@dataclass(frozen=True)
class FrozenHead:
    """A copy of an `LMHead`'s weights, applied in the dtype of the states it is given."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(states.dtype)
        logits = F.linear(states, self.weight.to(states.dtype), bias)
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)


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
