"""Prompts run once for many rows: `KLRows.prefill` for a Hugging Face causal LM, from its key-value cache."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers

from logra_rl.logra import ContinueFn, PrefillFn


def prompt_prefill(forward: Callable[..., torch.Tensor], config: transformers.PretrainedConfig) -> PrefillFn:
    """`forward(input_ids, attention_mask, past_key_values=, position_ids=)`: the model's forward to what the KL
    reads (logits or final hidden states). The prefill runs the prompts into a cache; each continuation runs its rows
    from a copy of their prompts' rows of it (the forward extends a cache in place)."""

    def prefill(prompts: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ContinueFn]:
        cache = transformers.DynamicCache(config=config)
        states = forward(prompts, mask, past_key_values=cache)

        def after(
            which: torch.Tensor, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor
        ) -> torch.Tensor:
            rows = copy.deepcopy(cache)
            rows.batch_select_indices(which)
            return forward(ids, attention, past_key_values=rows, position_ids=positions)

        return states, after

    return prefill
