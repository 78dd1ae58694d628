"""TrainWorker: one training device. FSDP2 over the train group, fp32 master weights, LoGRA or dense.

The controller drives every worker of the group in lock-step (each call is a collective):
`setup` → per step `forward_backward` (its shard of the batch) → `update` → and, when asked,
`full_state` / `weights_at` (sync and drift probe), `save` / `load` (checkpoints), `memory`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from logra_rl.config import RunConfig
from logra_rl.logra.optimizer import local_rows
from logra_rl.rl import policy_gradient_loss
from logra_rl.train.batch import TrainBatch
from logra_rl.train.lora import add_lora, is_adapter, lora_layers, merged_state
from logra_rl.train.optimizers import DenseUpdate, LoGRAUpdate
from logra_rl.utils.memory import peak_rss_bytes, rss_bytes
from logra_rl.utils.state_dict import tied_duplicates

GIB = 2**30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cluster.device=cuda but CUDA is not available in this worker; use cluster.device=auto")
    return torch.device(name, 0) if name == "cuda" else torch.device(name)


LAYER_KEY = re.compile(r"^(.*\.layers\.\d+)\.")  # a state-dict key inside decoder layer N
ADAPTER_PART = re.compile(r"\.(base_layer|lora_A|lora_B)\..*$")  # peft's parts of one LoRA-wrapped module
# Rank 0 reads the whole checkpoint while the other ranks wait in the first broadcast: allow for a
# 27B fp32 load from slow storage (NCCL's default is 10 minutes).
PROCESS_GROUP_TIMEOUT = timedelta(hours=1)
LOGPROB_CHUNK = 1024  # positions per fp32 log-softmax: bounds the (positions × vocab) temporaries


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token t | < t) for t ≥ 1, aligned with input_ids[:, 1:] (float32), in position chunks."""
    logits, targets = logits[:, :-1], input_ids[:, 1:, None]
    chunks = []
    for start in range(0, targets.shape[1], LOGPROB_CHUNK):
        chunk = logits[:, start : start + LOGPROB_CHUNK].float() / temperature
        picked = chunk.gather(-1, targets[:, start : start + LOGPROB_CHUNK]).squeeze(-1)
        chunks.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(chunks, dim=1)


