"""The `logra-eval` driver: engines + rewards + the Evaluator, no train group.

It evaluates `model.path`, or a run's checkpoint (`eval.checkpoint=<run>/checkpoints/step_N`,
exported to an HF directory first) with the trainer's eval seed for that step, so the numbers
reproduce the trainer's own eval at that step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import ray

from logra_rl.config import RunConfig
from logra_rl.data import load_workload
from logra_rl.eval.evaluator import Evaluator
from logra_rl.eval.export import export_checkpoint
from logra_rl.models.loading import resolve_model_path
from logra_rl.orchestration.cluster import start_ray
from logra_rl.orchestration.rollout_group import EnginesRestarted, RolloutGroup
from logra_rl.rewards import RewardPool
from logra_rl.rewards.grading import CompletionGrader


def checkpoint_step(checkpoint: str | Path) -> int:
    """N of `.../step_N` (the trainer's eval seed at that step); 0 for another directory name."""
    name = Path(checkpoint).name
    return int(name.removeprefix("step_")) if name.startswith("step_") and name[5:].isdigit() else 0


def run_eval(config: RunConfig, run_dir: Path) -> dict[str, float]:
    """pass@k of the configured model or checkpoint on the data's eval split; graded samples under run_dir."""
    run_dir = Path(run_dir)
    step = 0
    if config.eval.checkpoint:
        step = checkpoint_step(config.eval.checkpoint)
        out = run_dir / f"export_{Path(config.eval.checkpoint).name}"
        model_path = str(export_checkpoint(config.eval.checkpoint, config.model.path, out))
    else:
        model_path = resolve_model_path(config, run_dir)
    workload = load_workload(config.data, model_path)
    with contextlib.ExitStack() as stack:
        if start_ray(config):
            stack.callback(ray.shutdown)
        rollout = RolloutGroup(config, model_path)
        stack.callback(rollout.shutdown)
        rewards = stack.enter_context(RewardPool(config.trainer.grader_workers, config.trainer.grader_timeout_s))
        evaluator = Evaluator(config, workload, rollout, CompletionGrader(rewards, workload.tokenizer), run_dir)
        while True:
            try:
                return evaluator.evaluate(step)
            except EnginesRestarted:  # a restarted engine reads the evaluated model again: nothing to resync
                continue
