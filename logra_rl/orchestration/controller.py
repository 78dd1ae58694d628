"""The Controller: the RL step loop (docs/training.md, "The step").

    1. sample prompts → rollout engines generate (token ids + sampling log-probs); one step off
       (`algorithm.max_staleness=1`) the step takes the batch launched a step ago and launches the next one,
       generated while this one trains (`RolloutSchedule`)
    2. grade → rewards → advantages
    3.–6. the train group: log-probs, policy-gradient loss, backward; all-reduce sketches → RowAdam →
          update ratio; KL probe → α; commit → a StepResult (policy version, metrics, weight update); a batch
          too stale (`StaleBatch`) is generated again by the current policy and trained on instead
    7. WeightSync, once the batch ahead is generated: every engine applies the payloads (version-gated), or a
       full resync when needed
    8. metrics; eval every E steps; checkpoint every C steps

The controller runs in the driver process; the workers are Ray actors behind typed clients (`TrainGroup`,
`RolloutGroup`); `started` builds it from its parts and stops them when its block ends. It holds the driver-side
state a checkpoint needs besides the train group's: the step, the prompt sampler, the running baseline and the
batch in flight.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import psutil
import torch
from rich.console import Console

from logra_rl.config import RunConfig
from logra_rl.data import PromptSampler, Workload, load_workload
from logra_rl.eval.evaluator import Evaluator
from logra_rl.models.loading import check_model_dir, converts_exactly, resolve_model_path, target_shapes
from logra_rl.orchestration.cluster import GroupLost, start_ray, stop_ray
from logra_rl.orchestration.memory_plan import check_memory, machine_of
from logra_rl.orchestration.preemption import Interrupted, Preemption
from logra_rl.orchestration.rollout_group import RolloutGroup
from logra_rl.orchestration.rollout_schedule import Rollout, RolloutSchedule, pack_rollouts, unpack_rollouts
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
from logra_rl.utils.timing import Timer


class TrainFailure(RuntimeError):
    """The train group was lost more often than `trainer.max_restarts` allows."""


def read_driver_state(path: Path) -> dict[str, Any]:
    """A checkpoint's driver state (`Controller.driver_state`), its batch in flight read back."""
    state = read_controller_state(path)
    count = state.get("rollouts", 0)  # absent before generation and training overlapped
    state["rollouts"] = unpack_rollouts(torch.load(Path(path) / ROLLOUTS, weights_only=True)) if count else []
    return state


@contextlib.contextmanager
def started(
    config: RunConfig,
    run_dir: Path,
    resolved_config: dict[str, Any],
    resume_command: str = "",
    preemption: Preemption | None = None,
) -> Iterator[Controller]:
    """The controller, built from its parts: the model checked, the data, Ray, the memory plan, the train group,
    the engines and the reward pool; resumed from the run's checkpoint (`trainer.resume`); the engines synced.
    Everything started is stopped, in reverse, when the block ends. A signal during the start-up (`preemption`,
    armed here) stops it."""
    preemption = preemption or Preemption()
    with preemption, contextlib.ExitStack() as resources:
        try:
            yield build(config, Path(run_dir), resolved_config, resume_command, preemption, resources)
        finally:
            preemption.shutting_down = True  # a second signal now waits for the shutdown below


def build(
    config: RunConfig,
    run_dir: Path,
    resolved_config: dict[str, Any],
    resume_command: str,
    preemption: Preemption,
    resources: contextlib.ExitStack,
) -> Controller:
    """`started`'s start-up: each part started is put on `resources` to be stopped."""
    timer = Timer()
    run_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_of(config)  # before Ray and the data take their share: the plan counts them
    with timer("startup_model"):
        model_path = resolve_model_path(config, run_dir)
        check_model_dir(model_path)  # a missing or cut-short model stops the run before anything reads it
        targets = target_shapes(model_path, config.logra)  # checks targets and rank before any actor starts
    with timer("startup_data"):  # before Ray: a bad data file stops the run in seconds
        workload = load_workload(config.data, model_path)
    with timer("startup_ray"):
        if start_ray(config):
            resources.callback(stop_ray)
        preemption.arm()  # Ray's own SIGTERM handler would end the driver at once
    with timer("startup_plan"):  # stops here, in seconds, when the run cannot fit
        plan = check_memory(config, model_path, Console(highlight=False), workload.longest_prompt, machine)
    with timer("startup_workers"):  # the engines load their weights while the train group loads its own
        train = TrainGroup(config, model_path)
        resources.callback(train.shutdown)
        rollout = RolloutGroup(config, model_path)
        resources.callback(rollout.shutdown)
        rewards = resources.enter_context(RewardPool(config.trainer.grader_workers, config.trainer.grader_timeout_s))
        grader = CompletionGrader(rewards, workload.tokenizer)
        policy_version = train.setup()
    with timer("startup_resync"):
        checkpoints = Checkpoints(run_dir, config.trainer.keep_checkpoints)
        resumed_from = resume_path(config.trainer.resume, checkpoints)
        state = None
        if resumed_from is not None:
            state = read_driver_state(resumed_from)
            policy_version = train.load(str(resumed_from))
            print(f"[logra-train] resumed from {resumed_from} at step {state['step']}")
        controller = Controller(
            config,
            run_dir,
            resolved_config,
            resume_command,
            preemption,
            resources,
            Parts(model_path, targets, workload, train, rollout, grader, checkpoints),
            policy_version,
            state,
            resumed_from,
        )
        engines_exact = resumed_from is None and converts_exactly(model_path, config.rollout.dtype)
        if not controller.weight_sync.first_sync(policy_version, engines_exact):
            print(
                "[logra-train] the engines read the trainer's checkpoint exactly: no resync at start",
                flush=True,
            )
    # from the process's start (imports included) to the first step: logged with that step
    controller.startup.update(
        {
            **timer.seconds,
            "timing_s/startup": time.time() - psutil.Process().create_time(),
            "memory/plan_train_peak_gib": plan.processes[0].peak / GIB,  # beside memory/train_peak_gib
        }
    )
    return controller


