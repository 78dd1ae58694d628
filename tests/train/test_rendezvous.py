"""Rank 0 holds the process group's port from the moment it publishes it (`TrainWorker.address`) until the group
forms (`setup`): a port found free and released there could be taken by any process on the node in between."""

import socket

import ray

from logra_rl.config import RunConfig
from logra_rl.orchestration.cluster import start_ray, stop_ray
from logra_rl.orchestration.train_group import TrainGroup
from tests.orchestration.test_controller import run_config
from tests.tiny_models import tiny_qwen3


def test_the_published_port_cannot_be_taken_before_the_group_forms(tmp_path):
    path = tmp_path / "model"
    tiny_qwen3(seed=4).save_pretrained(path)
    config = RunConfig.from_mapping(run_config(["model=hf", f"model.path={path}"]))
    owns_ray = start_ray(config)
    group = TrainGroup(config, str(path))
    try:
        host, port = ray.get(group.actors[0].address.remote())
        with socket.socket() as other:  # another process on the node binds the port before the group does
            try:
                other.bind(("", port))
                other.listen()
                taken = True
            except OSError:
                taken = False
            versions = group.workers.gather([a.setup.remote(host, port) for a in group.actors], timeout_s=300)
    finally:
        group.shutdown()
        if owns_ray:
            stop_ray()
    assert not taken
    assert versions == [0, 0]  # both ranks formed the group on the published port
