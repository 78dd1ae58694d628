"""TrainGroup: the driver's typed client of the FSDP2 train workers.

Every method is one round trip that runs on all ranks in lock-step (each is a collective inside the
group). Rank 0 speaks for the group: the ranks all-reduce what they share, so rank 0's answer is the
group's; only it puts payloads and resync buckets into Ray's object store (the driver gets references).
A rank that dies, or a step that takes longer than `trainer.step_timeout_s` (a hung collective), kills the
whole group and raises `GroupLost`: the controller then builds a new group from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray
import torch

from logra_rl.config import RunConfig
from logra_rl.orchestration.cluster import WorkerGroup, pinned_cores
from logra_rl.train.api import ResyncBucket, StepResult
from logra_rl.train.batch import TrainBatch
from logra_rl.train.worker import TrainWorker
from logra_rl.utils.transfer import Layout, TransferAddress


class TrainGroup:
    def __init__(self, config: RunConfig, model_path: str) -> None:
        size = config.cluster.train_workers
        self.workers = WorkerGroup(
            TrainWorker,
            size,
            "train",
            cpus=config.cluster.cpus_per_worker,
            gpus=1,
            arguments=lambda rank: {"config": config, "model_path": model_path, "rank": rank, "world_size": size},
            cores=pinned_cores(config)["train"] if config.cluster.pin_cores else None,
        )
        self.actors = self.workers.actors
        self.step_timeout_s = config.trainer.step_timeout_s

    def setup(self) -> int:
        """Form the process group and load the model (rank 0 reads it); returns the policy version."""
        address, port = ray.get(self.actors[0].address.remote())
        return self._leader([a.setup.remote(address, port) for a in self.actors])

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Steps 3–6: each rank trains on a contiguous share of the rows."""
        shards = np.array_split(np.arange(len(batch)), len(self.actors))
        calls = [
            a.train_step.remote(batch.rows(torch.as_tensor(s)), step) for a, s in zip(self.actors, shards, strict=True)
        ]
        results = self.workers.gather(calls, timeout_s=self.step_timeout_s)
        # ranks that commit different updates would train different models from then on: the engines cannot
        # see it (only rank 0's payloads reach them), so the group is checked here
        versions = {r.policy_version for r in results}
        if len(versions) != 1:
            raise RuntimeError(f"train ranks disagree on the policy version after step {step}: {sorted(versions)}")
        return results[0]

    def resync_buckets(self, max_bytes: int) -> list[ResyncBucket]:
        return self._leader([a.resync_buckets.remote(max_bytes) for a in self.actors])

    def resync_bucket(self, bucket: ResyncBucket) -> ray.ObjectRef:
        """Rank 0 gathers the bucket's full fp32 values into Ray's object store; the driver gets a reference."""
        return self._leader([a.resync_bucket.remote(bucket.keys) for a in self.actors])

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self._leader([a.weights_at.remote(coordinates) for a in self.actors])

    def bucket_layout(self, bucket: ResyncBucket) -> Layout:
        return ray.get(self.actors[0].bucket_layout.remote(bucket.keys))

    def open_transfer(self, world_size: int, generation: int) -> TransferAddress:
        """Rank 0 hosts the transfer group's store (sync.resync_route=process_group) and says how to join it."""
        return ray.get(self.actors[0].open_transfer.remote(world_size, generation))

    def join_transfer(self, address: TransferAddress) -> None:
        """Rank 0 joins as the sender; returns when every member has joined (the rendezvous)."""
        self.workers.gather([self.actors[0].join_transfer.remote(address)])

    def send_bucket(self, bucket: ResyncBucket) -> None:
        """Every rank gathers the bucket; rank 0 broadcasts it to the engines, which must be receiving it."""
        self.workers.gather([a.send_bucket.remote(bucket.keys) for a in self.actors])

    def full_state(self, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The merged fp32 master state (or `keys` of it) on the driver: how the tests read the master."""
        return self._leader([a.full_state.remote(None if keys is None else tuple(keys)) for a in self.actors])

    def save(self, directory: str) -> None:
        self.workers.gather([a.save.remote(directory) for a in self.actors], timeout_s=self.step_timeout_s)

    def load(self, directory: str) -> int:
        """Restore a checkpoint; returns its policy version."""
        return self._leader([a.load.remote(directory) for a in self.actors])

    def shutdown(self) -> None:
        """Leave the process group on every rank, then stop the actors."""
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        except Exception as error:  # a rank that already died: the actors are stopped below either way
            print(f"[logra-train] train group shutdown: {type(error).__name__}: {error}")
        self.workers.kill()

    def _leader(self, calls: list[ray.ObjectRef]):
        return self.workers.gather(calls)[0]
