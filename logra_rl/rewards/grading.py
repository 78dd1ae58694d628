"""Grade the engines' completions: decode each response and score it against its prompt's answer."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from logra_rl.rewards.graders import usable_answer
from logra_rl.rewards.pool import GradeRequest, RewardPool, grader_metrics

logger = logging.getLogger(__name__)


# What grading reads of the prompts and completions, as protocols: `data` (whose tasks name their rewards) and
# `rollout` sit above the rewards (docs/architecture.md, "Floors").
class GradedExample(Protocol):
    """`data.Example`: the reference answer, the reward that grades it and what the grader needs."""

    @property
    def answer(self) -> str: ...

    @property
    def reward(self) -> str: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


class GradedPrompt(Protocol):
    """`data.Prompt`: the example it was made from."""

    @property
    def example(self) -> GradedExample: ...


class Response(Protocol):
    """`rollout.Completion`: the tokens an engine generated."""

    @property
    def token_ids(self) -> Sequence[int]: ...


class CompletionGrader:
    def __init__(self, pool: RewardPool, tokenizer: Any) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.checked: dict[tuple[str, str], bool] = {}  # (reward, ground truth) -> usable: parsed once per run
        self.warned = False

    def response(self, completion: Response) -> str:
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def grade(self, prompts: Sequence[GradedPrompt], completions: Sequence[Response]) -> tuple[torch.Tensor, dict]:
        """Rewards (float64, one per completion; `len(completions) / len(prompts)` per prompt, consecutive)
        and the grader metrics (timeouts, errors, responses to a ground truth their grader cannot use)."""
        n = len(completions) // len(prompts)
        requests = [
            GradeRequest(
                reward=p.example.reward,
                response=self.response(c),
                answer=p.example.answer,
                metadata=p.example.metadata,
            )
            for p, c in zip([p for p in prompts for _ in range(n)], completions, strict=True)
        ]
        results = self.pool.grade(requests)
        rewards = torch.tensor([r.reward for r in results], dtype=torch.float64)
        bad = [p.example for p in prompts if not self.usable(p.example)]
        if bad and not self.warned:
            self.warned = True
            self.warn(bad[0], len(bad), len(prompts))
        return rewards, {**grader_metrics(results), "reward/bad_ground_truths": float(n * len(bad))}

    def usable(self, example: GradedExample) -> bool:
        key = (example.reward, example.answer)
        if key not in self.checked:
            self.checked[key] = usable_answer(*key)
        return self.checked[key]

    @staticmethod
    def warn(example: GradedExample, bad: int, prompts: int) -> None:
        """One line, once per run: a data problem, not the policy's, that would otherwise train at reward 0."""
        metadata = example.metadata
        where = metadata.get("file") or metadata.get("data_source") or "the data"
        if "index" in metadata:
            where += f", record {metadata['index']}"
        logger.warning(
            "the %r reward cannot grade against the ground truth %.80r (%s): blank, or nothing it can parse, so its "
            "responses score 0 (unless identical to it); %d of this step's %d prompts have such a ground truth, "
            "their responses counted in reward/bad_ground_truths (warned once). Fix the data file",
            example.reward,
            example.answer,
            where,
            bad,
            prompts,
        )
