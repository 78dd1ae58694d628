"""The paper's 4 training + 4 rollout GPU layout, placed on logical GPUs of a CPU machine; a Ray cluster already
running on the node; a CUDA torch that cannot use the node's GPUs."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from logra_rl.config import ClusterConfig, RayConfig, RolloutConfig, RunConfig, SyncConfig
from logra_rl.orchestration.cluster import (
    CudaProbe,
    WorkerGroup,
    actor_cores,
    cuda_problem,
    pinned_cores,
    probe_cuda,
    split_cores,
    start_ray,
    stop_ray,
)
from logra_rl.rollout.vllm_engine import engine_cache_root

RAY = str(Path(sys.executable).with_name("ray"))


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
        stop_ray()


def test_a_local_ray_without_cuda_gets_an_object_store_of_three_resync_buckets():
    """Written object-store pages stay used memory until Ray exits: the store is sized to what a run
    keeps in flight, and an object larger than it still goes through (served from a file)."""
    assert start_ray(RunConfig(sync=SyncConfig(bucket_mb=100)))
    try:
        assert ray.cluster_resources()["object_store_memory"] == pytest.approx(300 * 2**20, rel=0.01)
    finally:
        stop_ray()
    assert start_ray(RunConfig(ray=RayConfig(object_store_mb=100)))
    try:
        assert ray.cluster_resources()["object_store_memory"] == pytest.approx(100 * 2**20, rel=0.01)
        array = np.arange(40 * 2**20, dtype=np.float32)  # 160 MB
        assert np.array_equal(ray.get(ray.put(array)), array)
    finally:
        stop_ray()


class Threads:
    def count(self):
        import torch

        env = os.environ
        return torch.get_num_threads(), env["OMP_NUM_THREADS"], env.get("TOKENIZERS_PARALLELISM"), env.get("INDEX")


def test_a_group_in_its_phase_gets_the_nodes_cores():
    """The loop is synchronous, so a group computes alone: one actor gets every core, two split them."""
    cores = len(os.sched_getaffinity(0))
    config = RunConfig(cluster=ClusterConfig(train_workers=2, cpus_per_worker=1.0))
    assert start_ray(config)
    try:
        for count in (1, 2):
            group = WorkerGroup(
                Threads,
                count,
                f"threads{count}",
                cpus=1,
                gpus=1,
                arguments=lambda i: {},
                env=lambda i: {"INDEX": str(i)},
            )
            expected = max(1, cores // count)
            assert group.threads == [expected] * count
            counts = group.gather([a.count.remote() for a in group.actors])
            # the run's worker env is kept, and each actor gets its own `env(i)`
            assert counts == [(expected, str(expected), "false", str(i)) for i in range(count)]
            group.kill()
    finally:
        stop_ray()


def test_pinned_cores_split_in_proportion_to_each_groups_gpus():
    """cluster.pin_cores: contiguous runs of cores, one per group, sized by its logical GPUs, at least one each;
    inside a group a contiguous share per actor, or the group's cores shared where it has fewer than actors."""
    assert split_cores(range(16), {"train": 4, "rollout": 4}) == {
        "train": list(range(8)),
        "rollout": list(range(8, 16)),
    }
    assert split_cores([1, 0], {"train": 1, "rollout": 1}) == {"train": [0], "rollout": [1]}
    assert split_cores(range(2), {"train": 7, "rollout": 1}) == {"train": [0], "rollout": [1]}  # at least one each
    assert split_cores(range(8), {"train": 2, "rollout": 6}) == {"train": [0, 1], "rollout": list(range(2, 8))}
    assert split_cores([4, 6, 5, 7], {"train": 1, "rollout": 3}) == {"train": [4], "rollout": [5, 6, 7]}
    assert actor_cores(range(8), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert actor_cores([3, 4, 5], 2) == [[3], [4, 5]]
    assert actor_cores([0], 3) == [[0], [0], [0]]  # 3 train workers on 1 core share it

    cpu = {"device": "cpu", "pin_cores": True}
    paper = RunConfig(cluster=ClusterConfig(train_workers=4, **cpu), rollout=RolloutConfig(num_engines=4))
    assert pinned_cores(paper, range(16)) == {
        "train": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "rollout": [[8, 9], [10, 11], [12, 13], [14, 15]],
    }
    tensor_parallel = RunConfig(
        cluster=ClusterConfig(train_workers=2, **cpu), rollout=RolloutConfig(num_engines=1, gpus_per_engine=2)
    )
    assert pinned_cores(tensor_parallel, range(8)) == {"train": [[0, 1], [2, 3]], "rollout": [[4, 5, 6, 7]]}
    three = RunConfig(cluster=ClusterConfig(train_workers=3, **cpu))
    assert pinned_cores(three, [0, 1]) == {"train": [[0], [0], [0]], "rollout": [[1]]}
    with pytest.raises(ValueError, match=r"cluster.pin_cores=true needs at least 2 cores .* has 1: set cluster.pin"):
        pinned_cores(three, [0])


def test_pin_cores_needs_the_cpu_device(monkeypatch):
    assert not ClusterConfig().pin_cores  # the CPU default: threads follow the phase
    with pytest.raises(ValueError, match=r"cluster.pin_cores=True .* needs the CPU .*is cuda"):
        ClusterConfig(device="cuda", pin_cores=True)
    # auto is the CPU on a machine without GPUs (this one): accepted; on a GPU machine refused before Ray starts
    auto = RunConfig.from_mapping({"cluster": {"pin_cores": True}, "rollout": {"num_engines": 1}})
    assert auto.cluster.device == "auto" and auto.cluster.pin_cores
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"cluster.device=auto means the GPUs on this machine"):
        start_ray(auto)
    with pytest.raises(ValueError, match=r"cluster\.pin_cores='yes' is invalid; must be true or false"):
        ClusterConfig(device="cpu", pin_cores="yes")
    overrides = {"cluster": {"device": "cpu", "pin_cores": True}}
    assert RunConfig.from_mapping(overrides).cluster.pin_cores


