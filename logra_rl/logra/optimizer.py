"""LoGRAOptimizer: sketches in, one low-rank update out.

    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    loss.backward()                      # any number of microbatches; sketches accumulate
    opt.prepare(num_tokens=n)            # reduce over the process group, RowAdam, global update ratio
    payload = opt.commit(alpha=1.0)      # merge into the fp32 weights, redraw A, return the payload

Between prepare and commit the KL helpers measure the proposal: `probe_kl` (q, the KL per
unit α²), `realized_kl` (the exact KL of a given α) and `guarded_step` (both, and the α within the
KL budget that may be committed, or a refusal). `discard()` drops a prepared update and restores the
RowAdam state, so a refused step changes nothing.

Data parallel: if torch.distributed is initialised, `prepare` sums the sketches over the
process group (so each rank's loss should be its share of the global loss) and `num_tokens`
is the global token count. Weights may be plain (replicated) or FSDP2 DTensors sharded on
dim 0; each rank then merges only its own rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from logra_rl.logra.config import LoGRAConfig
from logra_rl.logra.kl import (
    BaseForward,
    GuardedStep,
    HeadFn,
    KLController,
    LogitsFn,
    LowRankStep,
    ProbeSums,
    finite_difference_kl,
    jvp_kl,
    reduced_mean_kl,
    step_kl,
)
from logra_rl.logra.merge import merge_low_rank_
from logra_rl.logra.payload import WIRE_TORCH_DTYPES, PayloadEntry, UpdatePayload
from logra_rl.logra.projection import projection_fingerprint
from logra_rl.logra.rowadam import check_finite, row_adam_direction
from logra_rl.logra.sketch import LinearSketch
from logra_rl.logra.targets import check_rank, find_targets
from logra_rl.utils.shards import local_rows
from logra_rl.utils.structs import flatten


def _check_layout(name: str, weight: torch.Tensor) -> None:
    if isinstance(weight, DTensor) and tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"LoGRA target {name!r} is laid out as {weight.placements}; only replicated weights or a "
            "1-D FSDP2 mesh sharding rows (Shard(0)) are supported (no tensor parallelism, no HSDP)"
        )
    local, _ = local_rows(weight)
    if local.dtype != torch.float32:
        raise ValueError(
            f"LoGRA target {name!r} stores {local.dtype} weights; LoGRA needs fp32 master weights (updates "
            "of ~1e-4 relative vanish in bf16). Load the model in float32 and compute in bf16 with "
            "autocast or an FSDP2 MixedPrecisionPolicy"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class LoGRAOptimizer:
    def __init__(self, model: nn.Module, config: LoGRAConfig):
        self.model = model
        self.config = config
        modules = find_targets(model, config.target_modules)
        check_rank(modules, config.rank)
        for name, module in modules:
            _check_layout(name, module.weight)
        model.requires_grad_(False)
        self.targets = [
            LinearSketch(name, module, config.rank, config.seed, config.distribution) for name, module in modules
        ]
        self.second_moments = [
            torch.zeros(t.out_features, 1, dtype=torch.float32, device=t.sketch.device) for t in self.targets
        ]
        self.policy_version = 0
        self.kl_controller = KLController(config.kl)
        self._directions: list[torch.Tensor] | None = None
        self._moments_before: list[torch.Tensor] | None = None

    # ---- step -------------------------------------------------------------------------------

    @property
    def prepared(self) -> bool:
        return self._directions is not None

    def zero_sketches(self) -> None:
        if self.prepared:
            raise RuntimeError("cannot zero the sketches while an update is prepared; commit() or discard() it")
        for target in self.targets:
            target.zero_()

    def prepare(self, num_tokens: int | float | torch.Tensor) -> float:
        """Reduce the sketches, run RowAdam and scale to the update ratio; return the sketch norm.

        Raises FloatingPointError, with no state changed, if a reduced sketch is not finite.
        """
        if self.prepared:
            raise RuntimeError("an update is already prepared; commit() or discard() it first")
        num_tokens = float(num_tokens)
        if not (math.isfinite(num_tokens) and num_tokens >= 1):
            raise ValueError(f"num_tokens must be a finite count >= 1, got {num_tokens}")
        reached = torch.tensor(float(sum(t.contributions for t in self.targets)), device=self.targets[0].sketch.device)
        if _distributed():
            dist.all_reduce(reached)  # every rank raises together, none hangs
        if not reached:
            raise RuntimeError(
                "no gradient reached the LoGRA sketches: run loss.backward() (with grad enabled) on a loss "
                "that depends on the targeted layers before prepare()"
            )
        if _distributed():
            for target in self.targets:
                dist.all_reduce(target.sketch)
        for target in self.targets:
            check_finite(target.sketch, target.name)

        self._moments_before = [v.clone() for v in self.second_moments]
        step = self.policy_version + 1
        directions = [
            row_adam_direction(t.sketch / num_tokens, v, step, self.config.beta2, self.config.epsilon, t.name)
            for t, v in zip(self.targets, self.second_moments, strict=True)
        ]
        try:
            scale = self._update_ratio_scale(directions)
        except FloatingPointError:
            self._restore_moments()
            raise
        self._directions = [d.mul_(scale) for d in directions]
        for target in self.targets:
            target.locked = True
        sketch_sq = sum(torch.linalg.vector_norm(t.sketch, dtype=torch.float64) ** 2 for t in self.targets)
        return math.sqrt(float(sketch_sq)) / num_tokens

    def _update_ratio_scale(self, directions: list[torch.Tensor]) -> float:
        """c with ‖c·D·A‖/‖W‖ = update_ratio over all targets together (global, not per layer).

        ‖D·A‖² = Σ (D·G)⊙D with G = A·Aᵀ (rank × rank) over the local rows, summed in float64:
        about 2r/k of the cost of forming D·A. Sharded sums are reduced; replicated ones are not.
        """
        device = self.targets[0].sketch.device
        sharded = torch.zeros(2, dtype=torch.float64, device=device)  # [‖W‖², ‖DA‖²]
        replicated = torch.zeros(2, dtype=torch.float64, device=device)
        for target, direction in zip(self.targets, directions, strict=True):
            weight, offset = local_rows(target.module.weight)
            rows = direction[offset : offset + weight.shape[0]]
            gram = target.projection @ target.projection.t()  # exact in fp32 for Rademacher A
            sums = sharded if isinstance(target.module.weight, DTensor) else replicated
            sums[0] += torch.linalg.vector_norm(weight).double() ** 2
            sums[1] += ((rows @ gram) * rows).sum(dtype=torch.float64)
        if _distributed() and any(isinstance(t.module.weight, DTensor) for t in self.targets):
            dist.all_reduce(sharded)
        weight_sq, update_sq = (sharded + replicated).tolist()
        if not (math.isfinite(weight_sq) and math.isfinite(update_sq)):
            raise FloatingPointError(f"non-finite norms in the update ratio: ‖W‖²={weight_sq}, ‖DA‖²={update_sq}")
        if update_sq == 0:
            return 1.0
        return self.config.update_ratio * math.sqrt(weight_sq / update_sq)

    def proposal(self) -> LowRankStep:
        """The prepared update at α = 1, as (module, A, D) triples for the KL probes."""
        if not self.prepared:
            raise RuntimeError("no update is prepared; call prepare() first")
        return [(t.module, t.projection, d) for t, d in zip(self.targets, self._directions, strict=True)]

    def commit(self, alpha: float) -> UpdatePayload:
        """W −= round_wire(α·D)·A for every target; redraw A; return the payload of exactly this update."""
        if not self.prepared:
            raise RuntimeError("no update is prepared; call prepare() before commit()")
        alpha = float(alpha)
        if not math.isfinite(alpha):
            raise FloatingPointError(f"alpha={alpha} is not finite; the update is refused")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        wire_dtype = WIRE_TORCH_DTYPES[self.config.wire_dtype]
        entries = []
        for target, direction in zip(self.targets, self._directions, strict=True):
            factor = (alpha * direction).to(wire_dtype)
            weight, offset = local_rows(target.module.weight)
            merge_low_rank_(
                weight,
                factor[offset : offset + weight.shape[0]],
                target.projection,
                chunk_rows=self.config.merge_chunk_rows,
                row_offset=offset,
            )
            entries.append(PayloadEntry(target.name, target.out_features, target.in_features, factor))
        payload = UpdatePayload(
            base_version=self.policy_version,
            new_version=self.policy_version + 1,
            base_seed=self.config.seed,
            projection_update=self._projection_update(),
            rank=self.config.rank,
            distribution=self.config.distribution,
            wire_dtype=self.config.wire_dtype,
            fingerprint=projection_fingerprint(self.targets[0].projection),
            entries=tuple(entries),
        )
        self.policy_version += 1
        if self.config.refresh:
            self._draw_projections()
        self._finish()
        return payload

    def discard(self) -> None:
        """Drop the prepared update: weights untouched, RowAdam state restored, sketches zeroed."""
        if not self.prepared:
            raise RuntimeError("no update is prepared; nothing to discard")
        self._restore_moments()
        self._finish()

    def _restore_moments(self) -> None:
        for moment, before in zip(self.second_moments, self._moments_before, strict=True):
            moment.copy_(before)

    def _finish(self) -> None:
        self._directions = None
        self._moments_before = None
        for target in self.targets:
            target.locked = False
            target.zero_()

    def _projection_update(self) -> int:
        return self.policy_version if self.config.refresh else 0

    def _draw_projections(self) -> None:
        for target in self.targets:
            target.draw_projection(self._projection_update())

    # ---- KL ---------------------------------------------------------------------------------

    def probe_kl(
        self,
        forward: LogitsFn,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
        head: HeadFn | None = None,
    ) -> float:
        """q: predicted KL per generated token of the prepared update at α = 1 (KL(α) ≈ q·α²).

        `forward(input_ids) -> logits` must run the model as the policy (eval mode, no dropout); with
        `head`, `forward` returns the final hidden states and the LM head runs in chunks of positions.
        The first `kl.probe_responses` rows, truncated to `kl.probe_max_tokens`, are probed; the
        estimator is `kl.estimator`. Under data parallelism every rank probes the same row count.
        """
        input_ids, loss_mask = self._probe_rows(input_ids, loss_mask)
        sums = self._probe_sums(forward, input_ids, loss_mask, temperature, head)
        return reduced_mean_kl(sums.total, sums.count)

    def realized_kl(
        self,
        forward: LogitsFn,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
        alpha: float,
        head: HeadFn | None = None,
    ) -> float:
        """The exact KL per generated token that commit(alpha) will cause, wire rounding included, on the probe rows.

        Measured before the commit with the step injected by output hooks (the weights are not touched).
        """
        input_ids, loss_mask = self._probe_rows(input_ids, loss_mask)
        return self._realized(forward, input_ids, loss_mask, temperature, alpha, None, head)

    def guarded_step(
        self,
        forward: LogitsFn,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
        budget: float,
        head: HeadFn | None = None,
    ) -> GuardedStep:
        """q, the α it proposes for `budget`, and that α checked before anything is committed: its realised KL
        is measured and α shrunk while it exceeds `kl.max_overshoot`·budget (`KLController.guard`).

        Commit `result.alpha` when `result.accepted`, else `discard()`. The probe's unstepped forward is
        reused, so each try costs one forward on the probe rows; every rank takes the same decisions (the
        measurements are all-reduced), so their collectives stay in step.
        """
        input_ids, loss_mask = self._probe_rows(input_ids, loss_mask)
        sums = self._probe_sums(forward, input_ids, loss_mask, temperature, head)
        q = reduced_mean_kl(sums.total, sums.count)

        def realized(alpha: float) -> float:
            return self._realized(forward, input_ids, loss_mask, temperature, alpha, sums.base, head)

        return self.kl_controller.guard(q, budget, realized)

    def _probe_sums(
        self,
        forward: LogitsFn,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
        head: HeadFn | None,
    ) -> ProbeSums:
        kl = self.config.kl
        if kl.estimator == "jvp":
            return jvp_kl(forward, input_ids, loss_mask, self.proposal(), temperature, head)
        return finite_difference_kl(forward, input_ids, loss_mask, self.proposal(), temperature, kl.fd_step, head)

    def _realized(
        self,
        forward: LogitsFn,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
        alpha: float,
        base: BaseForward | None,
        head: HeadFn | None,
    ) -> float:
        """Mean exact KL of commit(alpha) on rows already cut by `_probe_rows`; `base` was sized at α = 1."""
        wire_dtype = WIRE_TORCH_DTYPES[self.config.wire_dtype]
        step = [(module, a, (alpha * d).to(wire_dtype)) for module, a, d in self.proposal()]
        base = base.for_step(alpha) if base is not None else None
        total, count = step_kl(forward, input_ids, loss_mask, step, temperature, 1.0, base, head)
        return reduced_mean_kl(total, count)

    def _probe_rows(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.shape != loss_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} "
                "must both be (batch, length)"
            )
        count = torch.tensor(min(self.config.kl.probe_responses, input_ids.shape[0]), device=input_ids.device)
        if _distributed():
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
        rows, length = int(count), self.config.kl.probe_max_tokens
        return input_ids[:rows, :length], loss_mask[:rows, :length]

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Row moments, policy version, KL controller state and config; projections are redrawn on load."""
        if self.prepared:
            raise RuntimeError(
                "cannot checkpoint while an update is prepared; checkpoint only after commit() or discard()"
            )
        return {
            "config": self.config.to_dict(),
            "policy_version": self.policy_version,
            "kl_controller": self.kl_controller.state_dict(),
            "second_moments": {t.name: v.clone() for t, v in zip(self.targets, self.second_moments, strict=True)},
        }

    def load_state_dict(self, state: dict) -> None:
        if self.prepared:
            raise RuntimeError("cannot load state while an update is prepared; commit() or discard() it first")
        # A setting the checkpoint predates (a later version's key) takes its default before comparing.
        saved, current = LoGRAConfig.from_dict(state["config"]).to_dict(), self.config.to_dict()
        if saved != current:
            differing = sorted(flatten(saved).items() ^ flatten(current).items())
            names = sorted({key for key, _ in differing})
            raise ValueError(
                f"checkpoint LoGRA configuration does not match the current one in {names}: "
                f"resume with the logra settings the run was started with"
            )
        moments = state["second_moments"]
        names = [t.name for t in self.targets]
        if sorted(moments) != sorted(names):
            raise ValueError(
                f"checkpoint holds RowAdam state for {len(moments)} modules, this model has {len(names)} "
                f"targets; first differences: {sorted(set(moments) ^ set(names))[:4]}"
            )
        for target, moment in zip(self.targets, self.second_moments, strict=True):
            moment.copy_(moments[target.name])
        self.policy_version = int(
            state.get("policy_version", state.get("update_count"))
        )  # older checkpoints: update_count
        self.kl_controller.load_state_dict(state["kl_controller"])
        self._draw_projections()
        self.zero_sketches()
