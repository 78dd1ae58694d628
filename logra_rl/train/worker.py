"""TrainWorker: one training device. FSDP2 over the train group, fp32 master weights, one update rule.

The driver reaches the group through `orchestration.train_group.TrainGroup`, which calls every worker
in lock-step (each call is a collective): `setup`, then per step `train_step` (this rank's shard of
the batch → a `StepResult`), and when asked `resync_bucket` / `weights_at` (the weight sync and its
drift probe) and `save` / `load` (checkpoints). Sums over ranks are all-reduced here, inside the group.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from logra_rl.config import RunConfig
from logra_rl.logra import UpdatePayload, decoder_layers
from logra_rl.models.head import fold_head_inputs
from logra_rl.rl import head_logprobs, policy_gradient_loss
from logra_rl.train.api import FullResync, LowRankPayloads, NoChange, ResyncBucket, StepResult, WeightUpdate
from logra_rl.train.batch import TrainBatch
from logra_rl.train.lora import is_adapter, lora_layers, merged_state
from logra_rl.train.optimizers import KLProbe, Outcome, UpdateInputs, update_rule_class
from logra_rl.utils.device import resolve_device
from logra_rl.utils.memory import peak_rss_bytes, release_free_memory, rss_bytes
from logra_rl.utils.shards import combine_shards, full_tensor, local_rows
from logra_rl.utils.state_dict import tied_duplicates
from logra_rl.utils.timing import Timer

if TYPE_CHECKING:
    import ray

GIB = 2**30
LAYER_KEY = re.compile(r"^(.*\.layers\.\d+)\.")  # a state-dict key inside decoder layer N
ADAPTER_PART = re.compile(r"\.(base_layer|lora_A|lora_B)\..*$")  # peft's parts of one LoRA-wrapped module
# Rank 0 reads the whole checkpoint while the other ranks wait in the first broadcast: allow for a
# 27B fp32 load from slow storage (NCCL's default is 10 minutes).
PROCESS_GROUP_TIMEOUT = timedelta(hours=1)
# Per-token sums of one backward pass, all-reduced over the group in this order.
SUMS = ("tokens", "loss", "is_ratio", "is_truncated", "clipped", "mismatch_all", "mismatch", "mismatch_tokens")
SUMMED_OVER_EPOCHS = (
    "actor/skipped",
    "logra/line_search_tries",
    "logra/overshoot_refused",
    "timing_s/probe",
    "timing_s/line_search",
)  # the other per-update metrics are epoch means


def aggregate_epochs(per_epoch: list[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from its epochs' (PPO): counts and times add up, the rest is the mean over the
    epochs that report it (a skipped LoGRA update reports no logra/alpha, kl_predicted or kl_realized)."""
    keys = dict.fromkeys(key for metrics in per_epoch for key in metrics)
    aggregated = {}
    for key in keys:
        values = [metrics[key] for metrics in per_epoch if key in metrics]
        aggregated[key] = float(sum(values)) if key in SUMMED_OVER_EPOCHS else float(sum(values) / len(values))
    return aggregated