class Cores:
    """What a pinned actor runs on: its cores (the main thread's, every thread's, a child process's) and threads."""

    def __init__(self, index: int) -> None:
        self.index = index

    def report(self):
        import torch

        threads = set()
        for task in os.listdir("/proc/self/task"):
            with suppress(OSError):
                threads.add(tuple(sorted(os.sched_getaffinity(int(task)))))
        child = subprocess.run(["grep", "Cpus_allowed_list", "/proc/self/status"], capture_output=True, text=True)
        return (
            self.index,
            sorted(os.sched_getaffinity(0)),
            threads,
            child.stdout.split()[-1],
            os.environ["OMP_NUM_THREADS"],
            torch.get_num_threads(),
        )


def test_pinned_groups_run_on_their_own_cores(capsys):
    """cluster.pin_cores on this machine: train and rollout own disjoint cores that cover the process's, and
    each actor (every thread of it, and what it starts) runs on exactly its cores with as many torch threads."""
    mine = sorted(os.sched_getaffinity(0))
    config = RunConfig(cluster=ClusterConfig(train_workers=1, device="cpu", pin_cores=True))
    cores = pinned_cores(config)
    train, rollout = cores["train"][0], cores["rollout"][0]
    assert train and rollout and not set(train) & set(rollout) and sorted(train + rollout) == mine
    if len(mine) == 2:
        assert (train, rollout) == ([mine[0]], [mine[1]])
    assert start_ray(config)
    try:
        assert f"[logra] pinned cores (cluster.pin_cores): train {train[0]}" in capsys.readouterr().out
        groups = [
            WorkerGroup(Cores, 1, name, cpus=1, gpus=1, arguments=lambda i: {"index": i}, cores=cores[name])
            for name in ("train", "rollout")
        ]
        reports = [report for group in groups for report in group.gather([a.report.remote() for a in group.actors])]
        for (index, affinity, threads, child, omp, torch_threads), expected in zip(
            reports, [train, rollout], strict=True
        ):
            assert index == 0 and affinity == expected and threads == {tuple(expected)}
            assert child == (str(expected[0]) if len(expected) == 1 else f"{expected[0]}-{expected[-1]}")
            assert omp == str(len(expected)) and torch_threads == len(expected)
        assert groups[0].threads == [len(train)] and groups[1].threads == [len(rollout)]
        for group in groups:
            group.kill()
        with pytest.raises(ValueError, match="the shared group has 2 actors but 1 core assignments"):
            WorkerGroup(Cores, 2, "shared", cpus=1, gpus=1, arguments=lambda i: {"index": i}, cores=[train])
    finally:
        stop_ray()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head(temp: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`ray start --head` (2 CPUs, 3 logical GPUs) with its files in `temp`, so that only a process whose RAY_TMPDIR
    is `temp` finds it; killed on exit by its process group, which holds every process it started."""
    ports = ("port", "dashboard-port", "dashboard-agent-listen-port")
    args = ["--head", "--block", "--num-cpus=2", "--num-gpus=3", "--include-dashboard=false", "--disable-usage-stats"]
    args += [f"--object-store-memory={100 * 2**20}", *(f"--{port}={free_port()}" for port in ports)]
    head = subprocess.Popen(
        [RAY, "start", *args],
        env={**os.environ, "RAY_TMPDIR": temp},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = None
    try:
        address_file = Path(temp, "ray", "ray_current_cluster")  # written once the head is up
        deadline = time.monotonic() + 90
        while not address_file.exists():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        address = address_file.read_text().strip()
        yield address, head
    finally:
        with suppress(ProcessLookupError):  # all gone already
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        if address:  # `ray start` is reaped before its GCS has closed its port: wait until it no longer answers
            wait_closed(address)


def wait_closed(address: str, timeout_s: float = 30) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return
        assert time.monotonic() < deadline, f"the killed Ray head still answers at {address} after {timeout_s:g} s"
        time.sleep(0.1)


def gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


def test_a_ray_cluster_running_on_this_node_is_joined_and_left_running(tmp_path, monkeypatch, capsys):
    """As a bare `ray.init()` (verl, OpenRLHF) does: without ray.address the run joins the cluster `ray start` left
    on this node, checks it has what the run asks for, and its shutdown only disconnects; ray.address=local starts
    a private Ray beside it; a crashed cluster's address file is ignored."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", temp)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fits = RunConfig(cluster=ClusterConfig(cpus_per_worker=0.5))  # 2 train workers + 1 engine: 3 GPUs, 1.5 CPUs
    try:
        with ray_head(temp, tmp_path / "head.log") as (address, head):
            assert start_ray(fits)
            try:
                assert gcs_address() == address
                assert (ray.cluster_resources()["CPU"], ray.cluster_resources()["GPU"]) == (2, 3)  # the cluster's
                group = WorkerGroup(Probe, 1, "train", cpus=0.5, gpus=1, arguments=lambda i: {"group": "t", "index": i})
                [(_, _, gpu_ids, visible)] = group.gather([a.where.remote() for a in group.actors])
                assert len(gpu_ids) == 1 and visible == str(gpu_ids[0])
                group.kill()
            finally:
                stop_ray()  # what the controller does with start_ray's True (a joined cluster is only left)
            out = capsys.readouterr().out
            assert f"joined the Ray cluster running on this node at {address}" in out and "ray.address=local" in out
            assert head.poll() is None  # the cluster runs on

            too_big = RunConfig(cluster=ClusterConfig(train_workers=4, cpus_per_worker=0.5))
            with pytest.raises(ValueError, match=r"has 3 GPUs and 2 CPUs; this run needs 5 GPUs .* ray.address=local"):
                start_ray(too_big)
            assert not ray.is_initialized() and head.poll() is None

            assert start_ray(RunConfig(ray=RayConfig(address="local")))
            try:
                assert gcs_address() != address
            finally:
                stop_ray()
            assert "started a private Ray for this run (ray.address=local)" in capsys.readouterr().out
            assert head.poll() is None

        assert Path(temp, "ray", "ray_current_cluster").read_text().strip() == address  # left by the killed head
        assert start_ray(fits)
        try:
            assert gcs_address() != address  # a private Ray
        finally:
            stop_ray()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_cuda_torch_that_cannot_use_the_nodes_gpus_stops_the_run_naming_the_driver_and_the_fix():
    """Without the check a CUDA torch that cannot initialise CUDA runs everything on the CPU, as on a machine
    without GPUs: the docker image's CUDA 13 on a host driver older than 580 does that."""
    old_driver = cuda_problem(CudaProbe(torch_cuda="13.0", available=False, gpus_present=True, driver="550.54.15"))
    assert "built for CUDA 13.0, which needs NVIDIA driver ≥ 580, and the host has driver 550.54.15" in old_driver
    assert "Upgrade the host's driver to ≥ 580" in old_driver and "cluster.device=cpu" in old_driver
    assert "to the 535 or 570 branch with NVIDIA's forward-compatibility package" in old_driver  # 550 is not one
    # 535 (LTSB) and 570 run CUDA 13.0 on data-centre GPUs through cuda-compat-13-0: the fix is named first
    for driver in ("535.104.05", "570.86.10"):
        compat = cuda_problem(CudaProbe("13.0", available=False, gpus_present=True, driver=driver))
        assert f"the host has driver {driver}. On a data-centre GPU this driver branch runs CUDA 13.0" in compat
        assert "install cuda-compat-13-0 and put /usr/local/cuda/compat first on LD_LIBRARY_PATH" in compat

    warning = "CUDA initialization: The NVIDIA driver on your system is too old (found version 12020). Please update"
    no_version = CudaProbe("13.0", available=False, gpus_present=True, warning=warning)  # no /proc, no nvidia-smi
    assert "needs NVIDIA driver ≥ 580, and the host has a driver for CUDA 12.2" in cuda_problem(no_version)

    other = cuda_problem(CudaProbe("13.0", available=False, gpus_present=True, driver="580.65.06", warning="no GPU"))
    assert "(driver 580.65.06) but torch (CUDA 13.0) cannot use them: no GPU" in other and "--gpus all" in other
    cuda_12 = cuda_problem(CudaProbe("12.8", available=False, gpus_present=True, driver="550.54.15"))
    assert "Upgrade" not in other and "Upgrade" not in cuda_12  # new enough: the other causes
    assert cuda_problem(CudaProbe("13.0", available=True, gpus_present=True)) is None
    assert cuda_problem(CudaProbe(None, available=False, gpus_present=True)) is None  # a CPU build of torch
    assert cuda_problem(CudaProbe("13.0", available=False, gpus_present=False)) is None  # no NVIDIA GPU: a CPU run
    assert cuda_problem(probe_cuda()) is None  # this machine


def test_each_vllm_engine_compiles_into_its_own_directory_of_the_users_cache():
    """Four engines compiling into one ~/.cache/vllm at once corrupted it; each gets a directory that persists."""
    home = os.path.expanduser("~")
    assert engine_cache_root(2, {}) == f"{home}/.cache/vllm/engine_2"
    assert engine_cache_root(0, {"XDG_CACHE_HOME": "/c"}) == "/c/vllm/engine_0"
    assert engine_cache_root(1, {"VLLM_CACHE_ROOT": "~/vc", "XDG_CACHE_HOME": "/c"}) == f"{home}/vc/engine_1"
