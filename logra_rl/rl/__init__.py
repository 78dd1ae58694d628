"""RL math: advantages, token log-probs and policy-gradient losses."""

from logra_rl.rl.advantages import RunningBaseline, group_advantages, length_weighted, prompt_hash
from logra_rl.rl.logprobs import head_logprobs, token_logprobs
from logra_rl.rl.losses import policy_gradient_loss

__all__ = [
    "RunningBaseline",
    "group_advantages",
    "head_logprobs",
    "length_weighted",
    "policy_gradient_loss",
    "prompt_hash",
    "token_logprobs",
]
