"""Ray: start or join the cluster, and place groups of actors one per (CPU, GPU) bundle.

On a machine without CUDA the same placement runs on *logical* GPUs (`ray.init(num_gpus=N)`):
bundles, placement groups and CUDA_VISIBLE_DEVICES behave as on a GPU node, and the workers
use the CPU device with gloo. So the scheduling code tested on CPU is the code a GPU node runs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from logra_rl.config import RunConfig

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CORES_ENV = "LOGRA_CPU_CORES"  # an actor's pinned cores ("0,1"), set by WorkerGroup with `cores`
PLACEMENT_TIMEOUT_S = 120
MIN_OBJECT_STORE_MB = 256


def gpus_needed(config: RunConfig) -> int:
    return config.cluster.train_workers + config.rollout.num_engines * config.rollout.gpus_per_engine


def start_ray(config: RunConfig) -> bool:
    """Join a Ray cluster or start a private one; returns True when this call connected to Ray (ray.init), so
    the caller's `stop_ray()` stops a Ray it started and only disconnects from a cluster it joined.

    `ray.address` unset joins a cluster already running on this node (`RAY_ADDRESS`, else the last `ray start`),
    as a bare `ray.init()` (verl, OpenRLHF) does; `ray.address=local` starts a private Ray beside it."""
    if config.cluster.pin_cores:  # before Ray: fewer cores than groups, or GPUs, stop the run here
        if config.cluster.device == "auto" and torch.cuda.is_available():
            raise ValueError(
                "cluster.pin_cores=true pins CPU cores, and cluster.device=auto means the GPUs on this machine (each "
                "group already has its own): set cluster.pin_cores=false, or cluster.device=cpu to train on the CPU"
            )
        cores = pinned_cores(config)
        print(f"[logra] pinned cores (cluster.pin_cores): {describe_cores(cores)}", flush=True)
    if ray.is_initialized():
        return False
    if config.cluster.device != "cpu":
        check_cuda()
    runtime_env = {"env_vars": WORKER_ENV}
    address = config.ray.address
    found = local_cluster() if address is None else None
    if address != "local" and (address or found):
        ray.init(address=address or found, runtime_env=runtime_env, log_to_driver=True)
        try:
            check_cluster(config, address or found)
        except ValueError:
            ray.shutdown()  # disconnects; the cluster runs on
            raise
        if found:
            print(
                f"[logra] joined the Ray cluster running on this node at {found} (RAY_ADDRESS or `ray start`); "
                "ray.address=local runs on a private Ray instead",
                flush=True,
            )
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
        store_mb = max(MIN_OBJECT_STORE_MB, int(3 * config.sync.bucket_mb))
    # Ray's processes start with SIGTERM blocked (as Ray blocks SIGINT in them): a SIGTERM sent to every process of
    # the job (SLURM, `timeout`, `kill -- -PGID`) reaches the driver alone, which checkpoints with the workers still
    # there. They end with the driver: `stop_ray`, or the kernel's fate-sharing when it is killed.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(
            address="local",  # a new Ray even where RAY_ADDRESS or a `ray start` cluster would be joined
            num_cpus=max(os.cpu_count() or 1, cpus),
            num_gpus=cuda or needed,  # logical GPUs on a CPU machine
            object_store_memory=store_mb * 2**20 if store_mb else None,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    if config.ray.address == "local":
        print(
            "[logra] started a private Ray for this run (ray.address=local); without it the run joins a Ray cluster "
            "running on this node (`ray start`)",
            flush=True,
        )
    return True


def stop_ray() -> None:
    """`ray.shutdown()`, and the end of a private Ray this driver started (`start_ray`): its processes block
    SIGTERM, so they are killed, not asked to stop (Ray's polite stop would wait a second on each and leave its
    agents running); whatever of them outlives the shutdown is killed too. A joined cluster is only left."""
    node = ray._private.worker._global_node  # the private cluster's processes; None or connect-only when joined
    processes = ray_processes(node) if node is not None and node.is_head() else []
    if processes:
        kill = node.kill_all_processes
        node.kill_all_processes = lambda **options: kill(**{**options, "allow_graceful": False})
    ray.shutdown()
    for process in processes:
        with suppress(psutil.Error):
            process.kill()


def ray_processes(node: Any) -> list[psutil.Process]:
    """The processes a Ray node started (GCS, raylet, monitors) and all of theirs (workers, agents)."""
    found = []
    for infos in node.all_processes.values():
        for info in infos:
            with suppress(psutil.Error):
                process = psutil.Process(info.process.pid)
                found += [process, *process.children(recursive=True)]
    return found


def local_cluster() -> str | None:
    """The cluster a bare `ray.init()` joins, found Ray's way: `RAY_ADDRESS`, else the address the last
    `ray start` on this node wrote, if that cluster still answers (a crashed one leaves its file behind)."""
    from ray._private.services import find_bootstrap_address

    address = os.environ.get("RAY_ADDRESS") or None
    if address:
        return None if address == "local" else address
    address = find_bootstrap_address(None)
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
        return None
    return address


def check_cluster(config: RunConfig, address: str) -> None:
    """Fail now, naming the fix, when the joined cluster lacks the GPUs or CPUs the run's bundles ask for (its
    placement groups would otherwise wait PLACEMENT_TIMEOUT_S and fail)."""
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 0)
    need_gpus = gpus_needed(config)
    need_cpus = config.cluster.cpus_per_worker * (config.cluster.train_workers + config.rollout.num_engines)
    if gpus < need_gpus or cpus < need_cpus:
        raise ValueError(
            f"the Ray cluster at {address} has {gpus:g} GPUs and {cpus:g} CPUs; this run needs {need_gpus} GPUs "
            f"(cluster.train_workers + rollout.num_engines × rollout.gpus_per_engine) and {need_cpus:g} CPUs "
            "(cluster.cpus_per_worker each). Start that cluster with enough (`ray start --head --num-gpus=N`: "
            "logical GPUs on a CPU machine), lower those settings, or run on a private Ray: ray.address=local"
        )


# The oldest Linux driver of each CUDA major version (CUDA's minor-version compatibility).
DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}
# The older driver branches on which NVIDIA's forward-compatibility package (cuda-compat-13-0) runs CUDA 13.0, on
# data-centre GPUs only (H100, H200, A100, ...; not GeForce): NVIDIA's CUDA compatibility support matrix.
FORWARD_COMPATIBLE = {13: (535, 570)}
COMPAT_LIBRARIES = "/usr/local/cuda/compat"  # where the package (and NVIDIA's CUDA images) put them
NVIDIA_PROC = "/proc/driver/nvidia/version"  # the loaded driver; visible inside containers too


@dataclass(frozen=True)
class CudaProbe:
    """What this node says about CUDA (see `probe_cuda`)."""

    torch_cuda: str | None  # torch.version.cuda: the CUDA torch is built for (None: a CPU build)
    available: bool  # torch.cuda.is_available()
    gpus_present: bool  # NVIDIA device files or a loaded NVIDIA driver, and CUDA_VISIBLE_DEVICES not emptied
    driver: str | None = None  # the kernel driver's version, e.g. "535.104.05"
    warning: str | None = None  # what torch warned when CUDA failed to initialise


def probe_cuda() -> CudaProbe:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")  # GPUs hidden on purpose
    present = not hidden and any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", NVIDIA_PROC))
    return CudaProbe(
        torch_cuda=torch.version.cuda,
        available=available,
        gpus_present=present,
        driver=driver_version() if present and not available else None,
        warning=next((str(w.message) for w in caught if "CUDA" in str(w.message)), None),
    )


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version: /proc (also inside containers), else nvidia-smi."""
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", Path(NVIDIA_PROC).read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_problem(probe: CudaProbe) -> str | None:
    """Why a CUDA build of torch cannot use this node's GPUs, in one message naming the fix; None when there is
    nothing to say (CUDA works, a CPU build, or no NVIDIA GPU here). Without this check the run would start on
    the CPU, as on a machine without GPUs."""
    if probe.available or probe.torch_cuda is None or not probe.gpus_present:
        return None
    major = int(probe.torch_cuda.split(".")[0])
    floor = DRIVER_FLOOR.get(major)
    found = re.search(r"found version (\d+)", probe.warning or "")  # torch: the CUDA the driver supports, 12020
    if probe.driver:
        driver, too_old = f"driver {probe.driver}", floor is not None and int(probe.driver.split(".")[0]) < floor
    elif found:
        supported = int(found.group(1))
        driver = f"a driver for CUDA {supported // 1000}.{supported % 1000 // 10}"
        too_old = floor is not None and supported // 1000 < major
    else:
        driver, too_old = "driver version unknown", False
    if too_old:
        said = (
            f"this node's NVIDIA GPUs are unusable: torch is built for CUDA {probe.torch_cuda}, which needs NVIDIA "
            f"driver ≥ {floor}, and the host has {driver}. "
        )
        branch = int(probe.driver.split(".")[0]) if probe.driver else None
        if branch in FORWARD_COMPATIBLE.get(major, ()):
            said += (
                f"On a data-centre GPU this driver branch runs CUDA {major}.0 through NVIDIA's forward-compatibility "
                f"libraries: install cuda-compat-{major}-0 and put {COMPAT_LIBRARIES} first on LD_LIBRARY_PATH (the "
                f"logra-rl image does both when it sees this driver); or upgrade the host's driver to ≥ {floor}"
            )
        else:
            branches = " or ".join(map(str, FORWARD_COMPATIBLE.get(major, ())))
            compat = (
                f" (or, on a data-centre GPU, to the {branches} branch with NVIDIA's forward-compatibility package)"
            )
            said += (
                f"Upgrade the host's driver to ≥ {floor}{compat if branches else ''}, or install outside docker a "
                "torch and vLLM built for the CUDA this driver supports"
            )
        return f"{said} (docs/gpu.md); cluster.device=cpu runs on the CPU anyway"
    said = f": {probe.warning.strip()}" if probe.warning else ""
    return (
        f"this node has NVIDIA GPUs ({driver}) but torch (CUDA {probe.torch_cuda}) cannot use them{said}. Check "
        "`nvidia-smi`, CUDA_VISIBLE_DEVICES and, in docker, `docker run --gpus all`; cluster.device=cpu runs on "
        "the CPU anyway"
    )


