"""The rollout engine interface: what the driver's RolloutGroup and WeightSync call on every engine.

`HFEngine` and `VLLMEngine` implement `RolloutEngine`; both are built in their Ray actor from one
`EngineSpec`, and pick their device there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from logra_rl.config import RunConfig


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    max_new_tokens: int
    n: int = 1  # responses per prompt, returned consecutively


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the end-of-turn token when `finished`
    logprobs: list[float]  # log-probability of each generated token under the sampling distribution
    finished: bool  # ended with end-of-turn (False: cut at max_new_tokens)


@dataclass(frozen=True)
class SyncResult:
    applied: bool
    version: int  # the engine's policy version after the call
    reason: str = ""  # why a payload was refused (the weight sync then resyncs)


@dataclass(frozen=True)
class MergeMode:
    """How an engine takes LoGRA payloads, decided at its start: `in_place` (into its own weights), `shadow`
    (vLLM on CPU: into HF-layout copies reloaded after each payload) or `resync` (it cannot merge: `reason`;
    every update would be a full resync)."""

    mode: str
    reason: str = ""


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from (the `rollout` group plus what it needs from the others)."""

    model_path: str
    dtype: str
    residual: str  # error-feedback residual of the in-place merges
    target_modules: tuple[str, ...]
    merge_chunk_rows: int
    device: str  # cluster.device; `auto` is resolved inside the engine's actor (hf backend)
    attn_implementation: str = "sdpa"  # hf backend
    tensor_parallel_size: int = 1  # vllm backend
    gpu_memory_utilization: float = 0.6  # vllm backend
    max_model_len: int = 4096  # vllm backend
    seed: int = 0  # vllm backend: the engine's default seed (requests carry their own)
    max_num_seqs: int = 256  # vllm backend: sequences decoded together (sizes the CPU KV cache)

    @classmethod
    def from_config(cls, config: RunConfig, model_path: str) -> EngineSpec:
        rollout = config.rollout
        return cls(
            model_path=model_path,
            dtype=rollout.dtype,
            residual=rollout.residual,
            target_modules=config.logra.target_modules,
            merge_chunk_rows=config.logra.merge_chunk_rows,
            device=config.cluster.device,
            attn_implementation=config.model.attn_implementation,
            tensor_parallel_size=rollout.gpus_per_engine,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            seed=config.trainer.seed,
        )


class RolloutEngine(Protocol):
    """One rollout engine; every method is called through its Ray actor handle."""

    def __init__(self, spec: EngineSpec) -> None: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def merge_mode(self) -> MergeMode:
        """Whether payloads merge in place, decided at start-up."""

    def apply_payload(self, payload: bytes) -> SyncResult:
        """Merge a LoGRA payload in place (version-gated); a refusal is reported, never raised."""

    def load_weights(
        self, state: Mapping[str, np.ndarray | torch.Tensor], version: int, bucket: int = 0, buckets: int = 1
    ) -> SyncResult:
        """Bucket `bucket` of `buckets` of a full resync of fp32 master weights (HF names): numpy arrays
        from the trainer (zero-copy out of Ray's object store), or tensors."""

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Targeted weights at HF (rows, cols), full values (the drift probe); targets the engine cannot
        read as HF values are left out."""
