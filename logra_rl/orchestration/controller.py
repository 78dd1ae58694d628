"""The Controller: the RL step loop (docs/training.md, "The step").

    1. sample prompts → rollout engines generate (token ids + sampling log-probs); with
       `algorithm.max_staleness` K ≥ 1 the batch K steps ahead is launched here and generated while this step
       trains on one generated before (`RolloutSchedule`)
    2. grade → rewards → advantages
    3.–6. the train group: log-probs, policy-gradient loss, backward; all-reduce sketches → RowAdam →
          update ratio; KL probe → α; commit → a StepResult (policy version, metrics, weight update)
    7. WeightSync: every engine applies the payloads (version-gated), or a full resync when needed
    8. metrics; eval every E steps; checkpoint every C steps

The controller runs in the driver process; the workers are Ray actors behind typed clients
(`TrainGroup`, `RolloutGroup`). It holds the driver-side state a checkpoint needs besides the
train group's: the step, the prompt sampler, the running baseline and the batches in flight.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import psutil
import torch
from rich.console import Console

from logra_rl.config import RunConfig
from logra_rl.data import Prompt, PromptSampler, load_workload
from logra_rl.eval.evaluator import Evaluator
from logra_rl.models.loading import check_model_dir, converts_exactly, resolve_model_path, target_shapes
from logra_rl.orchestration.cluster import GroupLost, start_ray, stop_ray
from logra_rl.orchestration.memory_plan import check_memory, machine_of
from logra_rl.orchestration.preemption import Interrupted, Preemption
from logra_rl.orchestration.rollout_group import EnginesRestarted, RolloutGroup
from logra_rl.orchestration.rollout_schedule import (
    GenerationAbandoned,
    Rollout,
    RolloutSchedule,
    pack_rollouts,
    unpack_rollouts,
)
from logra_rl.orchestration.train_group import TrainGroup
from logra_rl.orchestration.weight_sync import WeightSync
from logra_rl.rewards import RewardPool
from logra_rl.rewards.grading import CompletionGrader
from logra_rl.rl import RunningBaseline, group_advantages, length_weighted
from logra_rl.rollout import Completion, SamplingParams
from logra_rl.train.api import NoChange, StaleBatch, StepResult
from logra_rl.train.batch import pack_batch
from logra_rl.utils.checkpoint import ROLLOUTS, Checkpoints, first_verified, read_controller_state, verify
from logra_rl.utils.memory import GIB
from logra_rl.utils.metrics import MetricsLogger
from logra_rl.utils.plot import plot_run
from logra_rl.utils.run_dir import full_disk_error
from logra_rl.utils.seeding import ROLLOUT_STREAM, stream_seed
from logra_rl.utils.timing import Timer


class TrainFailure(RuntimeError):
    """The train group was lost more often than `trainer.max_restarts` allows."""


class RolloutLost(RuntimeError):
    """Engines were lost while generating a batch sampled by weights the trainer has moved past (a batch ahead,
    `algorithm.max_staleness`): no process holds those weights any more, so the run goes back to its last
    checkpoint, and the replay gives the same records."""


def read_driver_state(path: Path) -> dict[str, Any]:
    """A checkpoint's driver state (`Controller.driver_state`), its batches in flight read back."""
    state = read_controller_state(path)
    count = state.get("rollouts", 0)  # absent before generation and training overlapped
    state["rollouts"] = unpack_rollouts(torch.load(Path(path) / ROLLOUTS, weights_only=True)) if count else []
    return state


