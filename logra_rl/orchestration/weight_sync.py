"""WeightSync: every way the trainer's weights reach the rollout engines.

- a step's `LowRankPayloads` (LoGRA's updates, or a LoRA run's adapters) go to every engine, in order, as
  references: train rank 0 put each payload in Ray's object store and every engine reads it from there; the
  engine's merger gate (the payload's base version must be the engine's) is the one version check, and the
  versions engines report are recorded;
- a refused payload, a dense update (`FullResync`), engines restarted during a payload, a drift
  check that reads a difference where the merges are exact, or the optional periodic
  `sync.resync_every` → a full resync: train rank 0 streams the fp32 master in buckets through Ray's
  object store (or, with `sync.resync_route=process_group`, broadcasts each bucket device to device in a
  process group of its own with every engine process), and the engines load bf16(master) with exact residuals;
- `NoChange` (every update skipped) sends nothing;
- after every sync the drift check compares engine weights with bf16(master) at seeded coordinates;
- engines restarted during any call (`EnginesRestarted`) are resynced and the call made again (`retried`).

A LoGRA or LoRA run needs engines that merge payloads in place: one that cannot (an unknown or quantized layout)
stops the run at start-up with the engine's reason, unless `sync.allow_resync_fallback` accepts a full
resync per update.

It keeps each engine's last reported version; the train group owns the version itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from logra_rl.config import RunConfig
from logra_rl.logra import split_master
from logra_rl.orchestration.rollout_group import EnginesRestarted, RolloutGroup
from logra_rl.orchestration.train_group import TrainGroup
from logra_rl.rollout import MergeMode, SyncResult
from logra_rl.train.api import FullResync, LowRankPayloads, NoChange, PayloadRef, ResyncBucket, WeightUpdate
from logra_rl.train.optimizers import update_rule_class
from logra_rl.utils.seeding import DRIFT_STREAM, stream_seed
from logra_rl.utils.transfer import Layout

T = TypeVar("T")


class InPlaceMergeRefused(ValueError):
    """A LoGRA (or LoRA) run's engines cannot merge payloads in place and the run did not accept full resyncs."""


def check_in_place(modes: list[MergeMode], allow_resync_fallback: bool) -> None:
    """Stop a LoGRA or LoRA run whose engines would turn every update into a full resync, unless it is allowed."""
    reasons = sorted({mode.reason for mode in modes if mode.mode == "resync"})
    if not reasons:
        print(f"[logra-train] payloads merge into the engines: {', '.join(m.mode for m in modes)}", flush=True)
        return
    if allow_resync_fallback:
        print(f"[logra-train] every update is a full resync (sync.allow_resync_fallback): {reasons[0]}", flush=True)
        return
    raise InPlaceMergeRefused(
        f"the rollout engines cannot merge payloads in place: {'; '.join(reasons)}. Every update would be a "
        "full resync of the fp32 weights (at 7B about 30 GB a step); use a model whose layout the engines merge "
        "into (Qwen2/2.5/3, Llama, Gemma 3, SmolLM2, unquantized), or set sync.allow_resync_fallback=true to "
        "run with full resyncs"
    )


