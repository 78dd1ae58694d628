"""SIGTERM and SIGINT as a request to stop: what SLURM, Kubernetes, `timeout` and Ctrl-C send before they kill a job.

The first signal is only noted; the step loop stops at its next safe point with a checkpoint of the step it
reached and exits (SIGTERM: `trainer.preempted_exit_code`, 0; SIGINT: 130). Inside `interruptible()` (an eval, a step's
generation, its grading: work that changes no state a checkpoint holds) the first signal raises `Interrupted` at
once, so a slow eval cannot outlast a preemption's grace period; once a step trains it runs to its end. The signal
may reach every process of the job (SLURM signals them all): Ray's processes block SIGTERM
(`cluster.start_ray`), so the workers are still there to write the checkpoint; grading processes are not, which is
why grading is interruptible. A second signal exits at once, unless the run is already shutting down (Ray and the
workers): then that shutdown is the quickest way out, and an exit raised inside it (often inside a finalizer) would
only print a traceback and leave processes behind. No signal ever prints a traceback."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A signal arrived inside `Preemption.interruptible()`: the work it interrupted is to be abandoned. A
    BaseException, as KeyboardInterrupt is: the code it interrupts (a grading pool's `except Exception`, which
    scores a failed item 0) must not take it for an error of its own."""


class Preemption:
    """While entered (in the main thread), SIGTERM and SIGINT set `signal` instead of killing the process."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.shutting_down = False  # set by the run once it has begun to stop its processes
        self._interruptible = False
        self._previous: dict[int, object] = {}

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Work that may be dropped when a signal comes (it changes nothing a checkpoint holds): a signal already
        noted, or one that arrives inside, raises `Interrupted` instead of waiting for the work to end."""
        if self.requested:
            raise Interrupted(self.name)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __enter__(self) -> Preemption:
        self.arm()
        return self

    def arm(self) -> None:
        """Install the handlers (again: `ray.init` installs its own for SIGTERM, so call this after it)."""
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            return
        for number in SIGNALS:
            previous = signal.signal(number, self._handle)
            self._previous.setdefault(number, previous)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.disarm()

    def disarm(self) -> None:
        """Put back the handlers found when first armed (a run's teardown does, so no stale one outlives it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal is not None and self.shutting_down:
            os.write(sys.stderr.fileno(), b"\n[logra-train] already shutting down Ray and the workers\n")
            return
        if self.signal is not None:  # the second signal: leave now (the teardown still runs), with the shell's
            raise SystemExit(128 + number)  # status for a process a signal ended (SIGTERM 143, SIGINT 130)
        self.signal = number
        message = (
            f"\n[logra-train] {signal.Signals(number).name}: stopping at the next safe point with a checkpoint "
            "(send it again to exit at once)\n"
        )
        os.write(sys.stderr.fileno(), message.encode())  # not print: the main thread may be inside a write
        if self._interruptible:
            self._interruptible = False  # once: what handles it may itself wait on something
            raise Interrupted(self.name)
