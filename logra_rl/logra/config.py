"""LoGRA configuration: the method's knobs, with the reference port's defaults.

Every field is validated on construction; a bad value raises ValueError naming the field as a
Hydra override names it (`logra.rank`, `logra.kl.budget`). `from_dict` rejects unknown keys so a
typo in an override cannot be silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from logra_rl.utils.structs import (
    check,
    check_bool,
    check_choice,
    check_fraction,
    check_module_names,
    check_non_negative_int,
    check_positive,
    check_positive_int,
    from_mapping,
)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DISTRIBUTIONS = ("rademacher", "gaussian")
WIRE_DTYPES = ("bfloat16", "float32")
KL_SCHEDULES = ("cosine", "constant")
KL_ESTIMATORS = ("previous", "jvp", "finite_difference")
TRIAL_MERGES = ("auto", "per_try", "per_unit")
# `trial_merge=auto` holds a copy of the rank's target rows per try up to this size: SmolLM2-135M's (0.4 GiB); not
# Qwen2.5-1.5B's (2.4 GiB a rank on two), which would no longer fit a 24 GiB machine beside its engine
TRIAL_COPY_BYTES = 2**30
# ... and only for a try with at least this much work (the rows' tokens × the rank's target parameters): below it a
# CPU forward costs its fixed overheads more than its tokens, so fewer forwards beat fewer tokens. The quickstart's
# guard rows are ~4e8 (per_try and prompts once made a try 40% slower there), SmolLM2's ~5e11 (23% faster).
TRIAL_MIN_WORK = 1e10


@dataclass(frozen=True)
class KLConfig:
    """KL step control: the reference port's budgets and α_max; ours: the guard and its rows, and the proposal from
    the guard's own measurements (`docs/logra.md`, "The trust region"). Budgets are nats per generated token."""

    budget: float = 2e-4
    final_budget: float = 2e-5
    schedule: str = "cosine"  # cosine: budget -> final_budget over schedule_steps; constant: budget
    schedule_steps: int = 300
    # the first warmup_steps updates get (update + 1) / warmup_steps of the scheduled budget, for a policy whose first
    # gradients are mostly noise (0: none; on the quickstart 20 changed which seeds collapse, not how many:
    # docs/benchmarks.md §16)
    warmup_steps: int = 0
    alpha_max: float = 3.0
    # The guard: a step whose measured KL's upper bound exceeds max_overshoot × budget is shrunk and measured again,
    # at most max_tries measurements in all, then refused (inf: commit the proposed α, measuring it once).
    max_overshoot: float = 1.5
    max_tries: int = 4
    # The proposal's q (KL per unit α²): previous (the guard's measurements of the committed steps, averaged; none
    # yet: α = 1) | jvp (the reference port's: forward-mode AD on probe_responses rows) | finite_difference (the
    # KL at ±fd_step on them)
    estimator: str = "previous"
    fd_step: float = 1.0  # finite-difference probe step, in units of the proposal (α)
    probe_responses: int = 2  # responses per data-parallel rank the proposal is estimated on
    # The guard measures each try on this many responses per rank, drawn at random from the step's batch every
    # step (0: all of them), and accepts on an upper confidence bound (at guard_confidence) of the KL over the
    # contexts the policy acts on (the batch is one draw of them).
    guard_responses: int = 16
    guard_confidence: float = 0.9
    probe_max_tokens: int = 4096  # every measured row is cut to this many tokens
    forward_tokens: int = 32768  # tokens per no-grad forward of the probe and guard: more rows run in chunks
    # How a try computes with the stepped weights: per_try merges the step into every target once and runs the rows
    # under it in forwards of similar length, each distinct prompt once where the caller can (holds a copy of the
    # rank's target rows); per_unit merges it into one FSDP2 unit at a time around each forward (one unit's rows held
    # twice; the whole rows in as few forwards as fit); auto: per_try on CPU, where a merge costs as much as a
    # forward of a few rows, while the copy is at most TRIAL_COPY_BYTES and the try's work at least TRIAL_MIN_WORK;
    # per_unit on GPUs and otherwise.
    trial_merge: str = "auto"
    mismatch_subtraction: bool = True
    mismatch_ema_weight: float = 0.3
    mismatch_budget_floor: float = 0.5

    def __post_init__(self) -> None:
        check_positive("logra.kl.budget", self.budget)
        check_positive("logra.kl.final_budget", self.final_budget)
        check_choice("logra.kl.schedule", self.schedule, KL_SCHEDULES)
        check_positive_int("logra.kl.schedule_steps", self.schedule_steps)
        check_non_negative_int("logra.kl.warmup_steps", self.warmup_steps, "0: no warm-up")
        check_positive("logra.kl.alpha_max", self.alpha_max)
        check(
            isinstance(self.max_overshoot, int | float) and self.max_overshoot >= 1,
            "logra.kl.max_overshoot",
            self.max_overshoot,
            "must be >= 1 (the KL bound allowed, in budgets; inf turns the guard off)",
        )
        check_positive_int("logra.kl.max_tries", self.max_tries)
        check_choice("logra.kl.estimator", self.estimator, KL_ESTIMATORS)
        check_positive("logra.kl.fd_step", self.fd_step)
        check_positive_int("logra.kl.probe_responses", self.probe_responses)
        check_non_negative_int("logra.kl.guard_responses", self.guard_responses, "0: every response of the batch")
        check(
            isinstance(self.guard_confidence, int | float) and 0.5 <= self.guard_confidence < 1,
            "logra.kl.guard_confidence",
            self.guard_confidence,
            "must be in [0.5, 1) (0.5: accept on the measured mean)",
        )
        check_positive_int("logra.kl.probe_max_tokens", self.probe_max_tokens)
        check_positive_int("logra.kl.forward_tokens", self.forward_tokens)
        check_choice("logra.kl.trial_merge", self.trial_merge, TRIAL_MERGES)
        check_bool("logra.kl.mismatch_subtraction", self.mismatch_subtraction)
        check_fraction("logra.kl.mismatch_ema_weight", self.mismatch_ema_weight)
        check_fraction("logra.kl.mismatch_budget_floor", self.mismatch_budget_floor)

    def merges_per_try(self, cuda: bool, copy_bytes: float, tokens: float = math.inf) -> bool:
        """`trial_merge` for targets on a GPU (`cuda`) or not, whose fp32 rows on this rank take `copy_bytes`, for a
        try on rows of `tokens` tokens (inf: the largest a run may have): auto is per_try off GPUs while that copy is
        at most TRIAL_COPY_BYTES and the try's work (tokens × parameters) at least TRIAL_MIN_WORK."""
        if self.trial_merge == "auto":
            return not cuda and copy_bytes <= TRIAL_COPY_BYTES and tokens * copy_bytes / 4 >= TRIAL_MIN_WORK
        return self.trial_merge == "per_try"


