"""TrainWorker: one training device. FSDP2 over the train group, fp32 master weights, one update rule.

The driver reaches the group through `orchestration.train_group.TrainGroup`, which calls every worker
in lock-step (each call is a collective): `setup`, then per step `train_step` (this rank's shard of
the batch → a `StepResult`), and when asked `resync_bucket` / `weights_at` (the weight sync and its
drift check, answered by `weight_export.WeightExport`) and `save` / `load` (checkpoints). Sums over ranks
are all-reduced here, inside the group.
"""

from __future__ import annotations

import functools
import math
import os
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
from logra_rl.logra import KLReference, KLRows, Payload, ProbeError, decoder_layers
from logra_rl.models.footprint import LOADING, TRAINING, ModelFootprint, Part
from logra_rl.models.head import LMHead, fold_head_inputs
from logra_rl.models.prefill import prompt_prefill
from logra_rl.rl import head_logprobs, policy_gradient_loss
from logra_rl.rl.logprobs import logprob_chunk
from logra_rl.train.api import (
    FullResync,
    LowRankPayloads,
    NoChange,
    ResyncBucket,
    StaleBatch,
    StepResult,
    WeightUpdate,
)
from logra_rl.train.batch import TrainBatch
from logra_rl.train.lora import lora_layers
from logra_rl.train.optimizers import (
    UpdateInputs,
    kept_predictions,
    moved,
    policy_forward,
    predictions,
    update_rule_class,
)
from logra_rl.train.weight_export import WeightExport
from logra_rl.utils.device import compute_dtype, resolve_device
from logra_rl.utils.memory import GIB, peak_rss_bytes, release_free_memory, rss_bytes
from logra_rl.utils.seeding import KL_ROWS_STREAM, stream_seed
from logra_rl.utils.timing import Timer
from logra_rl.utils.transfer import TRANSFER_TIMEOUT_S, Layout, TransferAddress

if TYPE_CHECKING:
    import ray

