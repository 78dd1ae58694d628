"""RolloutGroup: the driver's typed client of the rollout engines (one Ray actor each).

Engines hold nothing the trainer cannot recreate, so a lost one is replaced, not fatal: an engine whose process
dies, or that does not answer a call within `rollout.call_timeout_s`, is restarted by Ray in its own bundle
(the actor's `max_restarts`) and the call raises `EnginesRestarted`, naming the engines that now hold the
checkpoint they started from instead of the policy. The caller brings them to the policy
(`WeightSync.retried`: a full resync of those engines) and asks again: the same call with the same seeds, so
the samples are the ones it would have returned. After `rollout.max_restarts` restarts in a run the next loss
stops the run, naming the engine and the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from logra_rl.config import RunConfig
from logra_rl.orchestration.cluster import WorkerGroup, pinned_cores
from logra_rl.rollout import Completion, MergeMode, RolloutEngine, SamplingParams, SyncResult
from logra_rl.rollout.base import EngineSpec
from logra_rl.rollout.vllm_engine import ENGINE_INDEX
from logra_rl.train.api import PayloadRef
from logra_rl.utils.transfer import Layout, TransferAddress


def engine_class(backend: str) -> type[RolloutEngine]:
    if backend == "vllm":
        from logra_rl.rollout.vllm_engine import VLLMEngine  # imports vLLM only inside the actor

        return timed(VLLMEngine)
    from logra_rl.rollout.hf_engine import HFEngine

    return timed(HFEngine)


def timed(cls: type[RolloutEngine]) -> type[RolloutEngine]:
    """`cls` with `timed_generate`: `generate`'s completions and the seconds it took in the engine's process, so the
    driver knows how long a generation it did not wait for took."""

    def timed_generate(self: Any, *args: Any) -> tuple[list[Completion], float]:
        start = time.monotonic()
        completions = cls.generate(self, *args)
        return completions, time.monotonic() - start

    return type(cls.__name__, (cls,), {"timed_generate": timed_generate, "__doc__": cls.__doc__})


class EngineFailure(RuntimeError):
    """Engines were lost more often than `rollout.max_restarts` allows."""


class EnginesRestarted(Exception):
    """Engines were lost during a call and are up again in their bundles, holding the checkpoint they started
    from: they need the policy's weights before the call is made again."""

    def __init__(self, engines: list[int] | None, reasons: str) -> None:
        super().__init__(f"rollout engines {'(all)' if engines is None else engines} restarted: {reasons}")
        self.engines = engines  # None: which ones is not known (all are resynced)


@dataclass(frozen=True)
class Pending:
    """Calls started on engines and not waited for yet (`RolloutGroup.wait`, or `collect` for a generation)."""

    refs: dict[int, ray.ObjectRef]


@dataclass(frozen=True)
class Generation(Pending):
    """A generation launched on the engines and not yet collected: one object reference per engine used (its
    contiguous chunk of the prompts, in order)."""


@dataclass(frozen=True)
class Generated:
    completions: list[Completion]  # in prompt order, `n` per prompt
    seconds: float  # the longest engine's generation time


