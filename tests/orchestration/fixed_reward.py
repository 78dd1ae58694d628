"""Rewards for tests that need to know the learning signal in advance, whatever the model samples."""


def always_zero(response, answer, metadata):
    """Never varies: every GRPO advantage is 0 (a step with no learning signal)."""
    return 0.0


def response_length(response, answer, metadata):
    """Longer is better, up to 100 characters: two samples of a prompt almost never tie, so every step of a
    real model's run has a gradient (a grader can score a small model's every sample 0)."""
    return min(len(response), 100) / 100
