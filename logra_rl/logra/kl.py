"""Predicted-KL step control: how far a proposed update moves the policy.

A low-rank step W ← W − s·U·A changes a targeted linear's output by −s·(x·Aᵀ)·Uᵀ. The probes
inject exactly that change into the layer outputs with forward hooks, so they never touch the
weights:

- `jvp_kl`: forward-mode AD gives the logit tangent ż along the step; the second-order KL
  per position is Var_{v∼p}(ż_v)/(2T²), so KL(s) ≈ q·s².
- `finite_difference_kl`: the true KL at s = ±h, q = (KL(h) + KL(−h)) / (2h²).
- `step_kl`: the true KL of one given step (the "realised" KL of a commit); `logits_kl` over two
  forwards' `masked_logits`: the same for update rules that step the weights themselves (dense, LoRA).

Under bf16 (or fp16) compute a LoGRA-sized change (~1e-4 of a layer's output) is below half an ulp
and rounds away or jumps a whole one, so the two measured KLs are biased. When the targeted layers'
outputs are low precision, both measure at a step large enough to be resolved (the largest relative
output change `LOW_PRECISION_RESOLUTION`) and scale back quadratically: KL(s·h)/s². That is exact
where it applies: a step too small for bf16 to resolve is deep in the quadratic regime, and a step large
enough to leave it is resolved and measured as it is. In fp32 nothing changes.

Every probe takes `forward(input_ids)` and an optional `head`: with a head, `forward` returns the
final hidden states and the probe applies `head` (the LM head) to POSITION_CHUNK positions at a time,
so no (tokens × vocab) logits (nor their tangent) exist beyond one chunk; without one, `forward`
returns the logits.

The controller turns q into a step scale α = min(α_max, √(δ_eff/q)) against a scheduled
budget δ, reduced by the measured rollout-vs-trainer mismatch, and then guards it (`KLController.guard`):
the quadratic model can be wrong by orders of magnitude (a confident softmax whose logits move by several
nats grows its KL exponentially, not quadratically, in α), so the true KL of the proposed α is measured and
α is shrunk from the measurement until the step lands within `max_overshoot`·δ, or the update is refused.

Every probe forward runs SDPA's math backend (the fused kernels have no forward-AD rule), so the JVP's
primal pass can serve as the unstepped forward of every later realised-KL measurement (`BaseForward`):
each line-search try costs one stepped forward on the probe rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from logra_rl.logra.config import KLConfig

# (linear module, projection A (rank × k_in), factor U (d_out × rank)): the step W ← W − U·A.
LowRankStep = Sequence[tuple[nn.Module, torch.Tensor, torch.Tensor]]
LogitsFn = Callable[[torch.Tensor], torch.Tensor]
HeadFn = Callable[[torch.Tensor], torch.Tensor]  # hidden states (..., H) -> logits (..., V)
POSITION_CHUNK = 64  # positions per float64 KL chunk: bounds the (chunk × vocab) temporaries
# Relative change of a layer's output that a bf16 forward resolves well (8 ulps of bf16's 2^-8).
LOW_PRECISION_RESOLUTION = 2**-5
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Each line-search try shrinks α by at least this factor, whatever the measured overshoot says.
MAX_SHRINK = 0.7
# A shrunk step whose realised KL is below this share of the budget is tried once more, closer to the budget.
UNDERSHOOT = 0.5


class ProbeError(RuntimeError):
    """The KL probe could not measure the proposal (no generated tokens, or the JVP was lost)."""


def predicted_kl(logits: torch.Tensor, tangent: torch.Tensor, temperature: float) -> torch.Tensor:
    """Second-order KL(π ‖ π + ε·dπ)/ε² per position (float64): ½·Var_{v∼p}(ż_v)/T²."""
    if logits.shape != tangent.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tangent {tuple(tangent.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    direction = tangent.double() / temperature
    centered = direction - (probs * direction).sum(dim=-1, keepdim=True)
    return 0.5 * (probs * centered.square()).sum(dim=-1)


def exact_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(p ‖ q) per position (float64) between the two tempered softmax distributions."""
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits {tuple(logits_p.shape)} and {tuple(logits_q.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p = torch.log_softmax(logits_p.double() / temperature, dim=-1)
    log_q = torch.log_softmax(logits_q.double() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _output_change(module: nn.Module, x: torch.Tensor, projection: torch.Tensor, factor: torch.Tensor):
    """−(x·Aᵀ)·Uᵀ in fp32 (autocast off), shaped like the layer output."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        flat = x.reshape(-1, projection.shape[1]).float()
        change = -(flat @ projection.t().float()) @ factor.t().float()
    return change.reshape(*x.shape[:-1], factor.shape[0])


@contextmanager
def _hooks(step: LowRankStep, make_hook: Callable[[torch.Tensor, torch.Tensor], Callable]) -> Iterator[None]:
    handles = [module.register_forward_hook(make_hook(a, u)) for module, a, u in step]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _shifted(step: LowRankStep, scale: float):
    """Hooks that turn each targeted linear into its stepped version W − scale·U·A."""

    def make_hook(projection: torch.Tensor, factor: torch.Tensor) -> Callable:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            change = _output_change(module, args[0], projection, factor)
            return output + (scale * change).to(output.dtype)

        return hook

    return _hooks(step, make_hook)


@dataclass(frozen=True)
class BaseForward:
    """The policy's forward on the probe rows without the step, kept for the realised-KL measurements.

    `change_ratio` is the largest ‖change‖/‖output‖ of the step at scale 1 over the targeted linears whose
    outputs are low precision (`low_precision`): how far a measurement must enlarge the step to resolve it.
    """

    features: torch.Tensor
    low_precision: bool = False
    change_ratio: float = 0.0

    def resolvable_scale(self, scale: float) -> float:
        """How much to enlarge a step of `scale` so a low-precision forward resolves it (1 in fp32)."""
        change = self.change_ratio * abs(scale)
        if not self.low_precision or change == 0 or change >= LOW_PRECISION_RESOLUTION:
            return 1.0
        return LOW_PRECISION_RESOLUTION / change

    def for_step(self, scale: float) -> BaseForward:
        """The same forward, seen from the step scaled by `scale` (a line-search try at α = scale)."""
        return replace(self, change_ratio=self.change_ratio * abs(scale))


class _ChangeRecord:
    """Collects, over the targeted linears, whether any output is low precision and the largest relative
    output change of the step there (fp32 outputs resolve any step, so they are not sized)."""

    def __init__(self) -> None:
        self.low_precision = False
        self.change_ratio = 0.0

    def add(self, output: torch.Tensor, change: torch.Tensor) -> None:
        if output.dtype not in LOW_PRECISION:
            return
        self.low_precision = True
        size = float(torch.linalg.vector_norm(output.float()))
        if size > 0:
            self.change_ratio = max(self.change_ratio, float(torch.linalg.vector_norm(change.float())) / size)

    def base(self, features: torch.Tensor) -> BaseForward:
        return BaseForward(features, self.low_precision, self.change_ratio)


def base_forward(forward: LogitsFn, input_ids: torch.Tensor, step: LowRankStep) -> BaseForward:
    """The unstepped forward, sized against `step` (for fp32 outputs the step is never computed)."""
    record = _ChangeRecord()

    def make_hook(projection: torch.Tensor, factor: torch.Tensor) -> Callable:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if output.dtype in LOW_PRECISION:
                record.add(output, _output_change(module, args[0], projection, factor))

        return hook

    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), _hooks(step, make_hook):
        features = forward(input_ids)
    return record.base(features)


def _tangent(step: LowRankStep, record: _ChangeRecord):
    """Hooks that add the step's output change to each targeted linear's forward-AD tangent (and size it)."""

    def make_hook(projection: torch.Tensor, factor: torch.Tensor) -> Callable:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            x = fwAD.unpack_dual(args[0]).primal
            primal, tangent = fwAD.unpack_dual(output)
            change = _output_change(module, x, projection, factor)
            record.add(primal, change)
            change = change.to(primal.dtype)
            return fwAD.make_dual(primal, change if tangent is None else tangent + change)

        return hook

    return _hooks(step, make_hook)


def _target_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Logits at position p predict token p+1: count p iff token p+1 is a generated (loss) token."""
    return loss_mask[:, 1:].bool()


def _chunk_logits(features: torch.Tensor, chunk: slice, head: HeadFn | None) -> torch.Tensor:
    """The logits predicting tokens of `chunk` (positions 0..T−2), from logits or through `head`."""
    part = features[:, :-1][:, chunk]
    return part if head is None else head(part)


@dataclass(frozen=True)
class ProbeSums:
    """A probe's Σ KL over the masked positions, their count, and the unstepped forward it ran."""

    total: torch.Tensor
    count: torch.Tensor
    base: BaseForward


def jvp_kl(
    forward: LogitsFn,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    step: LowRankStep,
    temperature: float,
    head: HeadFn | None = None,
) -> ProbeSums:
    """Σ predicted KL (per unit scale²) over generated-token predictions, via forward-mode AD.

    The JVP's primal pass is the unstepped forward: it comes back as `base` for realised-KL measurements.
    """
    record = _ChangeRecord()
    with torch.no_grad(), fwAD.dual_level(), sdpa_kernel([SDPBackend.MATH]), _tangent(step, record):
        features = forward(input_ids)
        if fwAD.unpack_dual(features).tangent is None:
            raise ProbeError(
                "the JVP was lost between the targeted layers and the logits; does `forward` detach "
                "activations or run the targets under a different module instance?"
            )

        total = torch.zeros((), dtype=torch.float64, device=features.device)
        count = 0
        for logits in masked_logits(features, loss_mask, head):  # dual tensors: logits and their tangent
            total += predicted_kl(*fwAD.unpack_dual(logits)[:2], temperature).sum()
            count += logits.shape[0]
        count = torch.tensor(float(count), dtype=torch.float64, device=features.device)
        primal = fwAD.unpack_dual(features).primal  # stays valid after the dual level: the unstepped forward
    return ProbeSums(total, count, record.base(primal))


def step_kl(
    forward: LogitsFn,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    step: LowRankStep,
    temperature: float,
    scale: float,
    base: BaseForward | None = None,
    head: HeadFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ KL(π ‖ π_stepped), number of positions) for the step scaled by `scale`, exact in the model.

    `base` (the unstepped forward, sized against `step`) saves a forward. Under low-precision compute the
    step is measured at scale·s with s = `base.resolvable_scale(scale)` and the KL divided by s² (see the
    module docstring).
    """
    base = base if base is not None else base_forward(forward, input_ids, step)
    enlarge = base.resolvable_scale(scale)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), _shifted(step, scale * enlarge):
        stepped = forward(input_ids)
    before, after = masked_logits(base.features, loss_mask, head), masked_logits(stepped, loss_mask, head)
    total, count = logits_kl(before, after, temperature, base.features.device)
    return total / enlarge**2, count


@torch.no_grad()
def masked_logits(
    features: torch.Tensor, loss_mask: torch.Tensor, head: HeadFn | None = None
) -> Iterator[torch.Tensor]:
    """The logits predicting generated tokens, POSITION_CHUNK positions at a time ((predictions × vocab) each):
    from logits, or from hidden states through `head`, so no (tokens × vocab) tensor exists beyond a chunk."""
    positions = _target_positions(loss_mask)
    for start in range(0, positions.shape[1], POSITION_CHUNK):
        chunk = slice(start, start + POSITION_CHUNK)
        mask = positions[:, chunk]
        if mask.any():
            yield _chunk_logits(features, chunk, head)[mask]


@torch.no_grad()
def logits_kl(
    before: Iterable[torch.Tensor], after: Iterable[torch.Tensor], temperature: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ KL(π_before ‖ π_after), number of predictions) on `device` over matching chunks of `masked_logits`: how
    far an update moved the policy on the probe rows, whatever moved it (a low-rank step, AdamW, LoRA adapters)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for logits_p, logits_q in zip(before, after, strict=True):
        total += exact_kl(logits_p.to(device), logits_q.to(device), temperature).sum()
        count += logits_p.shape[0]
    return total, torch.tensor(float(count), dtype=torch.float64, device=device)


def reduced_mean_kl(total: torch.Tensor, count: torch.Tensor) -> float:
    """Σ KL / positions summed over the ranks (when torch.distributed is initialised): every rank gets the
    same mean, so every rank takes the same decision on it."""
    if dist.is_available() and dist.is_initialized():
        packed = torch.stack([total, count])
        dist.all_reduce(packed)
        total, count = packed
    if count == 0:
        raise ProbeError("the KL probe saw no generated tokens; check loss_mask and kl.probe_max_tokens")
    kl = float(total / count)
    if not (math.isfinite(kl) and kl >= 0):
        raise FloatingPointError(f"a KL measurement returned {kl}")
    return kl


def finite_difference_kl(
    forward: LogitsFn,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    step: LowRankStep,
    temperature: float,
    fd_step: float,
    head: HeadFn | None = None,
) -> ProbeSums:
    """Σ q over the positions with q = (KL(+h) + KL(−h)) / (2h²): the symmetric difference cancels the cubic term.

    Under low-precision compute h is enlarged until the step is resolved (`BaseForward.resolvable_scale`).
    """
    base = base_forward(forward, input_ids, step)
    h = fd_step * base.resolvable_scale(fd_step)
    total = torch.zeros((), dtype=torch.float64, device=base.features.device)
    for scale in (h, -h):
        kl_sum, count = step_kl(forward, input_ids, loss_mask, step, temperature, scale, base, head)
        total += kl_sum
    return ProbeSums(total / (2 * h**2), count, base)


def scheduled_budget(config: KLConfig, update: int) -> float:
    """δ for the update after `update` completed ones: cosine from budget to final_budget, or constant."""
    if config.schedule == "constant":
        return config.budget
    progress = min(update / max(config.schedule_steps - 1, 1), 1.0)
    return config.final_budget + 0.5 * (config.budget - config.final_budget) * (1 + math.cos(math.pi * progress))


def step_scale(q: float, budget: float, alpha_max: float) -> float:
    """α = min(α_max, √(budget/q)); q = 0 gives 1 (a zero direction); a non-finite q refuses the step."""
    if not math.isfinite(q) or q < 0:
        raise FloatingPointError(f"predicted KL q={q} is not a finite non-negative number; the step is refused")
    if not (budget > 0 and alpha_max > 0 and math.isfinite(budget + alpha_max)):
        raise ValueError(f"need budget > 0 and alpha_max > 0, got budget={budget}, alpha_max={alpha_max}")
    if q == 0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / q))


@dataclass(frozen=True)
class GuardedStep:
    """The controller's decision for one update: what was predicted, measured and (if `accepted`) committed."""

    q: float  # predicted KL per unit α²
    budget: float  # δ_eff
    tried: tuple[tuple[float, float], ...]  # (α, realised KL) of every measurement, the proposed α first
    alpha: float  # the α to commit when accepted (the last one tried when refused)
    kl: float  # its realised KL
    accepted: bool
    seconds: float = 0.0  # spent measuring the realised KLs (the line search's share of the probe)

    @property
    def tries(self) -> int:
        return len(self.tried)

    @property
    def proposed_alpha(self) -> float:
        """min(α_max, √(budget/q)): what the quadratic model alone would have committed."""
        return self.tried[0][0]

    @property
    def predicted(self) -> float:
        """q·α² at the committed α."""
        return self.q * self.alpha**2

    @property
    def calibration(self) -> float:
        """Realised over predicted KL at the proposed α: how far the quadratic model was off (nan at q = 0)."""
        alpha, kl = self.tried[0]
        predicted = self.q * alpha**2
        return kl / predicted if predicted > 0 else math.nan

    def refusal(self) -> str:
        return (
            f"KL guard: after {self.tries} tries the realised KL was still {self.kl / self.budget:.3g}x the "
            f"budget {self.budget:.3g} (alpha {self.proposed_alpha:.3g} proposed, {self.alpha:.3g} last tried); "
            "the update is skipped"
        )


class KLController:
    """The KL budget for each update: schedule, minus the EMA of the rollout-vs-trainer mismatch (floored)."""

    def __init__(self, config: KLConfig) -> None:
        self.config = config
        self.mismatch = 0.0  # EMA of max(0, mean(log π_rollout − log π_trainer)) over finished responses

    def step_budget(self, update: int, mismatch_sum: float = 0.0, mismatch_tokens: int = 0) -> float:
        """δ_eff for the next update; folds this batch's mismatch into the EMA when it has any tokens.

        With no measured tokens this step the budget is not reduced (as in the reference port).
        """
        budget = scheduled_budget(self.config, update)
        if not self.config.mismatch_subtraction or mismatch_tokens <= 0:
            return budget
        observed = mismatch_sum / mismatch_tokens
        if not math.isfinite(observed):
            raise FloatingPointError(f"rollout-vs-trainer mismatch {observed} is not finite")
        weight = self.config.mismatch_ema_weight
        self.mismatch = (1 - weight) * self.mismatch + weight * max(0.0, observed)
        return max(budget - self.mismatch, self.config.mismatch_budget_floor * budget)

    def stale_budget(self, update: int, behaviour_kl: float, staleness: int) -> float:
        """δ_eff for an update from a batch sampled `staleness` updates ago (`algorithm.max_staleness`), whose
        KL(π_behaviour ‖ π_train) per token is `behaviour_kl`.

        The updates in between were each held to their own budget, so the batch is expected to be about the
        sum of those budgets away: that part the schedule already granted. What it is beyond them (the guard's
        overshoot within `max_overshoot`, the engines' numerics, what the probe rows did not see of the batch)
        is charged like the mismatch, which it contains. A stale batch cannot tell the engines' numerics from
        its staleness, so it does not update the mismatch EMA: one step off, that keeps what the on-policy first
        step (and any batch sampled again) measured. The floor holds.
        """
        budget = scheduled_budget(self.config, update)
        if not self.config.mismatch_subtraction:
            return budget
        if not math.isfinite(behaviour_kl):
            raise FloatingPointError(f"behaviour KL {behaviour_kl} is not finite")
        granted = sum(scheduled_budget(self.config, max(update - back, 0)) for back in range(1, staleness + 1))
        charge = max(self.mismatch, behaviour_kl - granted)
        return max(budget - charge, self.config.mismatch_budget_floor * budget)

    def alpha(self, q: float, budget: float) -> float:
        return step_scale(q, budget, self.config.alpha_max)

    def guard(self, q: float, budget: float, realized_kl: Callable[[float], float]) -> GuardedStep:
        """α from the prediction, then checked against the true KL before anything is committed.

        `realized_kl(α)` measures the exact KL of the step at α. While it exceeds `max_overshoot`·budget, α
        shrinks by √(budget/KL), and by at least MAX_SHRINK, and is measured again: when the KL grows faster
        than α² (the usual way the quadratic model fails) the shrunk step lands within the budget, often far
        below it. A step that landed below UNDERSHOOT·budget then gets one more try, at the α where the power
        law through its last two measurements meets the budget, kept only if it is within the bound too.
        After `max_tries` measurements without a step within the bound the update is refused.
        """
        limit = self.config.max_overshoot * budget
        tried: list[tuple[float, float]] = []
        start = time.perf_counter()

        def measure(alpha: float) -> float:
            kl = realized_kl(alpha)
            if not (math.isfinite(kl) and kl >= 0):
                raise FloatingPointError(
                    f"realised KL {kl} at alpha={alpha:.3g} is not a finite non-negative number; the step is refused"
                )
            tried.append((alpha, kl))
            return kl

        alpha = self.alpha(q, budget)
        kl = measure(alpha)
        while kl > limit and len(tried) < self.config.max_tries:
            alpha *= min(MAX_SHRINK, math.sqrt(budget / kl))
            kl = measure(alpha)
        accepted = kl <= limit
        if accepted and len(tried) >= 2 and kl < UNDERSHOOT * budget and len(tried) < self.config.max_tries:
            (above, kl_above), (below, kl_below) = tried[-2], tried[-1]
            exponent = math.log(kl_above / kl_below) / math.log(above / below) if kl_below > 0 else math.nan
            if math.isfinite(exponent) and exponent > 0:
                candidate = below * (budget / kl_below) ** (1 / exponent)  # < above: kl_below < budget < kl_above
                if (kl_candidate := measure(candidate)) <= limit:
                    alpha, kl = candidate, kl_candidate
        return GuardedStep(q, budget, tuple(tried), alpha, kl, accepted, time.perf_counter() - start)

    def state_dict(self) -> dict[str, float]:
        return {"mismatch": self.mismatch}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mismatch = float(state["mismatch"])
