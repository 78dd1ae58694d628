"""Which rank holds which part of a tensor: FSDP2 row shards, and per-shard reports combined into one.

One convention for a coordinate a shard does not hold: it reports NaN there (train ranks and
tensor-parallel engine ranks alike), and `combine_shards` fills each coordinate from its holders.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The locally stored rows of `weight` (a DTensor sharded on dim 0, or a plain tensor) and the global
    index of the first one."""
    if not isinstance(weight, DTensor):
        return weight, 0
    local = weight.to_local()
    if local.numel() == 0:
        return local, 0
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return local, offset[0]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from its shards if it is a DTensor (a collective), else itself."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def combine_shards(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One full report from per-shard reports with NaN where a shard does not hold a coordinate.

    Replicated coordinates (e.g. KV heads copied over tensor-parallel ranks) must agree; a coordinate
    no shard holds, or whose holders disagree, comes out NaN, which the drift check reports as inf.
    """
    stacked = torch.stack(list(parts))
    held = ~stacked.isnan()
    low = torch.where(held, stacked, torch.inf).amin(0)
    high = torch.where(held, stacked, -torch.inf).amax(0)
    return torch.where(low == high, low, torch.nan)
