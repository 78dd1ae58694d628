"""A full resync arriving in buckets: the part every engine shares, whatever holds its weights."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from logra_rl.logra import PayloadMerger, merge_adapters


def bucket_tensors(state: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
    """A resync bucket as tensors. The trainer sends numpy arrays, which Ray reads from its object store
    without a copy (torch tensors it would unpickle into fresh memory: 3× slower at 100 MB); the views
    are read-only, so they are only read (loaded into the engine's own weights)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


class BucketedResync:
    """A full resync arriving in buckets of HF-named fp32 master weights: loads the merger's targets as
    their bucket arrives, and lets the last bucket set the version only if every weight has arrived.

    A LoRA run's engines (`adapter_scale` > 0) get each adapted module's base weight and its adapters
    instead of the merged weight: `merged` turns a bucket into what the engine loads, and the merger keeps
    the bases that later adapter payloads are added to."""

    def __init__(self, merger: PayloadMerger, weight_names: Iterable[str], adapter_scale: float = 0.0) -> None:
        self.merger = merger
        self.weight_names = frozenset(weight_names)
        self.adapter_scale = adapter_scale
        self.pending: set[str] = set()
        self.bases: dict[str, torch.Tensor] = {}

    def merged(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The bucket with its adapters merged (a LoRA run's; others' as they are), keeping its bases for
        `receive`."""
        if not self.adapter_scale:
            return state
        merged, self.bases = merge_adapters(state, self.adapter_scale)
        return merged

    def receive(self, state: Mapping[str, torch.Tensor], version: int, bucket: int, buckets: int) -> None:
        """Bucket `bucket` of `buckets` as `merged` gave it; the engine has already loaded it into its own weights."""
        if bucket == 0:
            self.merger.begin_resync()
            self.pending = set(self.weight_names)
        self.pending -= state.keys()
        targets = self.merger.targets
        self.merger.load({name: state[f"{name}.weight"] for name in targets if f"{name}.weight" in state}, self.bases)
        self.bases = {}
        if bucket == buckets - 1:
            if self.pending:
                raise KeyError(f"full resync ended without weights {sorted(self.pending)[:4]}")
            self.merger.finish_resync(version)
