"""State-dict helpers shared by the trainer and the rollout engines."""

from __future__ import annotations

from torch import nn


def tied_duplicates(module: nn.Module) -> set[str]:
    """State-dict keys naming a tensor that an earlier key already names (`lm_head.weight` when tied to
    the embedding): a full resync sends each tensor once."""
    seen: set[int] = set()
    duplicates = set()
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in seen:
            duplicates.add(key)
        seen.add(id(value))
    return duplicates
