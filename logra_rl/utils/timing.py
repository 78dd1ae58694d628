"""Wall time: per named phase, summed over repeats, as `timing_s/<name>` metrics; and of one call."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


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


def timed(fn: Callable[[], T], device: torch.device | None = None) -> tuple[T, float]:
    """`fn()` and its wall seconds; on a CUDA device synchronised before and after, so that the kernels it
    queued are counted and earlier ones are not."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start
