"""LoGRAOptimizer: sketches in, one low-rank update out.

    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    loss.backward()                      # any number of microbatches; sketches accumulate
    opt.prepare(num_tokens=n)            # reduce over the process group, RowAdam, global update ratio
    payload = opt.commit(alpha=1.0)      # merge into the fp32 weights, redraw A, return the payload

Between prepare and commit the KL helpers measure the proposal: `probe_kl` (q, the KL per
unit α², by the JVP on a few probe rows: `kl.estimator=jvp`), `realized_kl` (the exact KL of a given α on
the guard's rows, with an upper confidence bound) and `guarded_step` (both, and the α within the KL budget that may be
committed, or a refusal). Every measurement of a step runs the model inside `trial(α)`, with the
weights the commit would leave, bit for bit. `discard()` drops a prepared update and restores the
RowAdam state, so a refused step changes nothing.

Data parallel: if torch.distributed is initialised, `prepare` sums the sketches over the
process group (so each rank's loss should be its share of the global loss) and `num_tokens`
is the global token count. Weights may be plain (replicated) or FSDP2 DTensors sharded on
dim 0; each rank then merges only its own rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from logra_rl.logra.config import LoGRAConfig
from logra_rl.logra.kl import (
    REFERENCE_BYTES,
    GuardedStep,
    KLController,
    KLEstimate,
    KLReference,
    KLRows,
    LowRankStep,
    features,
    jvp_kl,
    kl_estimate,
    masked_logits,
    reduced_mean_kl,
    row_kl,
    row_lengths,
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
        entries = []
        for target, factor in zip(self.targets, self._factors(alpha), strict=True):
            self._merge(target, factor)
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

    def _factors(self, alpha: float) -> list[torch.Tensor]:
        """U = round_wire(α·D) for every target: the factors of commit(α), in its payload and its merge."""
        wire_dtype = WIRE_TORCH_DTYPES[self.config.wire_dtype]
        return [(alpha * direction).to(wire_dtype) for direction in self._directions]

    def _merge(self, target: LinearSketch, factor: torch.Tensor) -> None:
        """W −= U·A on this rank's rows of the target's fp32 master weight."""
        weight, offset = local_rows(target.module.weight)
        merge_low_rank_(
            weight,
            factor[offset : offset + weight.shape[0]],
            target.projection,
            chunk_rows=self.config.merge_chunk_rows,
            row_offset=offset,
        )

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

    @contextmanager
    def trial(self, alpha: float, per_try: bool = False) -> Iterator[None]:
        """Inside, every forward of the model computes with the weights commit(α) would leave, bit for bit (the
        same factors and merge); outside and afterwards, the weights are exactly as before. α may be negative (the
        finite-difference probe).

        The step is merged into the fp32 masters of one unit at a time as that unit's forward starts, and the
        saved rows put back when it ends: an FSDP2 unit (a decoder layer), whose bf16 all-gather then carries the
        rounded merge the engines will hold, or the target itself for a model without FSDP2. Only one unit's
        rows are ever held twice. `per_try`: merged into every unit on entry and restored on exit instead, so the
        forwards inside pay for one merge in all (a copy of the rank's target rows is held meanwhile)."""
        if not self.prepared:
            raise RuntimeError("no update is prepared; call prepare() first")
        factors = dict(zip(map(id, self.targets), self._factors(alpha), strict=True))
        units = [
            _MergedUnit(unit, [(target, factors[id(target)]) for target in targets], self._merge)
            for unit, targets in _units(self.model, self.targets).items()
        ]
        handles = []
        try:
            for unit in units:
                if per_try:
                    unit.merge()  # a merge that fails part way is restored below, as far as it got
                else:  # the pre-hook goes before FSDP2's, which gathers the unit
                    handles.append(unit.unit.register_forward_pre_hook(unit.enter, prepend=True))
                    handles.append(unit.unit.register_forward_hook(unit.leave, always_call=True))
            with torch.no_grad():
                yield
        finally:
            for handle in handles:
                handle.remove()
            if per_try:
                for unit in units:
                    unit.restore()

    def probe_kl(self, rows: KLRows, temperature: float) -> float:
        """q: predicted KL per generated token of the prepared update at α = 1 (KL(α) ≈ q·α²).

        `rows.forward` must run the model as the policy (eval mode, no dropout). The first `kl.probe_responses`
        rows, cut to `kl.probe_max_tokens`, are probed (the same count on every rank), by the exact KL at
        ±`kl.fd_step` (`trial`) with `kl.estimator=finite_difference`, else by the JVP.
        """
        rows = self._probe_rows(rows)
        kl = self.config.kl
        if kl.estimator != "finite_difference":
            return reduced_mean_kl(*jvp_kl(rows, self.proposal(), temperature))
        rows, per_try = self._tried(rows)
        before = KLReference(features(rows), rows.loss_mask, rows.head, temperature, REFERENCE_BYTES)
        h = kl.fd_step
        return sum(self._measure(rows, before, scale, 0.5, per_try).mean for scale in (h, -h)) / (2 * h**2)

    def realized_kl(self, rows: KLRows, temperature: float, alpha: float, confidence: float = 0.5) -> KLEstimate:
        """The exact KL per generated token that commit(alpha) will cause, wire rounding and the compute dtype's
        rounding of the merged weights included, on `rows` (cut to `kl.probe_max_tokens`), with an upper bound on
        the KL over the contexts the rows sample, at `confidence`. The weights are not touched (`trial`)."""
        rows, per_try = self._tried(rows.first(len(rows), self.config.kl.probe_max_tokens))
        before = KLReference(features(rows), rows.loss_mask, rows.head, temperature)
        return self._measure(rows, before, alpha, confidence, per_try)

    def guarded_step(self, rows: KLRows, temperature: float, budget: float) -> GuardedStep:
        """q (`kl.estimator`: the controller's curvature from the committed steps, or the JVP / finite differences on
        the first `kl.probe_responses` of `rows`), the α it proposes for `budget`, and that α checked
        before anything is committed: its KL is measured on all of `rows` (the guard's, drawn at random from the
        step's batch) and α shrunk while the upper bound at `kl.guard_confidence` exceeds `kl.max_overshoot`·budget
        (`KLController.guard`).

        Commit `result.alpha` when `result.accepted`, else `discard()`. Each try costs one forward on the rows;
        every rank takes the same decisions (the measurements are all-reduced), so their collectives stay in step.
        """
        previous = self.config.kl.estimator == "previous"
        q = self.kl_controller.curvature if previous else self.probe_kl(rows, temperature)
        rows, per_try = self._tried(rows.first(len(rows), self.config.kl.probe_max_tokens))
        base = features(rows) if rows.features is None else rows.features
        before = KLReference(base, rows.loss_mask, rows.head, temperature, REFERENCE_BYTES)  # shared by the tries
        confidence = self.config.kl.guard_confidence

        def measure(alpha: float) -> KLEstimate:
            return self._measure(rows, before, alpha, confidence, per_try)

        return self.kl_controller.guard(q, budget, measure)

    def _tried(self, rows: KLRows) -> tuple[KLRows, bool]:
        """The rows as a try runs them, and whether it merges per try (`kl.trial_merge`): then in forwards of similar
        length, each prompt once where `rows.prefill` can (worth their fewer tokens where the rows have tokens to
        save), else whole rows in the fewest forwards. Every rank takes the same path: a prefill is a forward, so a
        collective, on each."""
        tokens = torch.tensor(float(sum(row_lengths(rows.loss_mask))), device=rows.input_ids.device)
        if _distributed():
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX)
        cuda = self.targets[0].module.weight.device.type == "cuda"
        copy = sum(local_rows(t.module.weight)[0].nbytes for t in self.targets)
        per_try = self.config.kl.merges_per_try(cuda, copy, float(tokens))
        return (rows if per_try else replace(rows, prefill=None)), per_try

    def _measure(self, rows: KLRows, before: KLReference, alpha: float, confidence: float, per_try: bool) -> KLEstimate:
        with self.trial(alpha, per_try):
            stepped = features(rows, overhead=rows.input_ids.shape[1] if per_try else None)
        after = masked_logits(stepped, rows.loss_mask, rows.head)
        sums, counts = row_kl(before, after, len(rows), stepped.device)
        return kl_estimate(sums, counts, confidence, rows.weights)

    def _probe_rows(self, rows: KLRows) -> KLRows:
        """The first `probe_responses` rows (the fewest any rank has), cut to `probe_max_tokens`."""
        count = torch.tensor(min(self.config.kl.probe_responses, len(rows)), device=rows.input_ids.device)
        if _distributed():
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return rows.first(int(count), self.config.kl.probe_max_tokens)

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


