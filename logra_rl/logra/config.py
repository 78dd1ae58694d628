"""LoGRA configuration: the method's knobs, with the reference port's defaults.

Every field is validated on construction; a bad value raises ValueError naming the field.
`from_dict` rejects unknown keys so a typo in a Hydra override cannot be silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DISTRIBUTIONS = ("rademacher", "gaussian")
WIRE_DTYPES = ("bfloat16", "float32")
KL_SCHEDULES = ("cosine", "constant")
KL_ESTIMATORS = ("jvp", "finite_difference")


def _require(condition: bool, name: str, value: Any, rule: str) -> None:
    if not condition:
        raise ValueError(f"logra config: {name}={value!r} is invalid; {rule}")


def _positive(name: str, value: float) -> None:
    _require(isinstance(value, int | float) and math.isfinite(value) and value > 0, name, value, "must be > 0")


def _fraction(name: str, value: float) -> None:
    _require(isinstance(value, int | float) and 0 < value <= 1, name, value, "must be in (0, 1]")


@dataclass(frozen=True)
class KLConfig:
    """Predicted-KL step control (reference §5). Budgets are nats per generated token."""

    budget: float = 2e-4
    final_budget: float = 2e-5
    schedule: str = "cosine"  # cosine: budget -> final_budget over schedule_steps; constant: budget
    schedule_steps: int = 300
    alpha_max: float = 3.0
    estimator: str = "jvp"  # jvp (forward-mode AD) | finite_difference (true KL at ±fd_step)
    fd_step: float = 1.0  # finite-difference probe step, in units of the proposal (α)
    probe_responses: int = 2  # responses probed per data-parallel rank
    probe_max_tokens: int = 4096
    mismatch_subtraction: bool = True
    mismatch_ema_weight: float = 0.3
    mismatch_budget_floor: float = 0.5

    def __post_init__(self) -> None:
        _positive("kl.budget", self.budget)
        _positive("kl.final_budget", self.final_budget)
        _require(self.schedule in KL_SCHEDULES, "kl.schedule", self.schedule, f"choose one of {KL_SCHEDULES}")
        _require(
            isinstance(self.schedule_steps, int) and self.schedule_steps > 0,
            "kl.schedule_steps",
            self.schedule_steps,
            "must be a positive integer",
        )
        _positive("kl.alpha_max", self.alpha_max)
        _require(self.estimator in KL_ESTIMATORS, "kl.estimator", self.estimator, f"choose one of {KL_ESTIMATORS}")
        _positive("kl.fd_step", self.fd_step)
        for name in ("probe_responses", "probe_max_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"kl.{name}", value, "must be a positive integer")
        _require(
            isinstance(self.mismatch_subtraction, bool),
            "kl.mismatch_subtraction",
            self.mismatch_subtraction,
            "must be true or false",
        )
        _fraction("kl.mismatch_ema_weight", self.mismatch_ema_weight)
        _fraction("kl.mismatch_budget_floor", self.mismatch_budget_floor)


@dataclass(frozen=True)
class LoGRAConfig:
    """The method's configuration (reference §1.1 defaults; `seed` is the run's base seed)."""

    rank: int = 256
    seed: int = 42
    distribution: str = "rademacher"
    refresh: bool = True  # draw a new projection after every update
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    beta2: float = 0.95
    epsilon: float = 1e-8
    update_ratio: float = 6e-5  # ‖ΔW‖/‖W‖ over all targets at α = 1
    wire_dtype: str = "bfloat16"  # dtype of the factor U, in the payload and in the trainer's own merge
    merge_chunk_rows: int = 256  # rows per fp32 GEMM when merging U·A into a weight
    kl: KLConfig = field(default_factory=KLConfig)

    def __post_init__(self) -> None:
        _require(isinstance(self.rank, int) and self.rank > 0, "rank", self.rank, "must be a positive integer")
        _require(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "must be a non-negative integer")
        _require(
            self.distribution in DISTRIBUTIONS,
            "distribution",
            self.distribution,
            f"choose one of {DISTRIBUTIONS}",
        )
        _require(isinstance(self.refresh, bool), "refresh", self.refresh, "must be true or false")
        targets = self.target_modules
        if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets) or not targets:
            raise ValueError(
                f"logra config: target_modules={targets!r} is invalid; give a non-empty list of module "
                f"leaf names, e.g. {list(DEFAULT_TARGET_MODULES)}"
            )
        object.__setattr__(self, "target_modules", tuple(targets))
        _require(isinstance(self.beta2, int | float) and 0 <= self.beta2 < 1, "beta2", self.beta2, "must be in [0, 1)")
        _positive("epsilon", self.epsilon)
        _positive("update_ratio", self.update_ratio)
        _require(self.wire_dtype in WIRE_DTYPES, "wire_dtype", self.wire_dtype, f"choose one of {WIRE_DTYPES}")
        _require(
            isinstance(self.merge_chunk_rows, int) and self.merge_chunk_rows > 0,
            "merge_chunk_rows",
            self.merge_chunk_rows,
            "must be a positive integer",
        )
        if isinstance(self.kl, dict):
            object.__setattr__(self, "kl", _from_dict(KLConfig, self.kl, "kl."))
        _require(isinstance(self.kl, KLConfig), "kl", self.kl, "must be a KLConfig or a mapping")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoGRAConfig:
        """Build from a plain mapping (e.g. a Hydra node); unknown keys are an error."""
        return _from_dict(cls, values, "")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form (lists instead of tuples)."""
        values = dataclasses.asdict(self)
        values["target_modules"] = list(self.target_modules)
        return values


def _from_dict(cls: type, values: dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"logra config: unknown key(s) {[prefix + k for k in unknown]}; valid keys are "
            f"{sorted(prefix + k for k in known)}"
        )
    return cls(**values)
