"""What the rollout engines get of a train worker's weights: a full resync's buckets of the fp32 master, the
drift check's values, and a step's payloads, each left in Ray's object store by rank 0 for the engines to read.

Reading the sharded master is a collective: every rank of the group calls the same method with the same
arguments; rank 0 returns what the driver gets.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from logra_rl.logra import Payload
from logra_rl.models.footprint import ModelFootprint
from logra_rl.train.api import LowRankPayloads, PayloadRef, ResyncBucket, WeightUpdate
from logra_rl.train.lora import adapter_state, merged_state
from logra_rl.utils.shards import combine_shards, full_tensor, local_rows
from logra_rl.utils.state_dict import tied_duplicates
from logra_rl.utils.transfer import Layout, TransferAddress, TransferGroup, TransferStore, layout_of

if TYPE_CHECKING:
    import ray

LAYER_KEY = re.compile(r"^(.*\.layers\.\d+)\.")  # a state-dict key inside decoder layer N
ADAPTER_PART = re.compile(r"\.(base_layer|lora_A|lora_B)\..*$")  # peft's parts of one LoRA-wrapped module


def largest_resync_bucket(model: ModelFootprint, max_bytes: float, lora_rank: int = 0) -> float:
    """At most how many fp32 bytes one bucket of `WeightExport.resync_buckets(max_bytes)` sends, for the memory
    plan: buckets hold about `max_bytes`, but a decoder layer (with its LoRA adapters) or an embedding is never
    split, so one larger than that is a bucket of its own; no bucket is larger than the whole model."""
    adapters = 4 * lora_rank * (model.target_rows + model.target_cols)
    largest = max(max_bytes, 4 * model.layer_params + adapters / model.layers, 4 * model.vocab * model.hidden)
    return min(largest, 4 * model.params + adapters)


class WeightExport:
    """The engines' view of one rank's FSDP2-sharded fp32 model: HF names, LoRA merged (W + s·B·A) or as base
    weights with their adapters (a full resync: the engines keep the bases)."""

    def __init__(
        self,
        model: torch.nn.Module,
        lora: dict[str, torch.nn.Module],
        lora_scaling: float,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.lora = lora  # empty unless the update rule trains adapters
        self.lora_scaling = lora_scaling
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.transfer_store: TransferStore | None = None  # rank 0, with sync.resync_route=process_group
        self.transfer: TransferGroup | None = None

    def resync_buckets(self, max_bytes: int) -> list[ResyncBucket]:
        """The state dict's keys in buckets of about `max_bytes`, with the bytes each sends to an engine.

        The buckets of a full resync. A decoder layer is never split, so a LoRA module travels with
        its adapters; a larger group (an embedding) is a bucket of its own; a tied weight goes once.
        """
        groups: dict[str, list[str]] = {}
        state = get_model_state_dict(self.model)
        tied = tied_duplicates(self.model)
        for key in (k for k in state if k not in tied):
            layer = LAYER_KEY.match(key)
            groups.setdefault(layer.group(1) if layer else ADAPTER_PART.sub("", key), []).append(key)
        buckets: list[ResyncBucket] = []
        for keys in groups.values():
            sent = sum(state[k].numel() * state[k].element_size() for k in keys)
            if buckets and buckets[-1].nbytes + sent <= max_bytes:
                buckets[-1] = ResyncBucket(buckets[-1].keys + tuple(keys), buckets[-1].nbytes + sent)
            else:
                buckets.append(ResyncBucket(tuple(keys), sent))
        return buckets

    def full_state(self, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor] | None:
        """The full fp32 values of `keys` (default: the whole state dict) on rank 0's CPU, under HF names
        with LoRA merged; None on the other ranks."""
        full = self._gathered(keys)
        return merged_state(full, self.lora_scaling) if full is not None and self.lora else full

    def resync_bucket(self, keys: tuple[str, ...]) -> ray.ObjectRef | None:
        """The fp32 values of `keys` under HF names (LoRA's base weights with their adapters: `adapter_state`)
        left in Ray's object store on this node (rank 0; None elsewhere) as numpy arrays, which the engines
        read without a copy."""
        import ray

        full = self._gathered(keys)
        if full is None:
            return None
        return ray.put({k: v.numpy() for k, v in (adapter_state(full) if self.lora else full).items()})

    def bucket_layout(self, keys: tuple[str, ...]) -> Layout:
        """What a bucket of `keys` sends the engines, names and shapes in order (no gathering: global shapes)."""
        state = get_model_state_dict(self.model)
        chosen = {key: state[key] for key in keys}
        sent = adapter_state(chosen) if self.lora else chosen
        return layout_of(sent, list(sent))

    def open_transfer(self, host: str, world_size: int, generation: int, timeout_s: float) -> TransferAddress:
        """Rank 0: host the transfer group's store on `host` (once, for the run) and say how to join the group's
        `generation` of `world_size` members."""
        if self.transfer_store is None:
            self.transfer_store = TransferStore(host, timeout_s)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        return TransferAddress(host, self.transfer_store.port, world_size, backend, generation)

    def join_transfer(self, address: TransferAddress, timeout_s: float) -> None:
        """Rank 0 joins (or joins again: a group of a later generation) as the sender."""
        if self.rank == 0:
            self.transfer = TransferGroup(address, 0, timeout_s, self.transfer_store)

    def send_bucket(self, keys: tuple[str, ...]) -> None:
        """A collective over the train group (the bucket is gathered); rank 0 then broadcasts it to the engines."""
        full = self._gathered(keys)
        if full is not None:
            sent = adapter_state(full) if self.lora else full
            self.transfer.send(sent, layout_of(sent, list(sent)))

    def _gathered(self, keys: tuple[str, ...] | None) -> dict[str, torch.Tensor] | None:
        """The state dict's `keys` (default: all) gathered onto rank 0's CPU as they are named; None elsewhere."""
        state = get_model_state_dict(self.model)
        full = {}
        for key in keys if keys is not None else list(state):
            value = full_tensor(state[key])
            if self.rank == 0:
                full[key] = value.detach().to("cpu", copy=True)
        return full if self.rank == 0 else None

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Master values at (rows, cols) of the targeted weights (merged W + s·B·A under LoRA), combined
        over the group's row shards; every rank returns the full values."""
        modules = dict(self.model.named_modules())
        local = []
        for name, (rows, cols) in coordinates.items():
            lora = self.lora.get(name)
            weight, offset = local_rows((lora.base_layer if lora else modules[name]).weight)
            held = (rows >= offset) & (rows < offset + weight.shape[0])
            values = torch.full(rows.shape, torch.nan)
            rows_held, cols_held = rows[held] - offset, cols[held]
            values[held] = weight.detach()[rows_held, cols_held].float().cpu()
            if lora is not None:
                b, _ = local_rows(lora.lora_B["default"].weight)
                a = full_tensor(lora.lora_A["default"].weight)
                # adapter_change's value: float64 products summed over the rank, one rounding
                product = (b.detach().double()[rows_held] * a.detach().double()[:, cols_held].t()).sum(dim=1)
                values[held] += (product * lora.scaling["default"]).float().cpu()
            local.append(values)
        flat = torch.cat(local).to(self.device)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        combined = combine_shards([part.cpu() for part in parts])
        return dict(zip(coordinates, combined.split([len(v) for v in local]), strict=True))

    def publish(self, update: WeightUpdate[Payload]) -> WeightUpdate[PayloadRef]:
        """The step's update as the driver gets it: rank 0 serialises each payload into Ray's object store (the
        other ranks hold identical payloads, which would travel for nothing: they answer none)."""
        if not isinstance(update, LowRankPayloads):
            return update
        return LowRankPayloads(tuple(put_payload(p) for p in update.payloads) if self.rank == 0 else ())


def put_payload(payload: Payload) -> PayloadRef:
    """`payload`'s bytes in Ray's object store as a uint8 array: an engine on this node reads it in place
    (an array comes back as a read-only view of the store), where bytes would be copied out first."""
    import ray

    data = np.frombuffer(payload.to_bytes(), dtype=np.uint8)
    return PayloadRef(ray.put(data), data.nbytes, payload.base_version, payload.new_version)