class CudaUnusable(OSError):
    """This node's NVIDIA GPUs cannot be used by this torch (an OSError: `logra-train` says it in one line)."""


def check_cuda() -> None:
    problem = cuda_problem(probe_cuda())
    if problem:
        raise CudaUnusable(problem)


def cpu_threads(group: PlacementGroup) -> list[int]:
    """torch threads for each bundle's actor: its node's cores shared by the group's actors on that node.

    Threads follow the phase: in the synchronous loop the engines generate while the train workers wait, then
    the train workers compute while the engines wait, so a group in its phase has the node's cores to itself.
    Ray would start each actor with OMP_NUM_THREADS = its `num_cpus` (1 by default), leaving the other cores
    idle. Where both groups compute at once (`algorithm.max_staleness` > 0), `cluster.pin_cores` gives each
    group its own cores instead, as GPUs would (`pinned_cores`).
    """
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    node_cpus = {node["NodeID"]: int(node["Resources"].get("CPU", 1)) for node in ray.nodes() if node["Alive"]}
    here = ray.get_runtime_context().get_node_id()
    if here in node_cpus:  # a local Ray may advertise more CPUs than the machine has (ray.init(num_cpus=...))
        node_cpus[here] = min(node_cpus[here], len(os.sched_getaffinity(0)))
    sharers = Counter(bundle_nodes.values())
    return [max(1, node_cpus.get(node, 1) // sharers[node]) for _, node in sorted(bundle_nodes.items())]


def split_cores(cores: Sequence[int], gpus: Mapping[str, int]) -> dict[str, list[int]]:
    """`cores` (sorted) cut into contiguous runs, one per group in `gpus`' order, in proportion to each group's
    (logical) GPUs, each at least one core."""
    cores, names = sorted(cores), list(gpus)
    if len(cores) < len(names):
        raise ValueError(
            f"cluster.pin_cores=true needs at least {len(names)} cores (one per group: {', '.join(names)}); this "
            f"process has {len(cores)}: set cluster.pin_cores=false"
        )
    total, bounds, seen = sum(gpus.values()), [0], 0
    for k, name in enumerate(names[:-1], start=1):
        seen += gpus[name]
        nearest = (2 * len(cores) * seen + total) // (2 * total)  # round(len(cores) × seen / total)
        bounds.append(min(max(nearest, bounds[-1] + 1), len(cores) - (len(names) - k)))
    bounds.append(len(cores))
    return {name: cores[bounds[k] : bounds[k + 1]] for k, name in enumerate(names)}


def actor_cores(cores: Sequence[int], actors: int) -> list[list[int]]:
    """A group's `cores` among its `actors`: a contiguous share each where there are enough, else all of them
    for every actor."""
    cores = list(cores)
    if len(cores) < actors:
        return [cores] * actors
    return [cores[i * len(cores) // actors : (i + 1) * len(cores) // actors] for i in range(actors)]


def pinned_cores(config: RunConfig, cores: Sequence[int] | None = None) -> dict[str, list[list[int]]]:
    """`cluster.pin_cores`: each actor's cores, by group ("train", "rollout"). `cores` (default: this process's,
    `os.sched_getaffinity`) are split between the groups in proportion to their logical GPUs
    (cluster.train_workers; rollout.num_engines × rollout.gpus_per_engine), so both groups compute at once
    without taking each other's cores, as on GPUs. The cores are this node's: for a run on one machine."""
    groups = {"train": config.cluster.train_workers, "rollout": config.rollout.num_engines}
    gpus = {
        "train": config.cluster.train_workers,
        "rollout": config.rollout.num_engines * config.rollout.gpus_per_engine,
    }
    split = split_cores(sorted(os.sched_getaffinity(0)) if cores is None else cores, gpus)
    return {name: actor_cores(split[name], groups[name]) for name in groups}


def describe_cores(cores: Mapping[str, Sequence[Sequence[int]]]) -> str:
    """One line: "train 0-3 (actors 0-1 | 2-3), rollout 4-7"; "shared" where a group's actors share its cores."""

    def runs(group: Sequence[int]) -> str:
        spans: list[list[int]] = []
        for core in sorted(group):
            if spans and core == spans[-1][1] + 1:
                spans[-1][1] = core
            else:
                spans.append([core, core])
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

    parts = []
    for name, actors in cores.items():
        union = sorted({core for actor in actors for core in actor})
        if len(actors) > 1:
            shared = all(sorted(actor) == union for actor in actors)
            detail = (
                f" (shared by its {len(actors)} actors)" if shared else f" (actors {' | '.join(map(runs, actors))})"
            )
        else:
            detail = ""
        parts.append(f"{name} {runs(union)}{detail}")
    return ", ".join(parts)


def pin_process(cores: Sequence[int]) -> None:
    """Pin this process, every thread it has and (by inheritance) every thread or process it starts later, to
    `cores`."""
    chosen = set(cores)
    os.sched_setaffinity(0, chosen)
    for thread in os.listdir("/proc/self/task"):  # sched_setaffinity(0) is the calling thread's alone
        with suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), chosen)


def pinned(cls: type) -> type:
    """`cls` whose instances pin their process to the cores in CORES_ENV before their own __init__ runs.
    (Ray's `worker_process_setup_hook` is a job-level setting only, not an actor's.)"""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pin_process([int(core) for core in os.environ[CORES_ENV].split(",")])
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})