class WeightSync:
    def __init__(
        self,
        config: RunConfig,
        train: TrainGroup,
        rollout: RolloutGroup,
        targets: dict[str, tuple[int, int]],
    ) -> None:
        self.config = config
        self.train = train
        self.rollout = rollout
        self.targets = targets  # HF name → (d_out, k_in) of every LoGRA target: where the drift check looks
        self.buckets = train.resync_buckets(int(config.sync.bucket_mb * 2**20))
        self.route = config.sync.resync_route  # how full resyncs travel: object_store | process_group
        self.layouts: list[Layout] = []  # what each bucket sends, in order (the process group's route)
        self.transfer_generation, self.transfer_restarts = 0, None  # the group's, and the restarts it followed
        self.engine_versions = [-1] * len(rollout)  # as the engines report them; -1: not loaded yet
        self.version: int | None = None  # the policy version the engines were last brought to
        # the residual keeps every engine weight at bf16(master) exactly: a drift is a fault to repair
        self.exact = config.rollout.dtype == "float32" or config.sync.residual in ("tail", "float32")
        if update_rule_class(config).sends_payloads:
            check_in_place(self.retried(rollout.merge_modes), config.sync.allow_resync_fallback)

    def retried(self, call: Callable[[], T]) -> T:
        """`call()` on the engines, made again after engines lost during it were restarted (`EnginesRestarted`)
        and resynced to the policy; bounded by `rollout.max_restarts` (RolloutGroup counts the restarts). Before
        the first sync a restarted engine holds the checkpoint, as the others do: nothing to resync."""
        while True:
            try:
                return call()
            except EnginesRestarted as restarted:
                if self.version is not None:
                    self.full_resync(self.version, restarted.engines)

    def full_resync(self, version: int, engines: list[int] | None = None) -> float:
        """Load bf16(master) (with exact residuals) into every engine (or `engines`: restarted ones); returns
        the bytes moved per engine.

        The fp32 master streams in buckets (`sync.bucket_mb`): train rank 0 gathers one, and it reaches the engines
        through Ray's object store or, with `sync.resync_route=process_group`, a broadcast device to device; no
        process holds the whole fp32 model. An engine lost meanwhile starts again from the checkpoint: the resync
        starts again from its first bucket.
        """
        results = None
        while results is None:
            try:
                for index, bucket in enumerate(self.buckets):
                    results = self._resync_bucket(index, bucket, version, engines)
            except EnginesRestarted:
                results = None  # what the engines had loaded is no policy: every bucket again
        self._record(results)
        self.version = version
        return float(sum(bucket.nbytes for bucket in self.buckets))

    def _resync_bucket(
        self, index: int, bucket: ResyncBucket, version: int, engines: list[int] | None
    ) -> dict[int, SyncResult]:
        """Bucket `index` to the engines: broadcast in the process group (to every engine at once), or through
        the object store (also to restarted engines alone), where it is freed when this returns."""
        buckets = len(self.buckets)
        if self.route == "process_group" and engines is None:
            self._transfer_group()
            receiving = self.rollout.receive_bucket(self.layouts[index], version, index, buckets)
            self.train.send_bucket(bucket)
            return self.rollout.wait(receiving)
        return self.rollout.load_weights(self.train.resync_bucket(bucket), version, index, buckets, engines)

    def _transfer_group(self) -> None:
        """Form the full resyncs' process group (train rank 0 and every engine process), again after engines were
        restarted (a restarted process is not a member); every member joins at once (the rendezvous)."""
        if self.transfer_restarts == self.rollout.restarts:
            return
        self.layouts = self.layouts or [self.train.bucket_layout(bucket) for bucket in self.buckets]
        self.transfer_generation += 1
        world_size = 1 + len(self.rollout) * self.rollout.gpus_per_engine  # the ranks join_transfer gives
        address = self.train.open_transfer(world_size, self.transfer_generation)
        joining = self.rollout.join_transfer(address)
        self.train.join_transfer(address)
        self.rollout.wait(joining)
        self.transfer_restarts = self.rollout.restarts

    def first_sync(self, version: int, engines_exact: bool) -> float:
        """Bring the engines to the trainer at the run's start; returns the bytes moved per engine.

        Engines start at version 0 with the checkpoint as they read it. When that is already bf16(master)
        (`engines_exact`: the trainer read the same checkpoint, at version 0, and it converts exactly to the
        rollout dtype) and the drift check agrees, nothing is sent: a full resync would write the same bits
        (42 s at Qwen2.5-1.5B's shape on CPU). Otherwise (a resume, an fp32 checkpoint for bf16 engines)
        a full resync."""
        if engines_exact and version == 0 and self.drift(step=0) == 0.0:
            self.engine_versions = [0] * len(self.rollout)
            self.version = 0
            return 0.0
        return self.full_resync(version)

    def sync(self, update: WeightUpdate[PayloadRef], version: int, step: int) -> dict[str, float]:
        """Bring every engine to `version` after `update`; resync fully on refusal, for dense/LoRA updates,
        when the drift check finds a difference exact merges cannot leave, and every `sync.resync_every`
        steps if set. Returns the sync/* metrics, with the drift the drift check read before any repair."""
        resync_every = self.config.sync.resync_every
        needs_resync = isinstance(update, FullResync) or bool(resync_every and (step + 1) % resync_every == 0)
        refused, payload_bytes = 0, 0.0
        if isinstance(update, LowRankPayloads):
            refused, payload_bytes, restarted = self._apply_payloads(update.payloads)
            needs_resync = needs_resync or refused > 0 or restarted
        elif not isinstance(update, FullResync | NoChange):
            raise TypeError(f"unknown weight update {update!r}")
        resync_bytes = self.full_resync(version) if needs_resync else 0.0
        self.version = version
        drift = self.drift(step)
        if drift > 0 and self.exact:
            said = f"[logra-train] step {step}: the engines' weights differ from bf16(master) by up to {drift:.3g}"
            if needs_resync:  # a full resync cannot repair what it just wrote: say so instead of repeating it
                print(f"{said} right after a full resync: the engines do not load exactly; please report", flush=True)
            else:
                print(f"{said} where exact merges leave none: full resync", flush=True)
                resync_bytes += self.full_resync(version)
        return {
            "sync/payload_bytes": payload_bytes,
            "sync/refused": float(refused),
            "sync/full_resync_bytes": resync_bytes,
            "sync/drift": drift,
        }

    def _apply_payloads(self, payloads: tuple[PayloadRef, ...]) -> tuple[int, float, bool]:
        """Each payload to every engine, in order, until one is refused; returns the refusals, the bytes sent
        per engine and whether engines were restarted meanwhile (they need a full resync, as refusers do)."""
        refused, sent = 0, 0.0
        try:
            for payload in payloads:
                sent += payload.nbytes
                results = self.rollout.apply_payload(payload)
                self._record(results)
                refused += sum(not r.applied for r in results.values())
                if refused:
                    break
        except EnginesRestarted:
            return refused, sent, True
        return refused, sent, False

    def _record(self, results: dict[int, SyncResult]) -> None:
        for engine, result in results.items():
            self.engine_versions[engine] = result.version

    def _rounded(self, master: torch.Tensor) -> torch.Tensor:
        """The engine-dtype value an exact merge leaves for `master`, as float32."""
        dtype = getattr(torch, self.config.rollout.dtype)
        if self.config.sync.residual == "tail" and dtype == torch.bfloat16:
            return split_master(master)[0].float()
        return master.to(dtype).float()

    def drift(self, step: int) -> float:
        """max |W_rollout − bf16(master)| at seeded coordinates of every target (0 with an exact residual;
        with the tail, bf16(master) is `split_master`'s, the other nearest neighbour at exact ties)."""
        generator = torch.Generator().manual_seed(stream_seed(self.config.trainer.seed, step, DRIFT_STREAM) % 2**63)
        count = self.config.sync.drift_check_coordinates
        coordinates = {
            name: (
                torch.randint(rows, (count,), generator=generator),
                torch.randint(cols, (count,), generator=generator),
            )
            for name, (rows, cols) in self.targets.items()
        }
        masters = self.train.weights_at(coordinates)
        expected = {name: self._rounded(master) for name, master in masters.items()}
        worst = 0.0
        for engine in self.retried(lambda: self.rollout.weights_at(coordinates)):
            for name, values in engine.items():  # an engine in full-resync mode cannot read its weights
                difference = (values - expected[name]).abs()
                worst = max(worst, float("inf") if difference.isnan().any() else float(difference.max()))
        return worst
