"""Ray: start or join the cluster, and place groups of actors one per (CPU, GPU) bundle.

On a machine without CUDA the same placement runs on *logical* GPUs (`ray.init(num_gpus=N)`):
bundles, placement groups and CUDA_VISIBLE_DEVICES behave as on a GPU node, and the workers
use the CPU device with gloo. So the scheduling code tested on CPU is the code a GPU node runs.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from logra_rl.config import RunConfig

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
PLACEMENT_TIMEOUT_S = 120
MIN_OBJECT_STORE_MB = 256


def gpus_needed(config: RunConfig) -> int:
    return config.cluster.train_workers + config.rollout.num_engines * config.rollout.gpus_per_engine


def start_ray(config: RunConfig) -> bool:
    """Join `ray.address`, or start a local Ray; returns True when this call started Ray."""
    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": WORKER_ENV}
    if config.ray.address:
        ray.init(address=config.ray.address, runtime_env=runtime_env, log_to_driver=True)
        return True
    needed = gpus_needed(config)
    cuda = torch.cuda.device_count()
    if cuda and cuda < needed:
        raise ValueError(
            f"this node has {cuda} GPUs but the config needs {needed} (cluster.train_workers + "
            "rollout.num_engines × rollout.gpus_per_engine); lower them or join a cluster with ray.address"
        )
    cpus = int(config.cluster.cpus_per_worker * (config.cluster.train_workers + config.rollout.num_engines)) + 1
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, private cluster: no token files
    store_mb = config.ray.object_store_mb
    if store_mb is None and not cuda:
        store_mb = max(MIN_OBJECT_STORE_MB, int(3 * config.rollout.resync_bucket_mb))
    ray.init(
        num_cpus=max(os.cpu_count() or 1, cpus),
        num_gpus=cuda or needed,  # logical GPUs on a CPU machine
        object_store_memory=store_mb * 2**20 if store_mb else None,
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=True,
    )
    return True


def cpu_threads(group: PlacementGroup) -> list[int]:
    """torch threads for each bundle's actor: its node's cores shared by the group's actors on that node.

    The loop is synchronous: the engines generate while the train workers wait, then the train workers
    compute while the engines wait, so a group in its phase has the node's cores to itself. Ray would start
    each actor with OMP_NUM_THREADS = its `num_cpus` (1 by default), leaving the other cores idle.
    """
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    node_cpus = {node["NodeID"]: int(node["Resources"].get("CPU", 1)) for node in ray.nodes() if node["Alive"]}
    here = ray.get_runtime_context().get_node_id()
    if here in node_cpus:  # a local Ray may advertise more CPUs than the machine has (ray.init(num_cpus=...))
        node_cpus[here] = min(node_cpus[here], len(os.sched_getaffinity(0)))
    sharers = Counter(bundle_nodes.values())
    return [max(1, node_cpus.get(node, 1) // sharers[node]) for _, node in sorted(bundle_nodes.items())]


class GroupLost(RuntimeError):
    """A worker of a group died or the group stopped answering; the group has been killed."""


class WorkerGroup:
    """`count` actors of `cls`, actor i in bundle i of a PACK placement group of {CPU, GPU} bundles,
    built with the keyword arguments `arguments(i)`. Typed clients (TrainGroup, RolloutGroup) call the
    actors' methods and collect the results with `gather`. With `max_restarts`, Ray recreates an actor whose
    process died in the same bundle, with the same arguments (up to that many times)."""

    def __init__(
        self,
        cls: type,
        count: int,
        name: str,
        cpus: float,
        gpus: float,
        arguments: Callable[[int], Mapping[str, Any]],
        max_restarts: int = 0,
    ) -> None:
        self.name = name
        self.placement_group = placement_group([{"CPU": cpus, "GPU": gpus}] * count, strategy="PACK", name=name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"could not place the {name} group ({count} × {{CPU: {cpus}, GPU: {gpus}}}) within "
                f"{PLACEMENT_TIMEOUT_S}s; the cluster has {ray.available_resources()}"
            )
        self.threads = cpu_threads(self.placement_group)
        actor = ray.remote(cls)
        self.actors = [
            actor.options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i),
                max_restarts=max_restarts,
                runtime_env={"env_vars": {**WORKER_ENV, "OMP_NUM_THREADS": str(self.threads[i])}},
            ).remote(**arguments(i))
            for i in range(count)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def gather(self, refs: list[ray.ObjectRef], timeout_s: float | None = None) -> list[Any]:
        """Results in order. The first failure, or no answer within `timeout_s`, kills the group, so ranks
        blocked in a collective never hang; it raises GroupLost when a worker's process died or the group
        hung (the caller may build the group again), else the worker's own error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not done:
                self.kill()
                raise GroupLost(f"the {self.name} group did not answer within {timeout_s:g} s")
            try:
                ray.get(done[0])
            except Exception as error:
                dead = self._dead()  # before the kill, which ends them all
                self.kill()
                if dead or isinstance(error, RayActorError):
                    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
                    raise GroupLost(f"{self.name} worker(s) {dead} died: {first}") from error
                raise
        return ray.get(refs)

    def _dead(self, wait_s: float = 5.0) -> list[int]:
        """The actors whose process is gone: a ping fails at once for them, and queues behind a blocked call
        for the living."""
        pings = [actor.__ray_ready__.remote() for actor in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=wait_s)
        dead = []
        for index, ping in enumerate(pings):
            if ping in ready:
                try:
                    ray.get(ping)
                except RayActorError:
                    dead.append(index)
        return dead

    def kill(self) -> None:
        """Stop the actors (without waiting for them) and release their bundles."""
        for actor in self.actors:
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
