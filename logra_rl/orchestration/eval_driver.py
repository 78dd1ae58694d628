"""The `logra-eval` driver: engines + rewards + the Evaluator, no train group.

It evaluates `model.path`, or a run's checkpoint (`eval.checkpoint=<run>/checkpoints/step_N`,
or a run directory for its newest intact checkpoint; exported to an HF directory first) with the
trainer's eval seed for that step, so the numbers reproduce the trainer's own eval at that step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from logra_rl.config import RunConfig
from logra_rl.data import load_workload
from logra_rl.eval.evaluator import Evaluator
from logra_rl.eval.export import export_checkpoint, find_checkpoint
from logra_rl.models.loading import check_model_dir, resolve_model_path
from logra_rl.orchestration.cluster import start_ray, stop_ray
from logra_rl.orchestration.rollout_group import EnginesRestarted, RolloutGroup
from logra_rl.rewards import RewardPool
from logra_rl.rewards.grading import CompletionGrader
from logra_rl.utils.checkpoint import read_controller_state


def run_eval(config: RunConfig, run_dir: Path) -> dict[str, float]:
    """pass@k of the configured model or checkpoint on the data's eval split; graded samples under run_dir."""
    run_dir = Path(run_dir)
    step = 0
    if config.eval.checkpoint:
        checkpoint, skipped = find_checkpoint(config.eval.checkpoint)
        for line in skipped:
            print(f"[logra-eval] {line}")
        step = read_controller_state(checkpoint)["step"]  # the trainer's eval seed at that step
        # in the engines' dtype: they hold what they would round an fp32 export to, and the trainer's engines
        # hold the same rounding of its fp32 masters (sync/drift = 0)
        out = run_dir / f"export_{checkpoint.name}"
        model_path = str(export_checkpoint(checkpoint, out, config.rollout.dtype, config.model.path, force=True))
    else:
        model_path = resolve_model_path(config, run_dir)
        check_model_dir(model_path)
    workload = load_workload(config.data, model_path)
    with contextlib.ExitStack() as stack:
        if start_ray(config):
            stack.callback(stop_ray)
        rollout = RolloutGroup(config, model_path)
        stack.callback(rollout.shutdown)
        rewards = stack.enter_context(RewardPool(config.trainer.grader_workers, config.trainer.grader_timeout_s))
        evaluator = Evaluator(config, workload, rollout, CompletionGrader(rewards, workload.tokenizer), run_dir)
        while True:
            try:
                return evaluator.evaluate(step)
            except EnginesRestarted:  # a restarted engine reads the evaluated model again: nothing to resync
                continue