# Rank 0 reads the whole checkpoint while the other ranks wait in the first broadcast: allow for a
# 27B fp32 load from slow storage (NCCL's default is 10 minutes).
PROCESS_GROUP_TIMEOUT = timedelta(hours=1)
# Per-token sums of one backward pass, all-reduced over the group in this order.
SUMS = (
    "tokens",
    "loss",
    "is_ratio",
    "is_truncated",
    "clipped",
    "entropy",
    "mismatch_all",
    "mismatch",
    "mismatch_tokens",
    "behaviour_kl",
)
SUMMED_OVER_EPOCHS = (
    "train/skipped",
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


def step_update(updates: list[WeightUpdate[Payload]]) -> WeightUpdate[Payload]:
    """One step's update from its epochs' (PPO): every committed payload in order, else a full resync if any
    epoch moved every weight, else nothing."""
    payloads = tuple(p for update in updates if isinstance(update, LowRankPayloads) for p in update.payloads)
    if payloads:
        return LowRankPayloads(payloads)
    if any(isinstance(update, FullResync) for update in updates):
        return FullResync()
    return NoChange("; ".join(update.reason for update in updates))


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

    @staticmethod
    def memory(
        config: RunConfig, model: ModelFootprint, saved_per_token: float, sequence: int, cuda: bool
    ) -> tuple[list[Part], list[Part], Part]:
        """What a rank holds besides its update rule's state, for the memory plan: its resident parts, its
        training transients, and rank 0's checkpoint copy while it loads. `saved_per_token`: the bytes one
        decoder layer keeps for backward per token as the update rule trains it (`RuleMemory`)."""
        ranks, c = config.cluster.train_workers, model.compute_bytes
        # FSDP2 gathers a layer group into a flat buffer, then copies it out into the unsharded parameters: the
        # root (embeddings, head) stays unsharded through forward and backward, one layer is computed while the
        # next is gathered
        gathered = c * (2 * model.root_params + 3 * model.layer_params)
        rows = math.ceil(config.trainer.prompts_per_step * config.rollout.n / ranks)  # responses a step
        # the largest microbatch: the token budget (or one whole sequence), or the rank's whole share when less
        tokens = min(max(config.trainer.micro_batch_tokens, sequence), rows * sequence)
        # backward needs every layer's saved tensors, or with activation checkpointing each layer's input plus
        # one layer recomputed
        if config.model.activation_checkpointing:
            activations = tokens * (model.layers * model.hidden * c + saved_per_token)
        else:
            activations = tokens * model.layers * saved_per_token
        # the response tokens' log-probs through the LM head in chunks (`rl.head_logprobs`): one chunk's logits
        # in the compute dtype, as fp32 and scaled, and in backward their gradient (the last chunk is kept); an
        # entropy bonus keeps the chunk's probabilities too
        responses = min(tokens, rows * config.data.max_response_length)
        fp32_copies = 3 + (config.algorithm.entropy_coeff > 0)
        logits = min(responses, logprob_chunk(model.vocab)) * model.vocab * (c + fp32_copies * 4)
        training = [
            Part("unsharded weights", gathered, TRAINING),
            Part("activations", activations, TRAINING),
            Part("logits", logits, TRAINING),
        ]
        if config.trainer.heldout_every:  # the held-out rows' predictions, kept through the update
            length = min(sequence, config.logra.kl.probe_max_tokens)
            rows = min(config.trainer.heldout_responses, rows)
            kept = kept_predictions(model, rows, length, update_rule_class(config).trains_head)
            training.append(Part("held-out predictions", kept, TRAINING))
        # rank 0 reads the whole checkpoint as fp32 into host memory while its shards exist, then broadcasts it;
        # an fp32 checkpoint is memory-mapped (page cache, which the kernel reclaims), any other is converted
        loaded = 0 if model.checkpoint_bytes == 4 else 4 * model.params
        return [Part("weights", 4 * model.params / ranks)], training, Part("checkpoint copy", loaded, LOADING, cuda)

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
        lora = lora_layers(model)  # empty unless the rule added adapters
        self.model = self._shard(model)
        self.model.to_empty(device=self.device)
        self._receive_weights(loaded)
        del loaded
        release_free_memory()
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        self.decoder, self.output_embeddings = base.get_decoder(), base.get_output_embeddings()
        fold_head_inputs(base)  # the hidden-state pass applies the head to the last position of each row
        self.vocab = self.output_embeddings.weight.shape[0]
        self.head = LMHead(self.output_embeddings, getattr(base.config, "final_logit_softcapping", None))
        # The train step's forward gives the guard its unstepped one where both compute the same numbers: fp32
        # (batches padded differently agree to ~1e-7; in bf16 they differ by an ulp) and no dropout
        dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in base.modules())
        dropout = dropout or bool(getattr(base.config, "attention_dropout", 0))
        self.rule = self.rule_class(self.model, self.config, self.world_size)
        self.measures_in_training = self.compute == "float32" and not dropout and self.rule.measures_kl
        scaling = self.config.optimizer.lora_scaling
        self.export = WeightExport(self.model, lora, scaling, self.rank, self.world_size, self.device)
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
        self.compute = compute = compute_dtype(self.config.model.compute_dtype, self.device.type == "cuda")
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, compute), reduce_dtype=torch.float32)
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        for layer in decoder_layers(base)[1]:  # Gemma 3's sit under model.language_model
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    # ---- the step ---------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Steps 3–6 on this rank's shard (`train`); rank 0 alone puts the payloads into Ray's object store, and
        its result is the one `TrainGroup` reports for the group."""
        metrics, update = self.train(batch, step)
        return StepResult(policy_version=self.rule.version, metrics=metrics, update=self.export.publish(update))

    def train(self, batch: TrainBatch, step: int) -> tuple[dict[str, float], WeightUpdate[Payload]]:
        """One update per epoch (PPO), each from a fresh backward: the step's metrics and its update, as objects
        (Ray-free callers, the GPU check, read the payloads here). Every rank computes the same update from
        all-reduced sketches or gradients."""
        algorithm = self.config.algorithm
        clipped = algorithm.clip_low is not None or algorithm.clip_high is not None
        timer = Timer()
        batch, guard, heldout = self._split(batch, step)
        keep = guard if self.measures_in_training else None  # the guard rows' hidden states from the train forward
        if clipped and algorithm.epochs > 1:  # with one update, π_old is the current policy: its log-probs serve
            with timer("old_logprobs"):
                batch = replace(batch, old_logprobs=self.logprobs(batch))
        per_epoch, updates = [], []
        staleness = self.rule.version - self._sampled_version(batch)
        for epoch in range(algorithm.epochs):
            sums, kept = self._forward_backward(batch, timer, keep)
            if epoch == 0:  # the mismatch and behaviour KL before this step moved the weights
                first, behaviour_kl = sums, sums["behaviour_kl"] / max(sums["tokens"], 1)
                bound = self.rule.staleness_bound(staleness) if staleness else math.inf
                if step == 0:
                    algorithm.check_staleness_bound(behaviour_kl)
                if behaviour_kl > bound or (staleness and not math.isfinite(behaviour_kl)):
                    self.rule.drop_backward()  # nothing moves: the controller has the batch sampled again
                    self.rule.refuse(step, staleness, behaviour_kl)
                    reason = f"stale batch: behaviour KL {behaviour_kl:.3g} > the staleness bound {bound:.3g}"
                    metrics = {"train/skipped": float(algorithm.epochs), **timer.seconds}
                    return metrics | self._staleness_metrics(staleness, behaviour_kl, bound), StaleBatch(reason)
                if heldout is not None:
                    with timer("heldout"), policy_forward(self.model):
                        before = predictions(heldout, self.rule_class.trains_head, self.temperature)
            inputs = UpdateInputs(
                step=step,
                num_tokens=sums["tokens"],
                mismatch_sum=sums["mismatch"] if epoch == 0 else 0.0,
                mismatch_tokens=int(sums["mismatch_tokens"]) if epoch == 0 else 0,
                kl_rows=functools.partial(self._kl_rows, batch.rows(guard), kept),
                staleness=staleness if epoch == 0 else 0,
                behaviour_kl=behaviour_kl if epoch == 0 else None,
            )
            with timer("update"):
                update_metrics, update = self.rule.update(inputs)
            updates.append(update)
            tokens = max(sums["tokens"], 1)
            per_epoch.append(
                {
                    "train/loss": sums["loss"] / tokens,
                    "train/is_ratio_mean": sums["is_ratio"] / tokens,
                    "train/is_truncated_frac": sums["is_truncated"] / tokens,
                    "train/clip_frac": sums["clipped"] / tokens,
                    "train/entropy": sums["entropy"] / tokens,
                    "train/tokens": sums["tokens"],
                    **update_metrics,
                }
            )
            if isinstance(update, NoChange):
                break  # nothing moved: a further epoch would rebuild the same update from the same weights
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward-only pass (the guard's)
        metrics = aggregate_epochs(per_epoch)
        if heldout is not None:
            with timer("heldout"):
                metrics.update(self._heldout_metrics(before, heldout, per_epoch))
        release_free_memory()  # the engines generate next: hand them what this step freed
        metrics["train/mismatch"] = first["mismatch_all"] / max(first["tokens"], 1)
        metrics.update(self._staleness_metrics(staleness, behaviour_kl, bound))
        metrics.update(self._memory_metrics())
        metrics.update(timer.seconds)
        return metrics, step_update(updates)

    def _split(self, batch: TrainBatch, step: int) -> tuple[TrainBatch, torch.Tensor, KLRows | None]:
        """This rank's rows in a random order (seeded by the run's seed, the step and the rank): on a held-out
        step (every `trainer.heldout_every`) the first `trainer.heldout_responses` (at most a quarter of the rows)
        are withheld from the gradient and the KL guard; the guard measures the next `logra.kl.guard_responses`
        (0: all the rest). Returns the rows to train on (in their order), the guard's (indices into them) and the
        held-out rows (None on other steps)."""
        trainer, kl = self.config.trainer, self.config.logra.kl
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(self._seed(step, KL_ROWS_STREAM)))
        withheld = 0
        if trainer.heldout_every and step % trainer.heldout_every == 0:
            count = torch.tensor(min(trainer.heldout_responses, len(batch) // 4), device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank measures, or none: each forward is collective
            withheld = int(count)
        train = order[withheld:]
        guard = train[: kl.guard_responses or len(train)]
        heldout = self._kl_rows(batch.rows(order[:withheld])) if withheld else None
        kept = train.sort().values
        return batch.rows(kept), torch.searchsorted(kept, guard), heldout

    def _seed(self, step: int, stream: int) -> int:
        return stream_seed(self.config.trainer.seed, step, stream, self.rank)

    def _heldout_metrics(self, before: KLReference, heldout: KLRows, per_epoch: list[dict[str, float]]) -> dict:
        """heldout/kl: how far the step's committed updates moved the policy on rows neither the gradient nor the
        guard saw; heldout/kl_budget: the sum of those updates' budgets (LoGRA)."""
        committed = [m for m in per_epoch if not m.get("train/skipped")]
        if not committed:
            return {}
        try:
            with policy_forward(self.model):
                kl = moved(before, heldout)
        except (ProbeError, FloatingPointError):
            return {}
        budgets = [m["logra/kl_budget"] for m in committed if "logra/kl_budget" in m]
        return {"heldout/kl": kl} | ({"heldout/kl_budget": sum(budgets)} if budgets else {})

    def _sampled_version(self, batch: TrainBatch) -> int:
        """The oldest policy version that sampled a row of the group's batch (rows that do not say: this one's)."""
        version = self.rule.version
        if batch.policy_version is not None and len(batch.policy_version):
            recorded = batch.policy_version[batch.policy_version >= 0]
            version = min(version, int(recorded.min())) if len(recorded) else version
        oldest = torch.tensor(version, device=self.device)
        dist.all_reduce(oldest, op=dist.ReduceOp.MIN)
        return int(oldest)

    @staticmethod
    def _staleness_metrics(staleness: int, behaviour_kl: float, bound: float) -> dict[str, float]:
        """async/staleness: updates between the policy that sampled the batch and the one trained on it;
        async/behaviour_kl: KL(π_behaviour ‖ π_train) per token on the batch before this step moved the weights
        (on an on-policy batch, the rollout-vs-trainer numerics alone); async/staleness_bound: the bound a stale
        batch's was read against."""
        bounded = {"async/staleness_bound": bound} if math.isfinite(bound) else {}
        return {"async/staleness": float(staleness), "async/behaviour_kl": behaviour_kl, **bounded}

    def _hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **cached: object
    ) -> torch.Tensor:
        """The decoder's final hidden states, from the root forward (FSDP2's hooks and collectives run)
        told to apply the LM head to the last position only: `_sampled_logprobs` applies it in chunks. `cached`:
        `past_key_values` (extended in place) and the `position_ids` that follow them."""
        captured = []
        hook = self.decoder.register_forward_hook(lambda module, inputs, output: captured.append(output[0]))
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1, **cached)
        finally:
            hook.remove()
        return captured[0]

    def _sampled_logprobs(
        self, micro: TrainBatch, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """π_train log-probs of the loss-mask tokens and the policy's entropy there (0 elsewhere; differentiable
        where the loss has an entropy bonus; None without `with_entropy`), aligned with input_ids[:, 1:], and the
        final hidden states they came from; the full (tokens × vocab) logits never exist."""
        ids = micro.input_ids.to(self.device)
        where = micro.loss_mask[:, 1:].to(self.device).bool()
        states = self._hidden_states(ids, micro.attention_mask.to(self.device))
        bonus = self.config.algorithm.entropy_coeff > 0
        values, entropy = head_logprobs(
            states[:, :-1][where],
            self.head,
            ids[:, 1:][where],
            self.temperature,
            self.vocab,
            entropy_grad=bonus,
            with_entropy=with_entropy,
        )
        zeros = torch.zeros(where.shape, dtype=values.dtype, device=self.device)
        entropy = None if entropy is None else zeros.masked_scatter(where, entropy)
        return zeros.masked_scatter(where, values), entropy, states

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
            inputs = micro if micro is not None else self._filler(batch)
            values, _, _ = self._sampled_logprobs(inputs, with_entropy=False)  # the no-grad pass: no entropy
            if micro is not None:
                out[row : row + len(micro), 1 : values.shape[1] + 1] = values.cpu()
                row += len(micro)
        return out

    def _forward_backward(
        self, batch: TrainBatch, timer: Timer, keep: torch.Tensor | None = None
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """Loss and backward over token-budgeted microbatches; returns the group's sums (all-reduced), and the final
        hidden states of the rows `keep` indexes (rows × their longest length × hidden; None without `keep`)."""
        algorithm = self.config.algorithm
        sums = dict.fromkeys(SUMS, 0.0)
        kept: dict[int, torch.Tensor] = {}
        wanted = set() if keep is None else set(keep.tolist())
        first = 0  # the batch row of the microbatch's first row: microbatches are consecutive rows
        for micro in self._microbatches(batch):
            filler = micro is None
            micro = micro if micro is not None else self._filler(batch)  # zero loss mask: zero gradient
            mask = micro.loss_mask[:, 1:].to(self.device)
            rollout = micro.rollout_logprobs[:, 1:].to(self.device)
            old = None if micro.old_logprobs is None else micro.old_logprobs[:, 1:].to(self.device)
            with timer("forward"):
                logprobs, entropy, states = self._sampled_logprobs(micro)
                if not filler:
                    for row in wanted.intersection(range(first, first + len(micro))):
                        kept[row] = states[row - first].detach().clone()  # not the whole microbatch
                    first += len(micro)
                loss, stats = policy_gradient_loss(
                    logprobs,
                    rollout,
                    micro.advantages.to(self.device),
                    mask,
                    tis_cap=algorithm.tis_cap,
                    old_logprobs=old,
                    clip_low=algorithm.clip_low,
                    clip_high=algorithm.clip_high,
                    entropy=entropy,
                    entropy_coeff=algorithm.entropy_coeff,
                )
            with timer("backward"):
                loss.backward()
            mismatch = (rollout - logprobs.detach()) * mask
            # KL(π_behaviour ‖ π_train) per sampled token, the non-negative estimator r − 1 − log r, r = π_train/π_b
            log_ratio = (logprobs.detach() - rollout).clamp(max=20.0)
            behaviour_kl = (log_ratio.exp() - 1 - log_ratio) * mask
            finished = micro.finished.to(self.device)[:, None]
            sums["tokens"] += stats.tokens
            sums["loss"] += float(loss.detach())
            sums["is_ratio"] += stats.is_ratio_sum
            sums["is_truncated"] += stats.is_truncated
            sums["clipped"] += stats.clipped
            sums["entropy"] += stats.entropy
            sums["mismatch_all"] += float(mismatch.sum())
            sums["mismatch"] += float((mismatch * finished).sum())
            sums["mismatch_tokens"] += float((mask * finished).sum())
            sums["behaviour_kl"] += float(behaviour_kl.sum())
        reduced = torch.tensor([sums[key] for key in SUMS], dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced)
        states = None
        if keep is not None:  # right-padded to the longest (positions past a row's end are never read)
            states = torch.nn.utils.rnn.pad_sequence([kept[int(row)] for row in keep], batch_first=True)
        return dict(zip(SUMS, reduced.tolist(), strict=True)), states

    def _kl_rows(self, rows: TrainBatch, features: torch.Tensor | None = None) -> KLRows:
        """Rows a KL is measured on, cut after their last token and to `logra.kl.probe_max_tokens`, each distinct one
        once, probed through the decoder's hidden states with the LM head applied in chunks of positions (no tokens ×
        vocab logits); `features`: their hidden states from the train step's forward."""
        rows, kl = rows.trimmed(), self.config.logra.kl
        measured = KLRows(
            forward=lambda ids: self._hidden_states(ids),
            input_ids=rows.input_ids.to(self.device),
            loss_mask=rows.loss_mask.to(self.device),
            head=self.head,
            forward_tokens=kl.forward_tokens,
            features=features,  # `first` cuts them to the rows' length
            # off GPUs only: the memory plan does not count the prompts' keys and values (and a copy per forward)
            prefill=None if self.device.type == "cuda" else prompt_prefill(self._hidden_states, self.model.config),
        )
        return measured.first(len(rows.input_ids), kl.probe_max_tokens).distinct()  # the length the plan counts

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

    # ---- weights for the engines (logra_rl.train.weight_export) ----------------------------------

    def resync_buckets(self, max_bytes: int) -> list[ResyncBucket]:
        return self.export.resync_buckets(max_bytes)

    def resync_bucket(self, keys: tuple[str, ...]) -> ray.ObjectRef | None:
        return self.export.resync_bucket(keys)

    def full_state(self, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor] | None:
        return self.export.full_state(keys)

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self.export.weights_at(coordinates)

    def bucket_layout(self, keys: tuple[str, ...]) -> Layout:
        return self.export.bucket_layout(keys)

    def open_transfer(self, world_size: int, generation: int) -> TransferAddress:
        import ray

        host = ray.util.get_node_ip_address()
        return self.export.open_transfer(host, world_size, generation, TRANSFER_TIMEOUT_S)

    def join_transfer(self, address: TransferAddress) -> None:
        self.export.join_transfer(address, TRANSFER_TIMEOUT_S)

    def send_bucket(self, keys: tuple[str, ...]) -> None:
        self.export.send_bucket(keys)

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
