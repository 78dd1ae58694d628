"""Grade the engines' completions: decode each response and score it against its prompt's answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from logra_rl.rewards.pool import GradeRequest, RewardPool, grader_metrics

if TYPE_CHECKING:
    from logra_rl.data import Prompt
    from logra_rl.rollout import Completion


class CompletionGrader:
    def __init__(self, pool: RewardPool, tokenizer: Any) -> None:
        self.pool = pool
        self.tokenizer = tokenizer

    def response(self, completion: Completion) -> str:
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def grade(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> tuple[torch.Tensor, dict]:
        """Rewards (float64, one per completion; `len(completions) / len(prompts)` per prompt, consecutive)
        and the grader metrics (timeouts, errors)."""
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
        return rewards, grader_metrics(results)
