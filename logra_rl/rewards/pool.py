"""Grading in worker processes with a hard per-item timeout.

Graders run in the main thread of spawned worker processes (so signal-based timeouts such as the `math`
reward's work there), started once and reused. pebble's ProcessPool enforces the per-item timeout: a timed-out item's
worker is killed and replaced, so one pathological answer costs at most `timeout_s` and reward 0; a grader that
stops itself earlier (GraderTimeout, e.g. the `math` reward at 5 s) counts as a timeout too. A grader
exception, or a reward that is not a finite number in [0, 1], also scores 0 with the error recorded: the
caller never sees an exception from a grader. Workers are spawned, so they re-import the caller's main
module: it must be a file or a `-m` module, with its entry point behind `if __name__ == "__main__":`.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from pebble import ProcessPool

from logra_rl.rewards.graders import GraderTimeout, get_reward_function

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GradeRequest:
    reward: str  # a registered reward name or 'package.module:function'
    response: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GradeResult:
    reward: float
    timed_out: bool = False
    error: str | None = None


def grade_one(reward: str, response: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """Run one grader and check its output (this is what a worker executes)."""
    value = get_reward_function(reward)(response, answer, metadata)
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"reward {reward!r} returned {value!r}; a reward must be a finite number in [0, 1]")
    return float(value)


def grader_metrics(results: Sequence[GradeResult]) -> dict[str, float]:
    """Per-call counts to log next to the rewards."""
    return {
        "reward/grader_timeouts": float(sum(r.timed_out for r in results)),
        "reward/grader_errors": float(sum(r.error is not None for r in results)),
    }


class RewardPool:
    """A pool of grading processes; use as a context manager or call `close()`."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        if not (isinstance(num_workers, int) and num_workers > 0):
            raise ValueError(f"num_workers={num_workers!r} is invalid; give a positive integer")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} is invalid; give a positive number of seconds")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        # Cumulative over the pool's life: items graded, timed out and failed.
        self.summary = {"graded": 0, "timeouts": 0, "errors": 0}
        # spawn, not fork: the caller may hold threads (Ray, torch) that a forked child would inherit broken.
        self._pool = ProcessPool(max_workers=num_workers, context=multiprocessing.get_context("spawn"))
        self._closed = False

    def grade(self, requests: Sequence[GradeRequest]) -> list[GradeResult]:
        """Grade every request; results are in request order. Unknown reward names raise ValueError."""
        if self._closed:
            raise RuntimeError("this RewardPool is closed; create a new one")
        for name in {request.reward for request in requests}:
            get_reward_function(name)  # fail fast on a config error instead of one error per item
        futures = [
            self._pool.schedule(grade_one, args=(r.reward, r.response, r.answer, r.metadata), timeout=self.timeout_s)
            for r in requests
        ]
        results = [self._result(future) for future in futures]
        self._count(requests, results)
        return results

    @staticmethod
    def _result(future) -> GradeResult:
        try:
            return GradeResult(reward=future.result())
        except (FutureTimeoutError, GraderTimeout):
            return GradeResult(reward=0.0, timed_out=True)
        except BrokenProcessPool as error:  # no worker can run: grading nothing is not a reward of 0
            raise RuntimeError(
                f"the grading workers died ({error}); see their traceback above. Spawned workers re-import the "
                "caller's main module: run it as a file or with -m, behind `if __name__ == '__main__':`"
            ) from error
        except Exception as error:
            return GradeResult(reward=0.0, error=f"{type(error).__name__}: {error}")

    def _count(self, requests: Sequence[GradeRequest], results: list[GradeResult]) -> None:
        timeouts = [q.reward for q, r in zip(requests, results, strict=True) if r.timed_out]
        errors = [(q.reward, r.error) for q, r in zip(requests, results, strict=True) if r.error is not None]
        self.summary["graded"] += len(results)
        self.summary["timeouts"] += len(timeouts)
        self.summary["errors"] += len(errors)
        if timeouts:
            logger.warning(
                "%d of %d items timed out after %.1fs (rewards %s); they score 0",
                len(timeouts),
                len(results),
                self.timeout_s,
                sorted(set(timeouts)),
            )
        if errors:
            logger.warning(
                "%d of %d items failed to grade and score 0; first: %s: %s", len(errors), len(results), *errors[0]
            )

    def close(self) -> None:
        """Stop the worker processes."""
        if not self._closed:
            self._closed = True
            self._pool.stop()
            self._pool.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