class Controller:
    def __init__(
        self, config: RunConfig, run_dir: Path, resolved_config: dict[str, Any], resume_command: str = ""
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resolved_config = resolved_config
        self.resume_command = resume_command  # printed when a signal stops the run
        self.preemption = Preemption()
        self.checkpoints = Checkpoints(self.run_dir, config.trainer.keep_checkpoints)
        self.baseline = RunningBaseline(
            config.algorithm.baseline_weight, config.algorithm.failure_reward, success_threshold=1.0
        )
        self.policy_version = 0  # the train group's, as of its last answer
        self.start_step = 0
        self.train_restarts = 0  # train groups rebuilt after a lost worker (fault/train_restarts)
        self.committed: list[Path] = []  # checkpoints this run wrote, oldest first
        self._resources = contextlib.ExitStack()  # what setup started, stopped in reverse by teardown

    # ---- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Data, Ray, the train group, the engines and the reward pool; resume; the first full resync."""
        config, stack, timer = self.config, self._resources, Timer()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        machine = machine_of(config)  # before Ray and the data take their share: the plan counts them
        with timer("startup_model"):
            self.model_path = model_path = resolve_model_path(config, self.run_dir)
            check_model_dir(model_path)  # a missing or cut-short model stops the run before anything reads it
            self.targets = target_shapes(model_path, config.logra)  # checks targets and rank before any actor starts
        with timer("startup_data"):  # before Ray: a bad data file stops the run in seconds
            self.workload = load_workload(config.data, model_path)
        with timer("startup_ray"):
            if start_ray(config):
                stack.callback(stop_ray)
            self.preemption.arm()  # Ray's own SIGTERM handler would end the driver at once
        self.sampler = PromptSampler(self.workload.train, config.data.seed)
        self.schedule = RolloutSchedule(
            config.algorithm.max_staleness, self.sampler, config.trainer.prompts_per_step, self.generate
        )
        with timer("startup_plan"):  # stops here, in seconds, when the run cannot fit
            plan = check_memory(config, model_path, Console(highlight=False), self.workload.longest_prompt, machine)
        with timer("startup_workers"):  # the engines load their weights while the train group loads its own
            self.train = TrainGroup(config, model_path)
            stack.callback(lambda: self.train.shutdown())  # whichever group is current then
            self.rollout = RolloutGroup(config, model_path)
            stack.callback(self.rollout.shutdown)
            rewards = stack.enter_context(RewardPool(config.trainer.grader_workers, config.trainer.grader_timeout_s))
            self.grader = CompletionGrader(rewards, self.workload.tokenizer)
            self.evaluator = Evaluator(config, self.workload, self.rollout, self.grader, self.run_dir)
            self.policy_version = self.train.setup()
        with timer("startup_resync"):
            self.weight_sync = WeightSync(config, self.train, self.rollout, self.targets)
            self.resumed_from = self._resume()
            self.first_state = self.driver_state(self.start_step)  # where a lost group restarts without checkpoints
            engines_exact = self.resumed_from is None and converts_exactly(model_path, config.rollout.dtype)
            if not self.weight_sync.first_sync(self.policy_version, engines_exact):
                print("[logra-train] the engines read the trainer's checkpoint exactly: no resync at start", flush=True)
        # from the process's start (imports included) to the first step: logged with that step
        self.startup = {
            **timer.seconds,
            "timing_s/startup": time.time() - psutil.Process().create_time(),
            "memory/plan_train_peak_gib": plan.processes[0].peak / GIB,  # beside the measured memory/train_peak_gib
        }
        self.metrics = MetricsLogger(
            self.run_dir, config.logger, self.resolved_config, config.trainer.total_steps, self.start_step
        )

    def _resume(self) -> Path | None:
        resume = self.config.trainer.resume
        path = None
        if resume == "auto":
            path, skipped = self.checkpoints.resumable()
            for line in skipped:
                print(f"[logra-train] {line}")
        elif resume != "never":
            path = Path(resume)
            if not (path / "controller.json").exists():
                raise FileNotFoundError(f"trainer.resume={resume}: no checkpoint there (expected controller.json)")
            problem = verify(path)
            if problem:
                raise ValueError(f"trainer.resume={resume}: the checkpoint is damaged ({problem})")
        if path is None:
            return None
        state = read_driver_state(path)
        self.policy_version = self.train.load(str(path))
        self.start_step = state["step"]
        self.restore(state)
        print(f"[logra-train] resumed from {path} at step {self.start_step}")
        return path

    # ---- the step loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Set up, run the steps, evaluate, finish; a SIGTERM / SIGINT stops it at a safe point with a
        checkpoint (`stop`, which exits with the signal's status)."""
        with self.preemption:
            try:
                self.setup()
                trainer, step = self.config.trainer, self.start_step
                while step < trainer.total_steps:
                    try:
                        self.run_step(step)
                        step += 1
                    except (GroupLost, RolloutLost) as lost:  # rebuild, replay from a checkpoint
                        step = self.recover(lost)
                if self.config.eval.every:  # also after a resume at the end: the record was dropped with the rest
                    try:
                        with self.preemption.interruptible():  # a signal to the job ends the grading processes
                            final = self.weight_sync.retried(lambda: self.evaluator.evaluate(trainer.total_steps))
                    except Interrupted:
                        self.stop(self.driver_state(trainer.total_steps))
                    self.metrics.log(trainer.total_steps, final)
                self.finish()
                return self.metrics.history
            finally:
                self.teardown()

    def run_step(self, step: int) -> None:
        """One step as the loop runs it: its eval (every E steps), the step, its record, its checkpoint (every
        C steps). A signal stops it at the step's start, or at once during its eval or its generation (neither
        changes what the checkpoint of the step's start holds), or after its generation."""
        trainer = self.config.trainer
        before = self.driver_state(step)
        metrics = dict(self.startup) if step == self.start_step else {}
        try:
            if self.config.eval.every and step % self.config.eval.every == 0:
                with self.preemption.interruptible():
                    metrics.update(self.weight_sync.retried(lambda: self.evaluator.evaluate(step)))
            metrics.update(self.step(step))
        except Interrupted:
            self.stop(before)
        self.metrics.log(step, metrics)
        if trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0:
            self.save_checkpoint(self.driver_state(step + 1))

    def recover(self, lost: GroupLost | RolloutLost) -> int:
        """`rebuild_train_group`, again while the new group is lost too (within trainer.max_restarts)."""
        while True:
            try:
                return self.rebuild_train_group(lost)
            except (GroupLost, RolloutLost) as again:
                lost = again

    def rebuild_train_group(self, lost: GroupLost | RolloutLost) -> int:
        """A new train group at the newest checkpoint (or the run's start), in place of a lost one or of one past
        the policy of a batch in flight lost with its engines; the engines resynced to it and the records after
        it dropped; returns the step to run next. The replay is the run it replaces: seeds depend on the step,
        and the checkpoint holds the weights, the update rule, the sampler, the baseline and the batches in
        flight. Lost engines count against rollout.max_restarts, lost train groups against trainer.max_restarts."""
        if isinstance(lost, GroupLost):
            self.train_restarts += 1
        limit = self.config.trainer.max_restarts
        if self.train_restarts > limit:
            raise TrainFailure(f"{lost} (the train group was rebuilt {limit} times: trainer.max_restarts={limit})")
        # this run's own checkpoints, newest first, then the one it resumed from: never another run's
        line = [p for p in [*reversed(self.committed), self.resumed_from] if p is not None and p.exists()]
        path, skipped = first_verified(line)
        for note in skipped:
            print(f"[logra-train] {note}", flush=True)
        self.schedule.abandon()  # the generation running now ends before the resync below reaches the engines
        print(f"[logra-train] {lost}; rebuilding the train group from {path or 'the run start'}", flush=True)
        if isinstance(lost, RolloutLost):
            self.train.shutdown()  # alive, but past every policy the engines can still sample: as after a loss
        self.train = TrainGroup(self.config, self.model_path)
        self.policy_version = self.train.setup()
        state = self.first_state
        if path is not None:
            state = read_driver_state(path)
            self.policy_version = self.train.load(str(path))
        self.restore(state)
        self.weight_sync = WeightSync(self.config, self.train, self.rollout, self.targets)
        self.weight_sync.full_resync(self.policy_version)
        self.metrics.drop_after(state["step"])
        return state["step"]

    def stop(self, state: dict[str, Any]) -> NoReturn:
        """Checkpoint the step reached (its state as it began: nothing of it has trained) and exit, saying how to
        resume: with `trainer.preempted_exit_code` on SIGTERM, 128 + the signal otherwise."""
        step = state["step"]
        latest = self.checkpoints.latest()
        path = latest if latest is not None and latest.name == f"step_{step}" else self.save_checkpoint(state)
        self.metrics.close()
        print(
            f"[logra-train] interrupted by {self.preemption.name} at step {step}: checkpoint {path}; "
            f"resume with: {self.resume_command or 'the same command'}",
            file=sys.stderr,
            flush=True,
        )
        # a preemption's SIGTERM is a clean stop; Ctrl-C's SIGINT keeps the shell's 130, so a loop of runs stops too
        sigterm = self.preemption.signal == signal.SIGTERM
        raise SystemExit(self.config.trainer.preempted_exit_code if sigterm else 128 + self.preemption.signal)

    def step(self, step: int) -> dict[str, float]:
        timer, started = Timer(), time.monotonic()
        with timer("step"):
            last = self.config.trainer.total_steps - 1
            with timer("rollout"), self.preemption.interruptible():  # nothing has trained: the step runs again
                self.schedule.launch(step, self.policy_version, last)  # 1. this step's batch, or the one K ahead
                rollout = self.collect(step)
            baseline, baseline_value = self.baseline.state_dict(), self.baseline.value
            rewards, reward_metrics, result = self.train_on(rollout, step, timer)  # 2.–6.
            refused = {}
            if isinstance(result.update, StaleBatch):  # past algorithm.staleness_kl: nothing trained
                refused = {"async/refused": 1.0, "async/refused_behaviour_kl": result.metrics["async/behaviour_kl"]}
                self.baseline.load_state_dict(baseline)
                with timer("rollout"), self.preemption.interruptible():  # sampled again by the current policy
                    for later in self.schedule.ahead(step):  # first what was launched before it
                        self.collect(later)
                    self.schedule.relaunch(step, self.policy_version)
                    rollout = self.collect(step)
                rewards, reward_metrics, result = self.train_on(rollout, step, timer)
            self.policy_version = result.policy_version
            with timer("rollout_wait"):  # the batches ahead, generated while this step trained
                ahead = [self.collect(later) for later in self.schedule.ahead(step)]
            with timer("sync"):  # 7. (the engines run it after the generations launched before it)
                sync_metrics = self.weight_sync.sync(result.update, result.policy_version, step)
        self.schedule.trained(step)
        seconds = timer.seconds["timing_s/step"]
        generated = sum(r.generation_s for r in [rollout, *ahead] if r.ended >= started)
        return {
            **self.rollout_metrics(rewards, rollout.completions, baseline_value),
            **reward_metrics,
            **result.metrics,
            **sync_metrics,
            **timer.seconds,
            "async/refused": 0.0,
            **refused,
            "perf/updates_per_hour": 3600 * self.config.algorithm.epochs / seconds,
            "perf/train_busy": timer.seconds["timing_s/train"] / seconds,
            "perf/rollout_busy": min(1.0, generated / seconds),
            "fault/engine_restarts": float(self.rollout.restarts),
            "fault/train_restarts": float(self.train_restarts),
        }

    def train_on(self, rollout: Rollout, step: int, timer: Timer) -> tuple[torch.Tensor, dict[str, float], StepResult]:
        """Steps 2–6 on a generated batch: rewards, advantages, and the train group's step."""
        prompts, completions = rollout.prompts, rollout.completions
        with timer("reward"), self.preemption.interruptible():  # a signal to the job ends the grading processes
            rewards, reward_metrics = self.grader.grade(prompts, completions)  # 2. rewards
        if self.preemption.requested:  # whatever they scored since is not a reward; nothing has trained
            raise Interrupted(self.preemption.name)
        advantages = self.advantages(rewards, completions)  # 2. advantages
        batch = pack_batch(completions, advantages, self.workload.pad_id)
        with timer("train"):
            if advantages.any():
                result = self.train.train_step(batch, step)  # 3.–6. backward, prepare, probe, commit
            else:  # no gradient anywhere: an optimizer step could only replay momentum, so none is taken
                skipped = {"train/skipped": float(self.config.algorithm.epochs)}
                result = StepResult(self.policy_version, skipped, NoChange("every advantage is 0"))
        return rewards, reward_metrics, result

    def collect(self, step: int) -> Rollout:
        """Batch `step`, generated by the policy it was launched with. Engines lost during its generation (or
        found holding other weights) are resynced and asked again, with every batch launched after it, when that
        policy is still the trainer's; when the trainer has moved past it, `RolloutLost`."""
        while True:
            engines = None  # all of them, unless the lost ones are known
            try:
                rollout = self.schedule.wait(step)
                found = {c.policy_version for c in rollout.completions} - {-1, rollout.policy_version}
                if not found:
                    return rollout
                problem = f"engines sampled batch {step} with policy versions {sorted(found)}"
            except EnginesRestarted as restarted:
                problem, engines = f"{restarted} while generating batch {step}", restarted.engines
            except GenerationAbandoned as abandoned:
                problem = str(abandoned)
            version = self.schedule.rollouts[step].policy_version
            if version != self.policy_version:
                raise RolloutLost(
                    f"{problem}; it was sampled by policy version {version}, which the trainer (at "
                    f"{self.policy_version}) has moved past"
                )
            self.weight_sync.full_resync(version, engines)
            for again in [step, *self.schedule.ahead(step)]:
                self.schedule.relaunch(again, version)

    def generate(self, prompts: list[Prompt], step: int) -> list[Completion]:
        """The engines' completions for batch `step` (`rollout.n` per prompt), seeded by the step."""
        seed = stream_seed(self.config.trainer.seed, step, ROLLOUT_STREAM)
        return self.rollout.generate([p.token_ids for p in prompts], self.sampling(), seed)

    def sampling(self) -> SamplingParams:
        rollout = self.config.rollout
        return SamplingParams(rollout.temperature, rollout.top_p, self.config.data.max_response_length, n=rollout.n)

    def advantages(self, rewards: torch.Tensor, completions: Sequence[Completion]) -> torch.Tensor:
        algorithm = self.config.algorithm
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        if algorithm.estimator == "grpo":
            advantages = group_advantages(rewards, self.config.rollout.n, algorithm.grpo_normalize_std)
        else:
            advantages = self.baseline.advantages(rewards, valid=lengths > 0)
        if algorithm.length_reference is not None:
            advantages = length_weighted(advantages, lengths, algorithm.length_reference)
        return advantages.float()

    def rollout_metrics(
        self, rewards: torch.Tensor, completions: Sequence[Completion], baseline: float
    ) -> dict[str, float]:
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
        metrics = {
            "reward/mean": float(rewards.mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_ratio": float(np.mean([not c.finished for c in completions])),
            "policy/version": float(self.policy_version),
        }
        if self.config.algorithm.estimator == "running_baseline":
            metrics["reward/baseline"] = baseline
        return metrics

    # ---- checkpoints, the end -------------------------------------------------------------------

    def driver_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds of the driver before `step` runs: the step, the sampler (as the first batch in
        flight found it), the baseline, and the batches in flight (generated; `max_staleness` of them)."""
        sampler, rollouts = self.schedule.state()
        return {"step": step, "sampler": sampler, "baseline": self.baseline.state_dict(), "rollouts": rollouts}

    def restore(self, state: dict[str, Any]) -> None:
        """The driver as `driver_state` found it."""
        self.schedule.load(state["sampler"], state["rollouts"])
        self.baseline.load_state_dict(state["baseline"])

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        """The train group's state (weights, optimizer, policy version) and the driver's `state`, committed
        together (the batches in flight as tensors beside controller.json)."""
        path = self.checkpoints.begin(state["step"])
        rollouts = state["rollouts"]
        try:
            self.train.save(str(path))
            if rollouts:
                torch.save(pack_rollouts(rollouts), path / ROLLOUTS)
        except Exception as error:
            # before the partial checkpoint gives its space back: the write's own error may not say it was the disk
            full = None if isinstance(error, GroupLost) else full_disk_error(error, path.with_suffix(""))
            shutil.rmtree(path, ignore_errors=True)
            if full is None:
                raise
            raise full from error
        saved = {key: value for key, value in state.items() if key != "rollouts"} | {"rollouts": len(rollouts)}
        path = self.checkpoints.commit(state["step"], saved)
        self.committed.append(path)
        return path

    def finish(self) -> None:
        self.metrics.close()
        console = self.metrics.console
        console.print(self.metrics.summary(self.workload.task_name))
        if self.config.logger.plot and self.metrics.history:
            png = plot_run(
                self.metrics.path, self.run_dir / "run.png", self.workload.task_name, self.config.eval.samples
            )
            console.print(f"[logra-train] metrics: {self.metrics.path}  plot: {png}")

    def teardown(self) -> None:
        self.preemption.shutting_down = True
        try:
            self._resources.close()
        finally:
            self.preemption.disarm()
