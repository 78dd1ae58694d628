"""A reward that never varies: every GRPO advantage is 0 (a step with no learning signal)."""


def always_zero(response, answer, metadata):
    return 0.0
