"""The paper's 4 training + 4 rollout GPU layout, placed on logical GPUs of a CPU machine."""

import os

import numpy as np
import pytest
import ray

from logra_rl.config import ClusterConfig, RayConfig, RolloutConfig, RunConfig
from logra_rl.orchestration.cluster import WorkerGroup, start_ray


class Probe:
    def __init__(self, group: str, index: int) -> None:
        self.group, self.index = group, index

    def where(self):
        return self.group, self.index, tuple(ray.get_gpu_ids()), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_four_plus_four_placement_on_logical_gpus():
    config = RunConfig(cluster=ClusterConfig(train_workers=4), rollout=RolloutConfig(num_engines=4))
    assert start_ray(config)
    try:
        assert ray.cluster_resources()["GPU"] == 8
        train = WorkerGroup(Probe, 4, "train", cpus=0.5, gpus=1, arguments=lambda i: {"group": "train", "index": i})
        rollout = WorkerGroup(
            Probe, 4, "rollout", cpus=0.5, gpus=1, arguments=lambda i: {"group": "rollout", "index": i}
        )
        places = train.gather([a.where.remote() for a in train.actors + rollout.actors])
        assert [p[:2] for p in places] == [("train", i) for i in range(4)] + [("rollout", i) for i in range(4)]
        gpu_ids = [p[2] for p in places]
        assert all(len(ids) == 1 for ids in gpu_ids) and len({ids[0] for ids in gpu_ids}) == 8
        assert all(p[3] == str(p[2][0]) for p in places)  # each actor sees exactly its own device
        assert ray.available_resources().get("GPU", 0) == 0
        train.kill()
        rollout.kill()
    finally:
        ray.shutdown()


def test_a_local_ray_without_cuda_gets_an_object_store_of_three_resync_buckets():
    """Written object-store pages stay used memory until Ray exits: the store is sized to what a run
    keeps in flight, and an object larger than it still goes through (served from a file)."""
    assert start_ray(RunConfig(rollout=RolloutConfig(resync_bucket_mb=100)))
    try:
        assert ray.cluster_resources()["object_store_memory"] == pytest.approx(300 * 2**20, rel=0.01)
    finally:
        ray.shutdown()
    assert start_ray(RunConfig(ray=RayConfig(object_store_mb=100)))
    try:
        assert ray.cluster_resources()["object_store_memory"] == pytest.approx(100 * 2**20, rel=0.01)
        array = np.arange(40 * 2**20, dtype=np.float32)  # 160 MB
        assert np.array_equal(ray.get(ray.put(array)), array)
    finally:
        ray.shutdown()


class Threads:
    def count(self):
        import torch

        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], os.environ.get("TOKENIZERS_PARALLELISM")


def test_a_group_in_its_phase_gets_the_nodes_cores():
    """The loop is synchronous, so a group computes alone: one actor gets every core, two split them."""
    cores = len(os.sched_getaffinity(0))
    config = RunConfig(cluster=ClusterConfig(train_workers=2, cpus_per_worker=1.0))
    assert start_ray(config)
    try:
        for count in (1, 2):
            group = WorkerGroup(Threads, count, f"threads{count}", cpus=1, gpus=1, arguments=lambda i: {})
            expected = max(1, cores // count)
            assert group.threads == [expected] * count
            counts = group.gather([a.count.remote() for a in group.actors])
            assert counts == [(expected, str(expected), "false")] * count  # the run's worker env is kept
            group.kill()
    finally:
        ray.shutdown()