class TrainWorker:
    def __init__(self, config: RunConfig, model_path: str, rank: int, world_size: int) -> None:
        transformers.logging.disable_progress_bar()
        self.config = config
        self.model_path = model_path
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.cluster.device)
        self.temperature = config.rollout.temperature
        self.rule_class = update_rule_class(config)
        self.store: dist.TCPStore | None = None  # rank 0's rendezvous, bound by `address`

    def address(self, host: str | None = None) -> tuple[str, int]:
        """Where rank 0 serves the process group's rendezvous (called on rank 0 before `setup`), on `host` (default:
        this Ray node's address). Its TCPStore binds a free port here and holds it until `setup`: a port found free
        and released would be free for any process to take before the group binds it."""
        if host is None:
            import ray  # the worker runs without Ray too (scripts/gpu_check.py on a bare GPU machine passes a host)

            host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(
            host, 0, self.world_size, is_master=True, timeout=PROCESS_GROUP_TIMEOUT, wait_for_workers=False
        )
        return host, self.store.port

    # ---- set-up -----------------------------------------------------------------------------------

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group, build the fp32 model sharded with FSDP2 (weights read by rank 0), build
        the update rule; returns the policy version (0)."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = self.store  # rank 0's, bound by `address`; else served here (rank 0) or joined, as env:// would
        if store is None:
            store = dist.TCPStore(
                master_addr,
                master_port,
                self.world_size,
                is_master=self.rank == 0,
                timeout=PROCESS_GROUP_TIMEOUT,
                multi_tenant=True,
            )
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world_size, timeout=PROCESS_GROUP_TIMEOUT, store=store
        )
        loaded = None
        if self.rank == 0:
            loaded = self._build(AutoModelForCausalLM.from_pretrained, self.model_path)
        with torch.device("meta"):
            model = self._build(AutoModelForCausalLM.from_config, AutoConfig.from_pretrained(self.model_path))
        self.lora = lora_layers(model)  # empty unless the rule added adapters
        self.model = self._shard(model)
        self.model.to_empty(device=self.device)
        self._receive_weights(loaded)
        del loaded
        release_free_memory()
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        self.decoder, self.output_embeddings = base.get_decoder(), base.get_output_embeddings()
        fold_head_inputs(base)  # the hidden-state pass applies the head to the last position of each row
        self.vocab = self.output_embeddings.weight.shape[0]
        self.logit_softcap = getattr(base.config, "final_logit_softcapping", None)  # Gemma 2 and 3
        self.rule = self.rule_class(self.model, self.config, self.world_size)
        self.model.train()
        return self.rule.version

    def _build(self, constructor: Callable[..., torch.nn.Module], source: str | PretrainedConfig) -> torch.nn.Module:
        """The fp32 model as trained: checkpointing, then what the update rule trains (LoRA: adapters).

        fp32 also on rank 0, which reads the checkpoint: what the model computes at construction (LoRA
        adapters' initial values, buffers such as Gemma's embedding scale) is drawn in the dtype it is built
        in, and the other ranks receive it by broadcast."""
        model_config = self.config.model
        model = constructor(source, dtype=torch.float32, attn_implementation=model_config.attn_implementation)
        if model_config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return self.rule_class.prepare_model(model, self.config)

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
        for layer in decoder_layers(base)[1]:  # Gemma 3's sit under model.language_model
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    # ---- the step ---------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Steps 3–6 on this rank's shard: one update per epoch (PPO), each from a fresh backward.

        Every rank computes the same update from all-reduced sketches or gradients; payload bytes are
        serialised on rank 0 only, whose result `TrainGroup` reports for the group.
        """
        algorithm = self.config.algorithm
        clipped = algorithm.clip_low is not None or algorithm.clip_high is not None
        timer = Timer()
        if clipped and algorithm.epochs > 1:  # with one update, π_old is the current policy: its log-probs serve
            with timer("old_logprobs"):
                batch = replace(batch, old_logprobs=self.logprobs(batch))
        per_epoch, outcomes, first = [], [], {}
        for epoch in range(algorithm.epochs):
            sums = self._forward_backward(batch, timer)
            first = first or sums  # the rollout-vs-trainer mismatch before this step moved the weights
            inputs = UpdateInputs(
                step=step,
                num_tokens=sums["tokens"],
                mismatch_sum=sums["mismatch"] if epoch == 0 else 0.0,
                mismatch_tokens=int(sums["mismatch_tokens"]) if epoch == 0 else 0,
                probe=lambda: self._probe(batch),
            )
            with timer("update"):
                update_metrics, outcome = self.rule.update(inputs)
            outcomes.append(outcome)
            tokens = max(sums["tokens"], 1)
            per_epoch.append(
                {
                    "actor/loss": sums["loss"] / tokens,
                    "actor/is_ratio_mean": sums["is_ratio"] / tokens,
                    "actor/is_truncated_frac": sums["is_truncated"] / tokens,
                    "actor/clip_frac": sums["clipped"] / tokens,
                    "actor/tokens": sums["tokens"],
                    **update_metrics,
                }
            )
            if isinstance(outcome, NoChange):
                break  # nothing moved: a further epoch would rebuild the same update from the same weights
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward-only pass (the probe's)
        release_free_memory()  # the engines generate next: hand them what this step freed
        metrics = aggregate_epochs(per_epoch)
        metrics["rollout/logprob_diff_mean"] = first["mismatch_all"] / max(first["tokens"], 1)
        metrics.update(self._memory_metrics())
        metrics.update(timer.seconds)
        return StepResult(policy_version=self.rule.version, metrics=metrics, update=self._weight_update(outcomes))

    def _weight_update(self, outcomes: list[Outcome]) -> WeightUpdate:
        payloads = [o for o in outcomes if isinstance(o, UpdatePayload)]
        if payloads:  # rank 0 serialises; the other ranks' identical copies would travel for nothing
            return LowRankPayloads(tuple(p.to_bytes() for p in payloads) if self.rank == 0 else ())
        if any(isinstance(o, FullResync) for o in outcomes):
            return FullResync()
        return NoChange("; ".join(o.reason for o in outcomes))

    def _hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's final hidden states, from the root forward (FSDP2's hooks and collectives run)
        told to apply the LM head to the last position only: `_sampled_logprobs` applies it in chunks."""
        captured = []
        hook = self.decoder.register_forward_hook(lambda module, inputs, output: captured.append(output[0]))
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
        finally:
            hook.remove()
        return captured[0]

    def _head(self, states: torch.Tensor) -> torch.Tensor:
        """The LM head (its weight still gathered after the root forward), with the model's logit soft-cap."""
        logits = self.output_embeddings(states)
        return logits if self.logit_softcap is None else self.logit_softcap * torch.tanh(logits / self.logit_softcap)

    def _sampled_logprobs(self, micro: TrainBatch) -> torch.Tensor:
        """π_train log-probs of the loss-mask tokens (0 elsewhere), aligned with input_ids[:, 1:]; the full
        (tokens × vocab) logits never exist."""
        ids = micro.input_ids.to(self.device)
        where = micro.loss_mask[:, 1:].to(self.device).bool()
        hidden = self._hidden_states(ids, micro.attention_mask.to(self.device))[:, :-1]
        values = head_logprobs(hidden[where], self._head, ids[:, 1:][where], self.temperature, self.vocab)
        return torch.zeros(where.shape, dtype=values.dtype, device=self.device).masked_scatter(where, values)

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
        """π_train log-probs of the loss-mask tokens (no grad; 0 elsewhere), aligned like `rollout_logprobs`."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        row = 0
        for micro in self._microbatches(batch):
            values = self._sampled_logprobs(micro if micro is not None else self._filler(batch))
            if micro is not None:
                out[row : row + len(micro), 1 : values.shape[1] + 1] = values.cpu()
                row += len(micro)
        return out

    def _forward_backward(self, batch: TrainBatch, timer: Timer) -> dict[str, float]:
        """Loss and backward over token-budgeted microbatches; returns the group's sums (all-reduced)."""
        algorithm = self.config.algorithm
        sums = dict.fromkeys(SUMS, 0.0)
        for micro in self._microbatches(batch):
            micro = micro if micro is not None else self._filler(batch)  # zero loss mask: zero gradient
            mask = micro.loss_mask[:, 1:].to(self.device)
            rollout = micro.rollout_logprobs[:, 1:].to(self.device)
            old = None if micro.old_logprobs is None else micro.old_logprobs[:, 1:].to(self.device)
            with timer("forward"):
                logprobs = self._sampled_logprobs(micro)
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
            with timer("backward"):
                loss.backward()
            mismatch = (rollout - logprobs.detach()) * mask
            completed = micro.completed.to(self.device)[:, None]
            sums["tokens"] += stats.tokens
            sums["loss"] += float(loss.detach())
            sums["is_ratio"] += stats.is_ratio_sum
            sums["is_truncated"] += stats.is_truncated
            sums["clipped"] += stats.clipped
            sums["mismatch_all"] += float(mismatch.sum())
            sums["mismatch"] += float((mismatch * completed).sum())
            sums["mismatch_tokens"] += float((mask * completed).sum())
        reduced = torch.tensor([sums[key] for key in SUMS], dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced)
        return dict(zip(SUMS, reduced.tolist(), strict=True))

    def _probe(self, batch: TrainBatch) -> KLProbe:
        """The KL probe rows (LoGRA's, and the realised KL of dense and LoRA steps): `probe_responses`
        responses cut to `probe_max_tokens`, spread evenly over this rank's shard (GRPO's consecutive rows
        answer one prompt: the probe should see as many prompts as it can), probed through the decoder's
        hidden states with the LM head applied in chunks of positions (no tokens × vocab logits)."""
        count = min(self.config.logra.kl.probe_responses, len(batch))  # a shard is never empty (config checks)
        probe = batch.rows(torch.arange(count) * (len(batch) // count)).trimmed()
        length = self.config.logra.kl.probe_max_tokens
        return KLProbe(
            forward=lambda ids: self._hidden_states(ids),
            input_ids=probe.input_ids[:, :length].to(self.device),
            loss_mask=probe.loss_mask[:, :length].to(self.device),
            head=self._head,
        )

    def _memory_metrics(self) -> dict[str, float]:
        """Mean current and largest peak memory over the group: CUDA allocator on GPU, process RSS on CPU."""
        if self.device.type == "cuda":
            current, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
        else:
            current, peak = rss_bytes(), peak_rss_bytes()
        mean_current = torch.tensor(float(current), dtype=torch.float64, device=self.device)
        largest_peak = torch.tensor(float(peak), dtype=torch.float64, device=self.device)
        dist.all_reduce(mean_current)
        dist.all_reduce(largest_peak, op=dist.ReduceOp.MAX)
        return {
            "memory/train_avg_gib": float(mean_current) / self.world_size / GIB,
            "memory/train_peak_gib": float(largest_peak) / GIB,
        }

    # ---- weights for the engines --------------------------------------------------------------------

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
            sent = sum(state[k].numel() * state[k].element_size() for k in keys if not is_adapter(k))
            if buckets and buckets[-1].nbytes + sent <= max_bytes:
                buckets[-1] = ResyncBucket(buckets[-1].keys + tuple(keys), buckets[-1].nbytes + sent)
            else:
                buckets.append(ResyncBucket(tuple(keys), sent))
        return buckets

    def full_state(self, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor] | None:
        """The full fp32 values of `keys` (default: the whole state dict) on rank 0's CPU, under HF names
        with LoRA merged; None on the other ranks. A collective: every rank must ask for the same keys."""
        state = get_model_state_dict(self.model)
        full = {}
        for key in keys if keys is not None else list(state):
            value = full_tensor(state[key])
            if self.rank == 0:
                full[key] = value.detach().to("cpu", copy=True)
        if self.rank != 0:
            return None
        if self.lora:
            full = merged_state(full, self.config.optimizer.lora_scaling)
        return full

    def resync_bucket(self, keys: tuple[str, ...]) -> ray.ObjectRef | None:
        """`full_state(keys)` left in Ray's object store on this node (rank 0; None elsewhere) as numpy
        arrays, which the engines read without a copy: the driver passes the reference on to the engines
        and never holds the weights itself."""
        import ray

        state = self.full_state(keys)
        return ray.put({k: v.numpy() for k, v in state.items()}) if state is not None else None

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Master values at (rows, cols) of the targeted weights (merged W + s·B·A under LoRA), combined
        over the group's row shards (a collective); every rank returns the full values."""
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
                update = (b.detach()[rows_held] * a.detach()[:, cols_held].t()).sum(dim=1)
                values[held] += (lora.scaling["default"] * update).float().cpu()
            local.append(values)
        flat = torch.cat(local).to(self.device)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        combined = combine_shards([part.cpu() for part in parts])
        return dict(zip(coordinates, combined.split([len(v) for v in local]), strict=True))

    # ---- checkpoints ------------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """Sharded model state with torch.distributed.checkpoint, then the update rule's own state."""
        path = Path(directory)
        dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=path / "model")
        self.rule.save(path)
        dist.barrier()

    def load(self, directory: str) -> int:
        """Restore a checkpoint written by `save`; returns its policy version."""
        path = Path(directory)
        state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=path / "model")
        set_model_state_dict(self.model, state["model"])
        self.rule.load(path)
        return self.rule.version

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
