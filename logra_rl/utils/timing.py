"""Wall time per named phase, summed over repeats, as `timing_s/<name>` metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block; a phase timed more than once in a step (one per microbatch) adds up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