@dataclass(frozen=True)
class LoGRAConfig:
    """The method's configuration (the reference port's defaults; `seed` is the projections' base seed). In a
    run, `target_modules` and `merge_chunk_rows` come from `model.target_modules` and `sync.merge_chunk_rows`."""

    rank: int = 256
    seed: int = 1
    distribution: str = "rademacher"
    refresh: bool = True  # draw a new projection after every update
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    beta2: float = 0.95
    epsilon: float = 1e-8
    update_ratio: float = 6e-5  # ‖ΔW‖/‖W‖ over all targets at α = 1
    wire_dtype: str = "bfloat16"  # dtype of the factor U, in the payload and in the trainer's own merge
    merge_chunk_rows: int = 0  # rows per chunk when merging U·A into a weight; 0: about 2^24 elements a chunk
    kl: KLConfig = field(default_factory=KLConfig)

    def __post_init__(self) -> None:
        check_positive_int("logra.rank", self.rank)
        check(isinstance(self.seed, int) and self.seed >= 0, "logra.seed", self.seed, "give a non-negative integer")
        check_choice("logra.distribution", self.distribution, DISTRIBUTIONS)
        check_bool("logra.refresh", self.refresh)
        check_module_names("logra.target_modules", self.target_modules)
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        check(
            isinstance(self.beta2, int | float) and 0 <= self.beta2 < 1, "logra.beta2", self.beta2, "must be in [0, 1)"
        )
        check_positive("logra.epsilon", self.epsilon)
        check_positive("logra.update_ratio", self.update_ratio)
        check_choice("logra.wire_dtype", self.wire_dtype, WIRE_DTYPES)
        check_non_negative_int("logra.merge_chunk_rows", self.merge_chunk_rows, "0: chunks of about 2^24 elements")
        if isinstance(self.kl, dict):
            object.__setattr__(self, "kl", from_mapping(KLConfig, self.kl, "logra.kl."))
        check(isinstance(self.kl, KLConfig), "logra.kl", self.kl, "must be a KLConfig or a mapping")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoGRAConfig:
        """Build from a plain mapping (e.g. a Hydra node as a container); unknown keys are an error."""
        return from_mapping(cls, values, "logra.")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form (lists instead of tuples)."""
        values = dataclasses.asdict(self)
        values["target_modules"] = list(self.target_modules)
        return values
