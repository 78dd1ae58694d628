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
from logra_rl.logra.merge import residual_bytes
from logra_rl.models.footprint import SYNCING, Lengths, Machine, ModelFootprint, Part
from logra_rl.utils.transfer import Layout, TransferAddress


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
    policy_version: int = -1  # the engine's policy version when it sampled this (-1: not recorded)


@dataclass(frozen=True)
class SyncResult:
    """What every engine call that changes weights answers (and each vLLM worker inside it)."""

    applied: bool
    version: int  # the engine's policy version after the call: what the weight sync records
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
    adapter_scale: float = 0.0  # a LoRA run's s in W = base + s·B·A: the engine keeps its targets' bases

    @classmethod
    def from_config(cls, config: RunConfig, model_path: str) -> EngineSpec:
        rollout = config.rollout
        return cls(
            model_path=model_path,
            dtype=rollout.dtype,
            residual=config.sync.residual,
            target_modules=config.model.target_modules,
            merge_chunk_rows=config.sync.merge_chunk_rows,
            device=config.cluster.device,
            attn_implementation=config.model.attn_implementation,
            tensor_parallel_size=rollout.gpus_per_engine,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            seed=config.trainer.seed,
            adapter_scale=config.optimizer.lora_scaling if config.optimizer.name == "lora" else 0.0,
        )


class RolloutEngine(Protocol):
    """One rollout engine; every method is called through its Ray actor handle."""

    def __init__(self, spec: EngineSpec) -> None: ...

    @staticmethod
    def memory(
        config: RunConfig, model: ModelFootprint, lengths: Lengths, machine: Machine, merges: bool
    ) -> tuple[list[Part], list[str]]:
        """What one engine holds for `model` on `machine` (the memory plan adds its runtime), and notes for the
        user; `merges`: the update rule's payloads are merged in place (else every update is a full resync)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def merge_mode(self) -> MergeMode:
        """Whether payloads merge in place, decided at start-up."""

    def apply_payload(self, payload: np.ndarray) -> SyncResult:
        """Merge a payload (`Payload.to_bytes()` as Ray delivers a `PayloadRef`: a read-only uint8 view of the
        object store) in place: a LoGRA update, or a LoRA run's adapters. The merger's version gate decides:
        the payload's base version must be the engine's. A refusal is reported, never raised."""

    def load_weights(
        self, state: Mapping[str, np.ndarray | torch.Tensor], version: int, bucket: int = 0, buckets: int = 1
    ) -> SyncResult:
        """Bucket `bucket` of `buckets` of a full resync of fp32 master weights (HF names): numpy arrays
        from the trainer (zero-copy out of Ray's object store), or tensors."""

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Targeted weights at HF (rows, cols), full values (the drift check); targets the engine cannot
        read as HF values are left out."""

    def join_transfer(self, address: TransferAddress, first_rank: int) -> None:
        """Join the full resyncs' process group (`sync.resync_route=process_group`): this engine's processes are
        ranks `first_rank` on (one per tensor-parallel worker); returns once every member has joined."""

    def receive_bucket(self, layout: Layout, version: int, bucket: int, buckets: int) -> SyncResult:
        """`load_weights` of a bucket that train rank 0 broadcasts in that group, device to device."""


def engine_weights(config: RunConfig, model: ModelFootprint, merges: bool) -> tuple[Part, Part]:
    """An engine's weights in `rollout.dtype` and their merge residual, per tensor-parallel rank (no residual when
    updates come as full resyncs); a LoRA run's engines also keep their targets' fp32 bases."""
    residual = residual_bytes(config.sync.residual, config.rollout.dtype) if merges else 0
    name = "residual"
    if merges and config.optimizer.name == "lora":
        residual, name = residual + 4, "residual + LoRA bases"
    tp = config.rollout.gpus_per_engine
    weights = getattr(torch, config.rollout.dtype).itemsize * model.params / tp
    return Part("weights", weights), Part(name, residual * model.target_params / tp)


def resync_split(model: ModelFootprint) -> Part:
    """A full resync splits each weight's fp32 master into bf16 and tail with int32 temporaries."""
    return Part("resync split", 16 * max(d_out * k_in for d_out, k_in in model.targets), SYNCING)