class GroupLost(RuntimeError):
    """A worker of a group died or the group stopped answering; the group has been killed."""


class WorkerGroup:
    """`count` actors of `cls`, actor i in bundle i of a PACK placement group of {CPU, GPU} bundles,
    built with the keyword arguments `arguments(i)`. Typed clients (TrainGroup, RolloutGroup) call the
    actors' methods and collect the results with `gather`. With `max_restarts`, Ray recreates an actor whose
    process died in the same bundle, with the same arguments (up to that many times). `env(i)` adds to actor i's
    environment variables. With `cores` (`pinned_cores`), actor i runs on exactly the cores `cores[i]`, with as
    many torch threads; without, its threads follow the phase (`cpu_threads`)."""

    def __init__(
        self,
        cls: type,
        count: int,
        name: str,
        cpus: float,
        gpus: float,
        arguments: Callable[[int], Mapping[str, Any]],
        max_restarts: int = 0,
        env: Callable[[int], Mapping[str, str]] = lambda _: {},
        cores: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if cores is not None and len(cores) != count:
            raise ValueError(f"the {name} group has {count} actors but {len(cores)} core assignments")
        self.name = name
        self.placement_group = placement_group([{"CPU": cpus, "GPU": gpus}] * count, strategy="PACK", name=name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"could not place the {name} group ({count} × {{CPU: {cpus}, GPU: {gpus}}}) within "
                f"{PLACEMENT_TIMEOUT_S}s; the cluster has {ray.available_resources()}"
            )
        self.cores = None if cores is None else [sorted(c) for c in cores]
        self.threads = cpu_threads(self.placement_group) if self.cores is None else [len(c) for c in self.cores]
        actor = ray.remote(cls if self.cores is None else pinned(cls))

        def env_vars(i: int) -> dict[str, str]:
            pin = {} if self.cores is None else {CORES_ENV: ",".join(map(str, self.cores[i]))}
            return {**WORKER_ENV, "OMP_NUM_THREADS": str(self.threads[i]), **pin, **env(i)}

        self.actors = [
            actor.options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i),
                max_restarts=max_restarts,
                runtime_env={"env_vars": env_vars(i)},
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