def resume_path(resume: str, checkpoints: Checkpoints) -> Path | None:
    """The checkpoint `trainer.resume` names: auto, the run's newest intact one (None: none); never, None; else
    the path given, which must hold an intact checkpoint."""
    if resume == "never":
        return None
    if resume == "auto":
        path, skipped = checkpoints.resumable()
        for line in skipped:
            print(f"[logra-train] {line}")
        return path
    path = Path(resume)
    if not (path / "controller.json").exists():
        raise FileNotFoundError(f"trainer.resume={resume}: no checkpoint there (expected controller.json)")
    problem = verify(path)
    if problem:
        raise ValueError(f"trainer.resume={resume}: the checkpoint is damaged ({problem})")
    return path


@dataclass(frozen=True)
class Parts:
    """What `started` starts for the controller."""

    model_path: str
    targets: dict[str, tuple[int, int]]  # HF name → (d_out, k_in) of every LoGRA target
    workload: Workload
    train: TrainGroup
    rollout: RolloutGroup
    grader: CompletionGrader
    checkpoints: Checkpoints


class Controller:
    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        resolved_config: dict[str, Any],
        resume_command: str,
        preemption: Preemption,
        resources: contextlib.ExitStack,
        parts: Parts,
        policy_version: int,
        state: dict[str, Any] | None,
        resumed_from: Path | None,
    ) -> None:
        """`state`: the driver state of the checkpoint `resumed_from` (None: a run from its start)."""
        algorithm, trainer = config.algorithm, config.trainer
        self.config = config
        self.run_dir = run_dir
        self.resume_command = resume_command  # printed when a signal stops the run
        self.preemption = preemption
        self.resources = resources  # what `started` started, stopped in reverse when its block ends
        self.model_path, self.targets, self.workload = parts.model_path, parts.targets, parts.workload
        self.train, self.rollout, self.grader = parts.train, parts.rollout, parts.grader
        self.checkpoints = parts.checkpoints
        self.evaluator = Evaluator(config, self.workload, self.rollout, self.grader, run_dir)
        self.weight_sync = WeightSync(config, self.train, self.rollout, self.targets)
        self.baseline = RunningBaseline(
            algorithm.baseline_weight,
            algorithm.failure_reward,
            success_threshold=1.0,
            per_prompt=algorithm.per_prompt_baseline,
        )
        self.sampler = PromptSampler(self.workload.train, config.data.seed)
        self.schedule = RolloutSchedule(
            algorithm.max_staleness,
            self.sampler,
            trainer.prompts_per_step,
            self.rollout,
            self.sampling(),
            trainer.seed,
            lambda version, engines: self.weight_sync.full_resync(version, engines),
        )
        self.policy_version = policy_version  # the train group's, as of its last answer
        self.resumed_from = resumed_from
        self.start_step = 0 if state is None else state["step"]
        if state is not None:
            self.restore(state)
        self.first_state = self.driver_state(self.start_step)  # where a lost group restarts without checkpoints
        self.train_restarts = 0  # train groups rebuilt after a lost worker (fault/train_restarts)
        self.committed: list[Path] = []  # checkpoints this run wrote, oldest first
        self.startup: dict[str, float] = {}  # start-up seconds, logged with the first step
        self.metrics = MetricsLogger(run_dir, config.logger, resolved_config, trainer.total_steps, self.start_step)

    # ---- the step loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Run the steps, evaluate, finish; a SIGTERM / SIGINT stops it at a safe point with a checkpoint (`stop`,
        which exits with the signal's status)."""
        trainer, step = self.config.trainer, self.start_step
        while step < trainer.total_steps:
            try:
                self.run_step(step)
                step += 1
            except GroupLost as lost:  # rebuild, replay from a checkpoint
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

    def recover(self, lost: GroupLost) -> int:
        """`rebuild_train_group`, again while the new group is lost too (within trainer.max_restarts)."""
        while True:
            try:
                return self.rebuild_train_group(lost)
            except GroupLost as again:
                lost = again

    def rebuild_train_group(self, lost: GroupLost) -> int:
        """A new train group at the newest checkpoint (or the run's start), in place of a lost one; the engines
        resynced to it and the records after it dropped; returns the step to run next. The replay is the run it
        replaces: seeds depend on the step, and the checkpoint holds the weights, the update rule, the sampler,
        the baseline and the batch in flight. Lost train groups count against trainer.max_restarts."""
        self.train_restarts += 1
        limit = self.config.trainer.max_restarts
        if self.train_restarts > limit:
            raise TrainFailure(f"{lost} (the train group was rebuilt {limit} times: trainer.max_restarts={limit})")
        # this run's own checkpoints, newest first, then the one it resumed from: never another run's
        line = [p for p in [*reversed(self.committed), self.resumed_from] if p is not None and p.exists()]
        path, skipped = first_verified(line)
        for note in skipped:
            print(f"[logra-train] {note}", flush=True)
        self.schedule.abandon()  # the engines end the generation running now before the resync below
        print(f"[logra-train] {lost}; rebuilding the train group from {path or 'the run start'}", flush=True)
        self.train = TrainGroup(self.config, self.model_path)
        self.resources.callback(self.train.shutdown)
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
        timer, algorithm, last = Timer(), self.config.algorithm, self.config.trainer.total_steps - 1
        self.schedule.busy()  # generation seconds from here on
        with timer("step"):
            with timer("rollout"), self.preemption.interruptible():  # nothing has trained: the step runs again
                rollout = self.schedule.take(step, self.policy_version)  # 1. launched a step ago, or generated now
                self.schedule.launch_next(step, self.policy_version, last)  # one step off: generated while we train
            baseline, baseline_value = self.baseline.state_dict(), self.baseline.value
            rewards, reward_metrics, result = self.train_on(rollout, step, timer)  # 2.–6.
            refused = {"async/refused": 0.0}
            if isinstance(result.update, StaleBatch):  # past the staleness bound: nothing trained
                refused = {"async/refused": 1.0, "async/refused_behaviour_kl": result.metrics["async/behaviour_kl"]}
                self.baseline.load_state_dict(baseline)
                print(f"[logra-train] step {step}: {result.update.reason}; generated again", flush=True)
                with timer("rollout"), self.preemption.interruptible():
                    rollout = self.schedule.regenerate(rollout, self.policy_version)  # by the current policy
                rewards, reward_metrics, result = self.train_on(rollout, step, timer)
            self.policy_version = result.policy_version
            with timer("rollout_wait"):  # the batch ahead, generated while this step trained
                self.schedule.settle(self.policy_version)
            with timer("sync"):  # 7.
                sync_metrics = self.weight_sync.sync(result.update, result.policy_version, step)
        seconds = timer.seconds["timing_s/step"]
        committed = algorithm.epochs - result.metrics.get("train/skipped", 0.0)
        return {
            **self.rollout_metrics(rewards, rollout.completions, baseline_value),
            **reward_metrics,
            **result.metrics,
            **sync_metrics,
            **timer.seconds,
            **refused,
            "async/attempt": float(rollout.attempt),
            "perf/updates_per_hour": 3600 * committed / seconds,
            "perf/train_busy": timer.seconds["timing_s/train"] / seconds,
            "perf/rollout_busy": min(1.0, self.schedule.busy() / seconds),
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

    def sampling(self) -> SamplingParams:
        rollout = self.config.rollout
        return SamplingParams(rollout.temperature, rollout.top_p, self.config.data.max_response_length, n=rollout.n)

    def advantages(self, rewards: torch.Tensor, completions: Sequence[Completion]) -> torch.Tensor:
        algorithm = self.config.algorithm
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        if algorithm.estimator == "grpo":
            advantages = group_advantages(rewards, self.config.rollout.n, algorithm.grpo_normalize_std)
        else:
            prompts = [c.prompt_ids for c in completions]
            advantages = self.baseline.advantages(rewards, valid=lengths > 0, prompts=prompts)
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
        """What a checkpoint holds of the driver before `step` runs: the step, the sampler (as the batch in flight
        found it), the baseline, and the batch in flight (one step off)."""
        sampler, rollouts = self.schedule.state()
        return {"step": step, "sampler": sampler, "baseline": self.baseline.state_dict(), "rollouts": rollouts}

    def restore(self, state: dict[str, Any]) -> None:
        """The driver as `driver_state` found it."""
        self.schedule.load(state["sampler"], state["rollouts"])
        self.baseline.load_state_dict(state["baseline"])

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        """The train group's state (weights, optimizer, policy version) and the driver's `state`, committed
        together (the batch in flight as tensors beside controller.json)."""
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
