"""Evaluation: pass@1 and pass@k on the eval prompts, overall and per source, with graded samples on disk.

The trainer's evals and `logra-eval` both run this, so a checkpoint evaluated later reproduces the
trainer's numbers at that step (same prompts, seeds and sampling).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from logra_rl.config import RunConfig
from logra_rl.data import Workload
from logra_rl.eval.passk import eval_metrics
from logra_rl.rewards.grading import CompletionGrader
from logra_rl.rollout import Completion, SamplingParams
from logra_rl.utils.seeding import EVAL_STREAM, stream_seed


class Sampler(Protocol):
    """What the Evaluator samples from: the driver's `orchestration.RolloutGroup` (which sits above eval)."""

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        """Completions in prompt order, `params.n` per prompt, consecutive."""


def eval_sampling(config: RunConfig) -> SamplingParams:
    eval_ = config.eval
    return SamplingParams(eval_.temperature, eval_.top_p, config.data.max_response_length, n=eval_.samples)


class Evaluator:
    def __init__(
        self, config: RunConfig, workload: Workload, rollout: Sampler, grader: CompletionGrader, run_dir: Path
    ) -> None:
        self.config = config
        self.workload = workload
        self.rollout = rollout
        self.grader = grader
        self.run_dir = Path(run_dir)

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@1 and pass@k on the eval split, overall and per source; graded samples go to eval/step_N.jsonl."""
        prompts, task = self.workload.eval, self.workload.task_name
        if not prompts:
            return {}
        params = eval_sampling(self.config)
        seed = stream_seed(self.config.trainer.seed, step, EVAL_STREAM)
        completions = self.rollout.generate([p.token_ids for p in prompts], params, seed)
        rewards, _ = self.grader.grade(prompts, completions)
        per_prompt = rewards.view(len(prompts), params.n).tolist()
        sources = [
            str(p.example.metadata.get("source", task)).removeprefix(f"{task}/") for p in prompts
        ]  # e.g. reasoning_gym/maze → eval/reasoning_gym/maze/pass@1
        if self.config.eval.write_samples:
            self._write_samples(step, completions, rewards.tolist(), params.n)
        return eval_metrics(per_prompt, sources, params.n, prefix=f"eval/{task}")

    def _write_samples(self, step: int, completions: Sequence[Completion], rewards: list[float], n: int) -> None:
        path = self.run_dir / "eval" / f"step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        task = self.workload.task_name
        with path.open("w") as stream:
            for index, (completion, reward) in enumerate(zip(completions, rewards, strict=True)):
                example = self.workload.eval[index // n].example
                record = {
                    "prompt": example.messages[-1]["content"],
                    "response": self.grader.response(completion),
                    "answer": example.answer,
                    "reward": reward,
                    "sample": index % n,
                    "source": example.metadata.get("source", task),
                    "finished": completion.finished,
                }
                stream.write(json.dumps(record) + "\n")
