"""A process group of its own for full resyncs: train rank 0 broadcasts each bucket of the fp32 master to every
engine process, device to device (NCCL between GPUs, gloo between CPU processes: one code path).

The group lives beside the train group's FSDP group and vLLM's tensor-parallel group, on a TCPStore that train
rank 0 hosts (`TransferStore`); its members are train rank 0 (rank 0, the sender) and every engine process
(engine e's TP worker t is rank 1 + e · TP + t). Each bucket travels as one flat fp32 tensor; its layout (the
names and shapes, in order) is known to every member beforehand, so nothing but the values crosses the group.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Layout = tuple[tuple[str, tuple[int, ...]], ...]  # a bucket's tensors, in the order they are packed
TRANSFER_TIMEOUT_S = 600.0  # a member that does not join or take a broadcast within it fails the call


@dataclass(frozen=True)
class TransferAddress:
    """What every member joins with."""

    host: str
    port: int
    world_size: int  # train rank 0 and every engine process
    backend: str  # nccl | gloo
    generation: int = 0  # a group formed again (after an engine restart) gets a store prefix of its own


class TransferStore:
    """The rendezvous store, hosted by train rank 0 on a free port of `host` and kept for the run."""

    def __init__(self, host: str, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, None, is_master=True, timeout=timeout, wait_for_workers=False)
        self.host = host

    @property
    def port(self) -> int:
        return self.store.port


class TransferGroup:
    """One member of the group; rank 0 sends (`send`), every other rank receives (`receive`)."""

    def __init__(
        self, address: TransferAddress, rank: int, timeout_s: float, store: TransferStore | None = None
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        client = None if store is not None else dist.TCPStore(address.host, address.port, timeout=timeout)
        prefix = dist.PrefixStore(f"logra_transfer_{address.generation}", store.store if store else client)
        if address.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefix, rank, address.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(prefix, rank, address.world_size, timeout)
        self.client = client  # keeps the connection open
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else None

    def send(self, state: Mapping[str, torch.Tensor], layout: Layout) -> None:
        """Broadcast `state` (rank 0) packed as `layout` says."""
        flat = torch.cat([state[name].detach().reshape(-1).float() for name, _ in layout])
        if self.device is not None:
            flat = flat.to(self.device)
        self.group.broadcast(flat, 0).wait()

    def receive(self, layout: Layout) -> dict[str, torch.Tensor]:
        """The bucket rank 0 sends, as views of one flat fp32 tensor on this member's device."""
        flat = torch.empty(sum(math.prod(shape) for _, shape in layout), device=self.device)
        self.group.broadcast(flat, 0).wait()
        return unpack(flat, layout)


def layout_of(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> Layout:
    return tuple((name, tuple(state[name].shape)) for name in names)


def unpack(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    sizes = [math.prod(shape) for _, shape in layout]
    return {name: part.view(shape) for (name, shape), part in zip(layout, flat.split(sizes), strict=True)}
