"""The full resyncs' process group on its own: rank 0 broadcasts a bucket, every other member gets it bit for bit,
beside a default process group of another world (as train rank 0 and vLLM's workers have)."""

import datetime
import multiprocessing

import torch
import torch.distributed as dist

from logra_rl.utils.transfer import TransferAddress, TransferGroup, TransferStore, layout_of


def bucket(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=generator),
        "model.norm.weight": torch.randn(32, generator=generator),
        "lm_head.weight": torch.randn(7, 32, generator=generator),
    }


def member(rank: int, address: TransferAddress, queue) -> None:
    # a default group of another world in this process first: the transfer group must not depend on it
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    group = TransferGroup(address, rank, timeout_s=60)
    layout = layout_of(bucket(0), list(bucket(0)))
    received = group.receive(layout)
    queue.put((rank, {name: value.clone() for name, value in received.items()}))
    dist.destroy_process_group()


def test_rank_0_broadcasts_a_bucket_every_member_receives_it_exactly():
    store = TransferStore("127.0.0.1", timeout_s=60)
    address = TransferAddress("127.0.0.1", store.port, world_size=3, backend="gloo", generation=1)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    members = [context.Process(target=member, args=(rank, address, queue)) for rank in (1, 2)]
    for process in members:
        process.start()
    sender = TransferGroup(address, 0, timeout_s=60, store=store)
    sent = bucket(0)
    sender.send(sent, layout_of(sent, list(sent)))
    received = dict(queue.get(timeout=60) for _ in members)
    for process in members:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sorted(received) == [1, 2]
    for state in received.values():
        assert list(state) == list(sent)
        assert all(torch.equal(state[name], value) for name, value in sent.items())
