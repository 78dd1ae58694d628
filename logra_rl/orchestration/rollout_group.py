"""RolloutGroup: the driver's typed client of the rollout engines (one Ray actor each)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray
import torch

from logra_rl.config import RunConfig
from logra_rl.orchestration.cluster import WorkerGroup
from logra_rl.rollout import Completion, RolloutEngine, SamplingParams, SyncResult
from logra_rl.rollout.base import EngineSpec


def engine_class(backend: str) -> type[RolloutEngine]:
    if backend == "vllm":
        from logra_rl.rollout.vllm_engine import VLLMEngine  # imports vLLM only inside the actor

        return VLLMEngine
    from logra_rl.rollout.hf_engine import HFEngine

    return HFEngine


class RolloutGroup:
    def __init__(self, config: RunConfig, model_path: str) -> None:
        spec = EngineSpec.from_config(config, model_path)
        self.workers = WorkerGroup(
            engine_class(config.rollout.backend),
            config.rollout.num_engines,
            "rollout",
            cpus=config.cluster.cpus_per_worker,
            gpus=config.rollout.gpus_per_engine,
            arguments=lambda _: {"spec": spec},
        )
        self.engines = self.workers.actors

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        """Split the prompts over the engines (contiguous chunks, engine e seeded `seed + e`); completions
        come back in prompt order."""
        chunks = np.array_split(np.arange(len(prompts)), len(self.engines))
        calls = [
            engine.generate.remote([prompts[i] for i in chunk], params, seed + e)
            for e, (engine, chunk) in enumerate(zip(self.engines, chunks, strict=True))
            if len(chunk)  # fewer prompts than engines: the rest sit this one out
        ]
        return [c for part in self.workers.gather(calls) for c in part]

    def apply_payload(self, payload: ray.ObjectRef) -> list[SyncResult]:
        return self.workers.gather([e.apply_payload.remote(payload) for e in self.engines])

    def load_weights(self, state: ray.ObjectRef, version: int, bucket: int, buckets: int) -> list[SyncResult]:
        return self.workers.gather([e.load_weights.remote(state, version, bucket, buckets) for e in self.engines])

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return self.workers.gather([e.weights_at.remote(coordinates) for e in self.engines])

    def shutdown(self) -> None:
        self.workers.kill()
