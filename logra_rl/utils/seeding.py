"""Seeds derived from (run seed, step, stream), so each use of randomness in a step is independent and a
resumed or replayed step draws exactly the same numbers."""

from __future__ import annotations

import numpy as np

ROLLOUT_STREAM = 0  # the step's rollout sampling
DRIFT_STREAM = 1  # the drift check's weight coordinates
EVAL_STREAM = 2  # the eval's sampling
KL_ROWS_STREAM = 3  # the rows a train rank measures the step's KL on (per rank)


def stream_seed(seed: int, step: int, stream: int, *more: int) -> int:
    return int(np.random.SeedSequence([seed, step, stream, *more]).generate_state(1)[0])