class RolloutGroup:
    def __init__(self, config: RunConfig, model_path: str) -> None:
        spec = EngineSpec.from_config(config, model_path)
        self.max_restarts = config.rollout.max_restarts
        self.timeout_s = config.rollout.call_timeout_s
        self.workers = WorkerGroup(
            engine_class(config.rollout.backend),
            config.rollout.num_engines,
            "rollout",
            cpus=config.cluster.cpus_per_worker,
            gpus=config.rollout.gpus_per_engine,
            arguments=lambda _: {"spec": spec},
            max_restarts=self.max_restarts,
            env=lambda e: {ENGINE_INDEX: str(e)},  # vLLM: a compile cache per engine (engine_cache_root)
            cores=pinned_cores(config)["rollout"] if config.cluster.pin_cores else None,
        )
        self.engines = self.workers.actors
        self.restarts = 0  # engines restarted in this run (fault/engine_restarts)
        self.gpus_per_engine = config.rollout.gpus_per_engine  # processes per engine (tensor-parallel workers)
        self.closing = False

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        """`launch` and `collect`: completions in prompt order."""
        return self.collect(self.launch(prompts, params, seed)).completions

    def launch(self, prompts: Sequence[list[int]], params: SamplingParams, seed: int) -> Generation:
        """Start generating: the prompts split over the engines (contiguous chunks, engine e seeded `seed + e`).
        Each engine runs its calls in order, so a payload sent after this reaches it after this generation."""
        chunks = np.array_split(np.arange(len(prompts)), len(self.engines))
        used = [e for e, chunk in enumerate(chunks) if len(chunk)]  # fewer prompts than engines: the rest sit out
        return Generation(
            {e: self.engines[e].timed_generate.remote([prompts[i] for i in chunks[e]], params, seed + e) for e in used}
        )

    def collect(self, generation: Generation) -> Generated:
        """A launched generation's completions, in prompt order; `EnginesRestarted` when engines were lost during
        it (none of its completions are kept: the caller brings the engines back and launches it again)."""
        results = self._gather(generation.refs)
        completions = [c for e in sorted(results) for c in results[e][0]]
        return Generated(completions, max(seconds for _, seconds in results.values()))

    def merge_modes(self) -> list[MergeMode]:
        results = self._each(lambda e, engine: engine.merge_mode.remote(), range(len(self)))
        return [results[e] for e in range(len(self))]

    def apply_payload(self, payload: PayloadRef) -> dict[int, SyncResult]:
        """Every engine reads the payload from the object store itself (Ray resolves the reference in its
        process); results by engine index."""
        return self._each(lambda e, engine: engine.apply_payload.remote(payload.ref), range(len(self)))

    def load_weights(
        self, state: ray.ObjectRef, version: int, bucket: int, buckets: int, engines: Sequence[int] | None = None
    ) -> dict[int, SyncResult]:
        """One bucket of a full resync, to every engine or to `engines`; results by engine index."""
        chosen = range(len(self)) if engines is None else engines
        return self._each(lambda e, engine: engine.load_weights.remote(state, version, bucket, buckets), chosen)

    def join_transfer(self, address: TransferAddress) -> Pending:
        """Every engine starts joining the full resyncs' process group (engine e's TP worker t as rank
        1 + e · TP + t; rank 0 is train rank 0): `wait` once the train group has joined too."""
        tp = self.gpus_per_engine
        return Pending({e: engine.join_transfer.remote(address, 1 + e * tp) for e, engine in enumerate(self.engines)})

    def receive_bucket(self, layout: Layout, version: int, bucket: int, buckets: int) -> Pending:
        """Every engine starts receiving a bucket that train rank 0 is to broadcast: `wait` once it has."""
        return Pending(
            {e: engine.receive_bucket.remote(layout, version, bucket, buckets) for e, engine in enumerate(self.engines)}
        )

    def wait(self, pending: Pending) -> dict[int, Any]:
        """The engines' answers to calls started by `join_transfer` or `receive_bucket` (`EnginesRestarted` as
        for any call)."""
        return self._gather(pending.refs)

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        results = self._each(lambda e, engine: engine.weights_at.remote(coordinates), range(len(self)))
        return [results[e] for e in range(len(self))]

    def shutdown(self) -> None:
        self.closing = True  # a call still waited for then fails quietly
        self.workers.kill()

    def _each(self, call: Callable[[int, ActorHandle], ray.ObjectRef], engines: Sequence[int]) -> dict[int, Any]:
        """`call(e, engine)` for each engine index, results by index (`_gather`)."""
        return self._gather({e: call(e, self.engines[e]) for e in engines})

    def _gather(self, refs: dict[int, ray.ObjectRef]) -> dict[int, Any]:
        """The engines' answers by index; lost engines are restarted and reported (`EnginesRestarted`, see the
        module docstring)."""
        results: dict[int, Any] = {}
        lost = self._wait(refs, results)
        if not lost:
            return results
        if self.closing:  # stopped by the run's teardown, not lost
            raise RuntimeError("the rollout engines were stopped")
        self.restarts += len(lost)
        reasons = "; ".join(f"engine {e}: {reason}" for e, reason in lost.items())
        if self.restarts > self.max_restarts:
            raise EngineFailure(
                f"rollout engine lost after {self.restarts - len(lost)} restarts (rollout.max_restarts="
                f"{self.max_restarts}): {reasons}"
            )
        print(f"[logra-train] {reasons}; restarted in its bundle, resyncing and asking again", flush=True)
        for e in lost:
            self._await_restart(e, reasons)
        raise EnginesRestarted(sorted(lost), reasons)

    def _await_restart(self, engine: int, reasons: str) -> None:
        """Until Ray has the engine's new process up (its constructor run); calls to it fail meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ray.get(self.engines[engine].__ray_ready__.remote(), timeout=self.timeout_s)
                return
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise EngineFailure(f"rollout engine {engine} did not come back: {reasons}") from None
                time.sleep(0.2)
            except GetTimeoutError:
                raise EngineFailure(
                    f"rollout engine {engine} was not up again within rollout.call_timeout_s={self.timeout_s:g}: "
                    f"{reasons}"
                ) from None
            except ActorDiedError as error:  # Ray gave up on it (its own max_restarts)
                raise EngineFailure(f"rollout engine {engine} could not be restarted: {reasons}") from error

    def _wait(self, refs: dict[int, ray.ObjectRef], results: dict[int, Any]) -> dict[int, str]:
        """Wait for `refs` (at most `call_timeout_s`), put the answers in `results`, and return the engines that
        died or did not answer, with why (a hung engine is killed: Ray restarts it)."""
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        lost = {}
        for e, ref in refs.items():
            if ref not in ready:
                ray.kill(self.engines[e], no_restart=False)
                lost[e] = f"no answer within rollout.call_timeout_s={self.timeout_s:g}"
                continue
            try:
                results[e] = ray.get(ref)
            except RayActorError as error:  # the process died (any other error is the engine's own: raised)
                lost[e] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return lost