class _MergedUnit:
    """One unit's targets with a step merged into their fp32 rows: for the length of the unit's forward (`enter`,
    `leave`: its hooks), or from `merge` to `restore`."""

    def __init__(
        self,
        unit: nn.Module,
        steps: list[tuple[LinearSketch, torch.Tensor]],
        merge: Callable[[LinearSketch, torch.Tensor], None],
    ) -> None:
        self.unit, self.steps, self._merge = unit, steps, merge
        self.saved: list[torch.Tensor] = []

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.merge()

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.restore()

    def merge(self) -> None:
        self._reshard()  # a unit left gathered (FSDP2's root) would not gather the merged rows
        for target, factor in self.steps:
            self.saved.append(local_rows(target.module.weight)[0].clone())
            self._merge(target, factor)

    def restore(self) -> None:
        for (target, _), rows in zip(self.steps, self.saved, strict=False):
            local_rows(target.module.weight)[0].copy_(rows)
        self.saved.clear()
        self._reshard()  # nothing of the merged weights stays gathered

    def _reshard(self) -> None:
        if isinstance(self.unit, FSDPModule):
            self.unit.reshard()


def _units(model: nn.Module, targets: list[LinearSketch]) -> dict[nn.Module, list[LinearSketch]]:
    """The module whose forward gathers each target's weight: its innermost FSDP2 unit, or itself."""
    owner: dict[int, nn.Module] = {}
    for module in model.modules():  # parents before children: the innermost unit is written last
        if isinstance(module, FSDPModule):
            owner.update(dict.fromkeys(map(id, module.modules()), module))
    units: dict[nn.Module, list[LinearSketch]] = {}
    for target in targets:
        units.setdefault(owner.get(id(target.module), target.module), []).append(target)
    return units