class TrainWorker:
    def __init__(self, config: RunConfig, model_path: str, rank: int, world_size: int) -> None:
        transformers.logging.disable_progress_bar()
        self.config = config
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.cluster.device)
        self.temperature = config.rollout.temperature
        self._batch: TrainBatch | None = None  # this step's shard, kept for the KL probe

    @staticmethod
    def address() -> tuple[str, int]:
        """An address rank 0 can serve the process group on (called on rank 0 before `setup`)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> dict[str, float]:
        """Join the process group, build the fp32 model sharded with FSDP2 (weights read by rank 0), build
        the optimizer."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=PROCESS_GROUP_TIMEOUT)
        loaded = None
        if self.rank == 0:
            loaded = self._build(AutoModelForCausalLM.from_pretrained, self.model_path)
        with torch.device("meta"):
            model = self._build(AutoModelForCausalLM.from_config, AutoConfig.from_pretrained(self.model_path))
        self.lora = lora_layers(model) if isinstance(model, PeftModel) else None
        self.model = self._shard(model)
        self.model.to_empty(device=self.device)
        self._receive_weights(loaded)
        del loaded
        kind = self.config.optimizer.name
        if kind == "logra":
            self.optimizer = LoGRAUpdate(self.model, self.config.logra, self.temperature)
        else:
            self.optimizer = DenseUpdate(self.model, self.config.optimizer, self.world_size)
        self.model.train()
        return self.memory()

    def _build(self, constructor: Callable[..., torch.nn.Module], source: str | PretrainedConfig) -> torch.nn.Module:
        """The fp32 model as trained: checkpointing, trainable parameters, LoRA adapters (seeded)."""
        model_config = self.config.model
        model = constructor(source, dtype=torch.float32, attn_implementation=model_config.attn_implementation)
        if model_config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        kind = self.config.optimizer.name
        model.requires_grad_(kind == "dense")
        if kind == "lora":
            torch.manual_seed(self.config.trainer.seed)
            model = add_lora(model, self.config.optimizer)
        return model

    def _receive_weights(self, loaded: torch.nn.Module | None) -> None:
        """Fill the empty shards from rank 0's full model (`loaded`; None on the other ranks).

        Only rank 0 reads the checkpoint, so host memory holds one full fp32 copy per node instead of
        one per rank (27B: 108 GB instead of 432 GB on 4 ranks); the others build on the meta device.
        Buffers (rotary frequencies, which are not in the state dict) are broadcast too.
        """
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, loaded.state_dict() if loaded is not None else {}, options=options)
        source = dict(loaded.named_buffers()) if loaded is not None else {}
        for name, buffer in self.model.named_buffers():
            if loaded is not None:
                buffer.copy_(source[name])
            dist.broadcast(buffer, src=0)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        compute = self.config.model.compute_dtype
        if compute == "auto":
            compute = "bfloat16" if self.device.type == "cuda" else "float32"
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, compute), reduce_dtype=torch.float32)
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _microbatches(self, batch: TrainBatch) -> list[TrainBatch | None]:
        """This rank's microbatches, padded with None to the group's largest count.

        Every FSDP2 forward and backward is a collective, so all ranks must run the same number:
        a None entry is run on a loss-free row (zero gradient) just to take part.
        """
        micro = batch.microbatches(self.config.trainer.micro_batch_tokens)
        count = torch.tensor(len(micro), device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return micro + [None] * (int(count) - len(micro))

    def _filler(self, batch: TrainBatch) -> TrainBatch:
        row = batch.rows(slice(0, 1)).trimmed()
        row.loss_mask = torch.zeros_like(row.loss_mask)
        return row

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """π_train log-probs of every token (no grad), aligned like `rollout_logprobs` (column 0 is 0)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        row = 0
        for micro in self._microbatches(batch):
            part = micro if micro is not None else self._filler(batch)
            ids = part.input_ids.to(self.device)
            values = token_logprobs(self._logits(ids, part.attention_mask.to(self.device)), ids, self.temperature)
            if micro is not None:
                out[row : row + len(micro), 1 : values.shape[1] + 1] = values.cpu()
                row += len(micro)
        return out

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Loss and backward over token-budgeted microbatches; returns sums the controller reduces."""
        algorithm = self.config.algorithm
        sums = dict.fromkeys(
            ["tokens", "loss", "is_ratio", "is_truncated", "clipped", "gap", "gap_tokens", "gap_all"], 0.0
        )
        for micro in self._microbatches(batch):
            micro = micro if micro is not None else self._filler(batch)  # zero loss mask: zero gradient
            ids = micro.input_ids.to(self.device)
            logits = self._logits(ids, micro.attention_mask.to(self.device))
            logprobs = token_logprobs(logits, ids, self.temperature)
            mask = micro.loss_mask[:, 1:].to(self.device)
            rollout = micro.rollout_logprobs[:, 1:].to(self.device)
            old = None if micro.old_logprobs is None else micro.old_logprobs[:, 1:].to(self.device)
            loss, stats = policy_gradient_loss(
                logprobs,
                rollout,
                micro.advantages.to(self.device),
                mask,
                tis_cap=algorithm.tis_cap,
                old_logprobs=old,
                clip_low=algorithm.clip_low,
                clip_high=algorithm.clip_high,
            )
            loss.backward()
            gap = (rollout - logprobs.detach()) * mask
            completed = micro.completed.to(self.device)[:, None]
            sums["tokens"] += stats.tokens
            sums["loss"] += float(loss.detach())
            sums["is_ratio"] += stats.is_ratio_sum
            sums["is_truncated"] += stats.is_truncated
            sums["clipped"] += stats.clipped
            sums["gap_all"] += float(gap.sum())
            sums["gap"] += float((gap * completed).sum())
            sums["gap_tokens"] += float((mask * completed).sum())
        self._batch = batch
        return sums

    def update(self, step: int, num_tokens: float, mismatch_sum: float, mismatch_count: int):
        """One optimizer update from the accumulated backward; returns (metrics, payload bytes or None)."""
        if isinstance(self.optimizer, DenseUpdate):  # dense AdamW or LoRA: no KL probe, no payload
            return self.optimizer.update(step, num_tokens)
        probe = self._batch.rows(slice(0, self.config.logra.kl.probe_responses)).trimmed()
        self.model.eval()
        try:
            metrics, payload = self.optimizer.update(
                step=step,
                num_tokens=num_tokens,
                forward=lambda ids: self._logits(ids),
                probe_ids=probe.input_ids.to(self.device),
                probe_mask=probe.loss_mask.to(self.device),
                mismatch_sum=mismatch_sum,
                mismatch_count=mismatch_count,
                serialise=self.rank == 0,
            )
        finally:
            self.model.train()
        return metrics, payload

    def state_buckets(self, max_bytes: int) -> list[tuple[list[str], int]]:
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
        buckets: list[tuple[list[str], int]] = []
        for keys in groups.values():
            sent = sum(state[k].numel() * state[k].element_size() for k in keys if not is_adapter(k))
            if buckets and buckets[-1][1] + sent <= max_bytes:
                buckets[-1] = (buckets[-1][0] + keys, buckets[-1][1] + sent)
            else:
                buckets.append((keys, sent))
        return buckets

    def full_state(self, keys: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """The full fp32 values of `keys` (default: the whole state dict) on rank 0's CPU, under HF names
        with LoRA merged; None on the other ranks. A collective: every rank must ask for the same keys."""
        state = get_model_state_dict(self.model)
        full = {}
        for key in keys if keys is not None else list(state):
            value = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
            if self.rank == 0:
                full[key] = value.detach().to("cpu", copy=True)
        if self.rank != 0:
            return None
        if self.lora:
            full = merged_state(full, self.config.optimizer.lora_scaling)
        return full

    def full_state_ref(self, keys: list[str]) -> ray.ObjectRef | None:
        """`full_state(keys)` left in Ray's object store on this node (rank 0; None elsewhere): the driver
        passes the reference on to the engines and never holds the weights itself."""
        state = self.full_state(keys)
        return ray.put(state) if state is not None else None

    def weights_at(
        self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Master values at (rows, cols) of the targeted weights (merged W + s·B·A under LoRA), and which
        of them this rank holds."""
        modules = dict(self.model.named_modules())
        values = {}
        for name, (rows, cols) in coordinates.items():
            lora = self.lora.get(name) if self.lora else None
            local, offset = local_rows((lora.base_layer if lora else modules[name]).weight)
            held = (rows >= offset) & (rows < offset + local.shape[0])
            result = torch.zeros(rows.shape)
            local_rows_held, cols_held = rows[held] - offset, cols[held]
            result[held] = local.detach()[local_rows_held, cols_held].float().cpu()
            if lora is not None:
                b, _ = local_rows(lora.lora_B["default"].weight)
                a = lora.lora_A["default"].weight
                a = a.full_tensor() if isinstance(a, DTensor) else a
                update = (b.detach()[local_rows_held] * a.detach()[:, cols_held].t()).sum(dim=1)
                result[held] += (lora.scaling["default"] * update).float().cpu()
            values[name] = (result, held)
        return values

    def save(self, directory: str) -> None:
        """Sharded model (and dense optimizer) state with torch.distributed.checkpoint; LoGRA state on rank 0."""
        path = Path(directory)
        dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=path / "model")
        if isinstance(self.optimizer, DenseUpdate):
            state = get_optimizer_state_dict(self.model, self.optimizer.optimizer)
            dcp.save({"optimizer": state}, checkpoint_id=path / "optimizer")
        if self.rank == 0:
            torch.save(self.optimizer.state_dict(), path / "update_state.pt")
        dist.barrier()

    def load(self, directory: str) -> None:
        path = Path(directory)
        state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=path / "model")
        set_model_state_dict(self.model, state["model"])
        if isinstance(self.optimizer, DenseUpdate):
            optim_state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer.optimizer)}
            dcp.load(optim_state, checkpoint_id=path / "optimizer")
            set_optimizer_state_dict(self.model, self.optimizer.optimizer, optim_state["optimizer"])
        self.optimizer.load_state_dict(torch.load(path / "update_state.pt", weights_only=True))

    def memory(self) -> dict[str, float]:
        """Current and peak memory of this worker: CUDA allocator on GPU, process RSS on CPU."""
        if self.device.type == "cuda":
            return {
                "current_gib": torch.cuda.memory_allocated(self.device) / GIB,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
            }
        return {"current_gib": rss_bytes() / GIB, "peak_gib": peak_rss_bytes() / GIB}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
