"""The update rules a TrainWorker can run, behind one interface: LoGRA (default), dense AdamW, LoRA.

A rule first prepares the fp32 model before it is sharded (`prepare_model`: which parameters train,
LoRA adapters), then takes the accumulated backward (a token-sum loss) and `UpdateInputs`, and
answers with its metrics and what changed, a `WeightUpdate`: the committed payload (LoGRA's `UpdatePayload`,
LoRA's `AdapterPayload`), `FullResync` (dense: every weight moved) or `NoChange` (the update was skipped).
`UPDATE_RULES` names the rules (`optimizer.name`'s choices), and each says what it holds (`memory`: the
memory plan's train-rank state, KL probe and payload).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule

from logra_rl.config import OptimizerConfig, RunConfig
from logra_rl.logra import (
    ATTENTION_BLOCK,
    POSITION_CHUNK,
    REFERENCE_BYTES,
    KLReference,
    KLRows,
    LoGRAOptimizer,
    Payload,
    ProbeError,
    features,
    kl_estimate,
    masked_logits,
    row_kl,
)
from logra_rl.models.footprint import TRAINING, ModelFootprint, Part
from logra_rl.models.head import LMHead
from logra_rl.train.api import FullResync, LowRankPayloads, NoChange, WeightUpdate
from logra_rl.train.lora import adapter_payload, add_lora, lora_layers
from logra_rl.utils.checkpoint import UPDATE_STATE
from logra_rl.utils.shards import full_tensor


@dataclass(frozen=True)
class UpdateInputs:
    """Everything an update may use besides the accumulated gradients or sketches; group-wide values."""

    step: int
    num_tokens: float  # loss tokens over all ranks
    mismatch_sum: float  # Σ log π_rollout − log π_train over finished responses' tokens (0 after epoch 0)
    mismatch_tokens: int
    # the rows the step's KL is measured on (the guard's; the probe takes the first ones); built only by a rule
    # that measures KL (LoGRA; dense and LoRA with measure_kl)
    kl_rows: Callable[[], KLRows]
    staleness: int = 0  # updates since the policy that sampled the batch (algorithm.max_staleness; 0: this one)
    behaviour_kl: float | None = None  # KL(π_behaviour ‖ π_train) per token of the batch (epoch 0; None after)


@contextmanager
def policy_forward(model: nn.Module) -> Iterator[None]:
    """The policy as the engines run it (eval mode: no dropout; no gradients), on every rank (FSDP2's forward is a
    collective). Train mode comes back after the block, and FSDP2's root is resharded: a forward-only pass leaves
    it gathered, and a step taken then would leave the gathered copy stale."""
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()
        if isinstance(model, FSDPModule):
            model.reshard()


def predictions(rows: KLRows, head_trains: bool, temperature: float) -> KLReference:
    """The policy's predictions at the generated positions of `rows`, kept to be compared with the policy after an
    update (`moved`); run inside `policy_forward`. The final hidden states are kept and the head applied when they
    are compared, one chunk of positions at a time: a copy of the head as it is now where the update moves it."""
    head = rows.head
    if head_trains:
        if not isinstance(head, LMHead):
            raise TypeError("an update that moves the LM head needs KLRows.head to be an LMHead, to keep a copy of it")
        head = head.frozen()
    return KLReference(features(rows) if rows.features is None else rows.features, rows.loss_mask, head, temperature)


def measured_rows(config: RunConfig, responses: int) -> int:
    """Rows per train rank a measurement of `responses` per rank takes (0: every response of the rank's batch)."""
    per_rank = math.ceil(config.trainer.prompts_per_step * config.rollout.n / config.cluster.train_workers)
    return min(responses or per_rank, per_rank)


def forward_memory(model: ModelFootprint, rows: int, length: int, forward_tokens: int = 0) -> float:
    """No-grad forwards over rows × length tokens in chunks of `forward_tokens` (`logra.kl.forward_tokens`): one layer's
    intermediates of one chunk at a time (fused attention: no tokens² scores), and the final hidden states."""
    tokens = rows * length
    chunk = min(tokens, max(length, forward_tokens // length * length)) if forward_tokens else tokens
    return chunk * model.saved_frozen + tokens * model.hidden * model.compute_bytes


def kl_chunk_memory(model: ModelFootprint) -> float:
    """The float64 temporaries of one chunk of `exact_kl`: the logits, two log-softmaxes, p, their difference."""
    return 5 * 8 * POSITION_CHUNK * model.vocab


def kept_predictions(model: ModelFootprint, rows: int, length: int, head_trains: bool) -> float:
    """`predictions` kept for `rows` rows: their final hidden states, and a copy of the head where it trains (of its
    fp32 master weight, gathered whole: `LMHead.frozen`)."""
    head = model.vocab * model.hidden * 4 if head_trains else 0
    return rows * length * model.hidden * model.compute_bytes + head


def moved(before: KLReference, rows: KLRows) -> float:
    """KL(π_before ‖ π_now) per generated token of `rows` over every rank: how far the updates since `before`
    (`predictions`) moved the policy there; run inside `policy_forward`."""
    after = masked_logits(features(rows), rows.loss_mask, rows.head)
    sums, counts = row_kl(before, after, len(rows), rows.input_ids.device)
    return kl_estimate(sums, counts, 0.5, rows.weights).mean


@dataclass(frozen=True)
class RuleMemory:
    """What an update rule holds on each train rank, and what its updates carry, for the memory plan."""

    state: tuple[Part, ...]  # its optimizer state and the transients of building an update
    saved_per_token: float  # bytes a decoder layer keeps for backward per token, as the rule trains it
    probe: tuple[Part, ...]  # what measuring an update's KL holds
    payload: float = 0.0  # bytes of one update's payload, which the engines merge in place (0: full resyncs)


MemoryCut = tuple[str, dict[str, dict[str, object]]]  # (an override, the config groups' values it changes)


class UpdateRule(Protocol):
    memory_lean: ClassVar[bool]  # the memory plan suggests this rule to a run that does not fit
    sends_payloads: ClassVar[bool]  # its updates reach the engines as payloads merged in place (else full resyncs)
    lr_schedule: ClassVar[bool]  # it follows optimizer.lr's warm-up + cosine schedule (cli warns when it is cut short)
    trains_head: ClassVar[bool]  # its updates move the LM head (a KL measurement then keeps a copy of the head)
    measures_kl: bool  # it measures each update's KL on the guard rows (LoGRA always; dense and LoRA with measure_kl)

    def __init__(self, model: nn.Module, config: RunConfig, world_size: int) -> None: ...

    @staticmethod
    def memory(config: RunConfig, model: ModelFootprint, sequence: int, cuda: bool) -> RuleMemory:
        """What the rule holds on a train rank for `model` (its sizes in the compute dtype), sequences of at most
        `sequence` tokens, on a GPU node when `cuda`."""

    @staticmethod
    def memory_cuts(config: RunConfig) -> tuple[MemoryCut, ...]:
        """Changes of the rule's own settings that make it hold less (the plan's suggestions)."""

    @staticmethod
    def prepare_model(model: nn.Module, config: RunConfig) -> nn.Module:
        """The model to shard and train: trainable parameters set, adapters added (before FSDP2)."""

    @property
    def version(self) -> int:
        """Updates committed so far: the policy version."""

    def update(self, inputs: UpdateInputs) -> tuple[dict[str, float], WeightUpdate[Payload]]: ...

    def drop_backward(self) -> None:
        """Drop what the backward accumulated (gradients or sketches) without an update."""

    def staleness_bound(self, staleness: int) -> float:
        """The largest behaviour KL per token a batch sampled `staleness` updates ago is trained on with
        (`algorithm.staleness_kl`, or the rule's default)."""

    def refuse(self, step: int, staleness: int, behaviour_kl: float) -> None:
        """A batch `staleness` updates old was refused at `step` for its behaviour KL (nothing trained on it)."""

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...


def update_rule_class(config: RunConfig) -> type[UpdateRule]:
    return UPDATE_RULES[config.optimizer.name]


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def dense_lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio` at `schedule_steps` (held after)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.schedule_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps + 1) / span, 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DenseUpdate:
    """AdamW over the trainable parameters (all of them, or LoRA adapters), on the gradient of the
    global token-mean loss.

    Each rank backpropagates its token-sum loss; FSDP2 averages gradients over the ranks, so the
    gradient is rescaled by world_size / global tokens (gloo has no pre-scaled sum to do it inside).
    """

    memory_lean = False
    sends_payloads = False
    lr_schedule = True
    trains_head = True

    def __init__(self, model: nn.Module, config: RunConfig, world_size: int) -> None:
        self.config = config.optimizer
        self.world_size = world_size
        self.measures_kl = config.optimizer.measure_kl
        trainable = [p for p in model.parameters() if p.requires_grad]  # all weights, or the LoRA adapters
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.model = model
        self.policy_version = 0
        self.temperature = config.rollout.temperature
        self.staleness_kl = config.algorithm.staleness_kl

    @staticmethod
    def memory(config: RunConfig, model: ModelFootprint, sequence: int, cuda: bool) -> RuleMemory:
        ranks = config.cluster.train_workers
        state = (
            Part("Adam moments", 8 * model.params / ranks),
            Part("gradients", 4 * model.params / ranks + 2 * 4 * model.layer_params, TRAINING),
        )
        return RuleMemory(state, model.saved_trainable, DenseUpdate.probe_memory(config, model, sequence))

    @staticmethod
    def probe_memory(config: RunConfig, model: ModelFootprint, sequence: int) -> tuple[Part, ...]:
        """With `measure_kl`: no-grad forwards over the guard's rows, and the policy's predictions before the step
        (their final hidden states, and a copy of the head where the rule trains it)."""
        if not config.optimizer.measure_kl:
            return ()
        kl = config.logra.kl
        rows, length = measured_rows(config, kl.guard_responses), min(sequence, kl.probe_max_tokens)
        kept = kept_predictions(model, rows, length, update_rule_class(config).trains_head)
        forward = forward_memory(model, rows, length, kl.forward_tokens) + kl_chunk_memory(model)
        return (Part("KL measurement", forward + kept, TRAINING),)

    @staticmethod
    def memory_cuts(config: RunConfig) -> tuple[MemoryCut, ...]:
        return ()

    @staticmethod
    def prepare_model(model: nn.Module, config: RunConfig) -> nn.Module:
        return model.requires_grad_(True)

    @property
    def version(self) -> int:
        return self.policy_version

    def update(self, inputs: UpdateInputs) -> tuple[dict[str, float], WeightUpdate[Payload]]:
        lr = self.config.lr * dense_lr_factor(inputs.step, self.config)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for grad in grads:
            grad.mul_(self.world_size / inputs.num_tokens)
        grad_norm = float(full_tensor(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
        skipped = not math.isfinite(grad_norm)  # the same on every rank: the norm is global
        metrics = {"train/lr": lr, "train/grad_norm": grad_norm, "train/skipped": float(skipped)}
        if not skipped:
            rows = inputs.kl_rows() if self.measures_kl else None
            if rows is not None:
                start = time.perf_counter()
                with policy_forward(self.model):
                    before = predictions(rows, self.trains_head, self.temperature)
                seconds = time.perf_counter() - start
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.policy_version += 1
            if rows is not None:
                start = time.perf_counter()
                metrics |= self._realized_kl(before, rows)
                metrics["timing_s/probe"] = seconds + time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return metrics, NoChange(f"non-finite gradient norm {grad_norm}") if skipped else self._committed()

    def _committed(self) -> WeightUpdate[Payload]:
        """What the engines need after a committed update: every weight moved."""
        return FullResync()

    def drop_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def staleness_bound(self, staleness: int) -> float:
        """`algorithm.staleness_kl`; no bound unless set (no KL budget to derive one from)."""
        bound = self.staleness_kl
        return math.inf if bound is None else bound

    def refuse(self, step: int, staleness: int, behaviour_kl: float) -> None:
        """Nothing to record: no budget."""

    def _realized_kl(self, before: KLReference, rows: KLRows) -> dict[str, float]:
        """`train/kl_realized` of the step just taken, or nothing when it could not be measured (no generated
        token, a non-finite KL): the step stands either way, only its measurement is missing."""
        try:
            with policy_forward(self.model):
                return {"train/kl_realized": moved(before, rows)}  # all-reduced: every rank agrees
        except (ProbeError, FloatingPointError):
            return {}

    def save(self, directory: Path) -> None:
        """AdamW moments sharded with torch.distributed.checkpoint (a collective); the count on rank 0."""
        dcp.save(
            {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=directory / "optimizer"
        )
        if _is_rank0():
            torch.save({"policy_version": self.policy_version}, directory / UPDATE_STATE)

    def load(self, directory: Path) -> None:
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=directory / "optimizer")
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        state = torch.load(directory / UPDATE_STATE, weights_only=True)
        self.policy_version = state.get("policy_version", state.get("update_count"))  # older checkpoints: update_count


class LoRAUpdate(DenseUpdate):
    """The dense rule over peft LoRA adapters (seeded by `trainer.seed`); the base weights stay frozen. The
    engines get each update as the adapters (`AdapterPayload`) and set their targets from the bases they hold."""

    trains_head = False
    sends_payloads = True

    def __init__(self, model: nn.Module, config: RunConfig, world_size: int) -> None:
        super().__init__(model, config, world_size)
        self.adapters = lora_layers(model)
        self.scaling, self.rank = config.optimizer.lora_scaling, config.optimizer.lora_rank

    def _committed(self) -> WeightUpdate[Payload]:
        payload = adapter_payload(self.adapters, self.policy_version - 1, self.scaling, self.rank)
        return LowRankPayloads((payload,))

    @staticmethod
    def memory(config: RunConfig, model: ModelFootprint, sequence: int, cuda: bool) -> RuleMemory:
        """Adapters with AdamW's moments; backward keeps the adapters' inputs and the rank-wide middle; an update's
        payload is its adapters in fp32."""
        ranks, rank = config.cluster.train_workers, config.optimizer.lora_rank
        adapters = sum(rank * (d_out + k_in) for d_out, k_in in model.targets)
        state = (Part("LoRA adapters + Adam", 16 * adapters / ranks), Part("gradients", 4 * adapters, TRAINING))
        saved = model.saved_trainable + model.compute_bytes * (len(model.targets) / model.layers) * rank
        return RuleMemory(state, saved, DenseUpdate.probe_memory(config, model, sequence), payload=4 * adapters)

    @staticmethod
    def prepare_model(model: nn.Module, config: RunConfig) -> nn.Module:
        model.requires_grad_(False)
        torch.manual_seed(config.trainer.seed)
        return add_lora(model, config.optimizer, config.model.target_modules)


class LoGRAUpdate:
    """prepare → budget → proposed α → guard (the step's KL on the guard rows of this rank's batch, α shrunk while
    its upper bound overshoots) → commit.

    A non-finite sketch, a measurement that fails (no generated tokens, non-finite KL), a non-finite realised KL or
    a step the guard cannot bring within `logra.kl.max_overshoot` × its budget skips the update: the prepared
    update is discarded and nothing changes, on the trainer or the engines.
    """

    memory_lean = True  # sketches instead of gradients and moments
    sends_payloads = True
    lr_schedule = False  # its step size is the KL budget's
    trains_head = False

    def __init__(self, model: nn.Module, config: RunConfig, world_size: int) -> None:
        self.optimizer = LoGRAOptimizer(model, config.logra)
        self.model = model
        self.temperature = config.rollout.temperature
        self.measures_kl = True
        self.staleness_kl = config.algorithm.staleness_kl

    @staticmethod
    def memory(config: RunConfig, model: ModelFootprint, sequence: int, cuda: bool) -> RuleMemory:
        """Sketches (d_out × r) and projections (r × k_in) of every target on every rank, fp32, and row moments;
        the prepared direction (d_out × r) while an update is built. Backward keeps x·Aᵀ (tokens × r) per target.

        Measuring a step (`LoGRAOptimizer.guarded_step`), first the proposal, then the guard, each freed before the
        next: the JVP runs one probe row at a time with a tangent for every intermediate and attention in blocks of
        ATTENTION_BLOCK scores (fp32, with their tangents; keys and values in fp32 repeated to every query head); the
        guard keeps the unstepped and the stepped final hidden states of its rows, runs no-grad forwards over them
        (fused attention: one layer's intermediates at a time) and holds one unit's target rows twice (the trial; with
        `kl.trial_merge` per_try, every target's: the rank's share of them)."""
        rank, c, ranks = config.logra.rank, model.compute_bytes, config.cluster.train_workers
        state = 4 * rank * (model.target_rows + model.target_cols) + 4 * model.target_rows
        saved = model.saved_frozen + c * (len(model.targets) / model.layers) * rank
        kl = config.logra.kl
        length = min(sequence, kl.probe_max_tokens)
        rows = measured_rows(config, kl.guard_responses)
        copy = 4 * model.target_params / ranks
        trial = copy / (1 if kl.merges_per_try(cuda, copy) else model.layers)
        guard = forward_memory(model, rows, length, kl.forward_tokens) + rows * length * model.hidden * c
        guard += trial + kl_chunk_memory(model) + min(REFERENCE_BYTES, rows * length * model.vocab * 16)
        proposal = 0.0
        if kl.estimator == "jvp":
            attention = 6 * 4 * ATTENTION_BLOCK + 2 * 2 * 4 * length * model.heads * model.head_dim
            proposal = 2 * forward_memory(model, 1, length) + attention + 2 * kl_chunk_memory(model)
        elif kl.estimator == "finite_difference":
            probe_rows = min(kl.probe_responses, measured_rows(config, 0))
            proposal = 2 * forward_memory(model, probe_rows, length, kl.forward_tokens) + trial + kl_chunk_memory(model)
        return RuleMemory(
            state=(Part("LoGRA state", state), Part("LoGRA update", 4 * rank * model.target_rows, TRAINING)),
            saved_per_token=saved,
            probe=(Part("KL probe and guard", max(guard, proposal), TRAINING),),
            payload=rank * model.target_rows * getattr(torch, config.logra.wire_dtype).itemsize,
        )

    @staticmethod
    def memory_cuts(config: RunConfig) -> tuple[MemoryCut, ...]:
        """Half the rank; one unit merged at a time in the guard's tries where `kl.trial_merge=per_try` holds a copy
        of the rank's target rows for each try (`auto` holds one only while it is small)."""
        logra, cuts = config.logra, []
        if logra.rank >= 16:
            cuts.append((f"logra.rank={logra.rank // 2}", {"logra": {"rank": logra.rank // 2}}))
        if logra.kl.trial_merge == "per_try":
            per_unit = replace(logra.kl, trial_merge="per_unit")
            cuts.append(("logra.kl.trial_merge=per_unit", {"logra": {"kl": per_unit}}))
        return tuple(cuts)

    @staticmethod
    def prepare_model(model: nn.Module, config: RunConfig) -> nn.Module:
        return model.requires_grad_(False)  # LoGRA's targets get sketches, not gradients

    @property
    def version(self) -> int:
        return self.optimizer.policy_version

    def update(self, inputs: UpdateInputs) -> tuple[dict[str, float], WeightUpdate[Payload]]:
        opt = self.optimizer
        controller, version = opt.kl_controller, opt.policy_version
        metrics = {}
        if inputs.staleness:  # the budgets of the updates the batch's behaviour KL spans: the held-out referee's
            granted = controller.budget_since(version - inputs.staleness, version)
            metrics = {"async/behaviour_kl_budget": granted} if granted is not None else {}
        try:
            controller.carry_refused()
            if inputs.staleness:
                controller.owe(version, inputs.behaviour_kl, inputs.staleness)
            elif inputs.behaviour_kl is not None:
                controller.observe_numerics(inputs.behaviour_kl)
        except FloatingPointError as error:
            opt.zero_sketches()
            return {**metrics, "train/skipped": 1.0}, NoChange(str(error))
        try:
            sketch_norm = opt.prepare(num_tokens=inputs.num_tokens)
        except FloatingPointError as error:
            opt.zero_sketches()
            return {**metrics, "train/skipped": 1.0}, NoChange(str(error))
        start = time.perf_counter()
        try:
            if inputs.staleness:  # its mismatch holds its staleness too: not the engines' numerics
                budget = controller.step_budget(version)
            else:
                budget = controller.step_budget(version, inputs.mismatch_sum, inputs.mismatch_tokens)
            with policy_forward(self.model):
                step = opt.guarded_step(inputs.kl_rows(), self.temperature, budget)
        except (FloatingPointError, ProbeError) as error:
            opt.discard()
            return {**metrics, "train/skipped": 1.0}, NoChange(str(error))
        metrics |= {
            "logra/kl_budget": budget,
            **({"logra/kl_per_unit_step": step.q} if step.q is not None else {}),
            "logra/alpha_proposed": step.proposed_alpha,
            "logra/kl_proposed": step.tried[0][1].mean,  # measured, whether or not it was committed
            "logra/kl_upper": step.measured.upper,
            "logra/guard_rows": float(step.measured.rows),
            "logra/kl_row_cv": step.measured.row_cv,
            "logra/line_search_tries": float(step.tries),
            "logra/overshoot_refused": float(not step.accepted),
            "logra/sketch_norm": sketch_norm,
            "logra/mismatch_ema": controller.mismatch,
            "logra/kl_debt": controller.debt,
            "timing_s/probe": time.perf_counter() - start,
            "timing_s/line_search": step.seconds,
        }
        if math.isfinite(step.calibration):  # nan at q = 0: nothing was predicted
            metrics["logra/kl_realized_over_predicted"] = step.calibration
        if not step.accepted:
            opt.discard()
            if _is_rank0():
                print(f"[logra-train] {step.refusal()}", flush=True)
            return {**metrics, "train/skipped": 1.0}, NoChange(step.refusal())
        payload = opt.commit(step.alpha)
        controller.record(opt.policy_version, step)
        metrics |= {
            "logra/alpha": step.alpha,
            **({"logra/kl_predicted": step.predicted} if step.q is not None else {}),
            "train/kl_realized": step.kl,
            "logra/update_ratio": opt.config.update_ratio * step.alpha,
            "train/skipped": 0.0,
        }
        return metrics, LowRankPayloads((payload,))

    def drop_backward(self) -> None:
        self.optimizer.zero_sketches()

    def staleness_bound(self, staleness: int) -> float:
        """`algorithm.staleness_kl`, or by default `KLController.staleness_bound` for the batch's updates."""
        if self.staleness_kl is not None:
            return self.staleness_kl
        return self.optimizer.kl_controller.staleness_bound(self.version, staleness)

    def refuse(self, step: int, staleness: int, behaviour_kl: float) -> None:
        """The refused batch's excess over its updates' budgets is a debt too (`KLController.owe`)."""
        if math.isfinite(behaviour_kl):
            self.optimizer.kl_controller.owe(self.version, behaviour_kl, staleness, refused_at=step)

    def save(self, directory: Path) -> None:
        if _is_rank0():
            torch.save(self.optimizer.state_dict(), directory / UPDATE_STATE)

    def load(self, directory: Path) -> None:
        self.optimizer.load_state_dict(torch.load(directory / UPDATE_STATE, weights_only=True))


UPDATE_RULES: dict[str, type[UpdateRule]] = {"logra": LoGRAUpdate, "dense": DenseUpdate, "lora": LoRAUpdate}
