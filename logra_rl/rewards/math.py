r"""The `math` reward: extract the final answer, compare it with math-verify, under a hard time limit.

Extraction follows the reference grader (docs/data.md): the last balanced `\boxed{...}` (else the last `\fbox{...}`),
else the last "final answer / answer / therefore / thus ... is|:|=" phrase, else the last number. Unlike the
reference, the prompt is never searched: a response with no answer scores 0 even if the question contains one.

Comparison: identical text (ignoring spaces and `\text{}` wrappers) is correct; two plain numbers (integers,
decimals, `a/b`, `\frac{a}{b}`) are compared exactly in Python, deferring to math-verify only where its 6-decimal
rounding could matter; everything else is `math_verify.verify(parse(gold), parse(prediction))`. The number fast path
gives math-verify's verdict without its LaTeX parse (2-10 ms), which matters because DAPO-Math answers are integers;
that parse itself is made ~3x faster by ANTLR's two-stage parsing (`_use_two_stage_latex_parsing`).

Time limit: math-verify's own timeouts use `signal.alarm` and fail off a process's main thread, so they are off
here. On a main thread an interval timer (SIGALRM, the caller's handler and timer restored afterwards) interrupts
the grading after `timeout_s`. On any other thread the item goes to a persistent worker subprocess that grades it
on its own main thread the same way, and is killed if it overruns by KILL_GRACE_S (a C call the signal cannot
interrupt). Workers start once (~1.5 s) and are reused; they exit when their parent does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

import math_verify.grader
import math_verify.parser
from antlr4.atn.PredictionMode import PredictionMode
from latex2sympy2_extended import latex2sympy2
from math_verify import parse, verify

from logra_rl.rewards.graders import GraderTimeout, last_boxed, register_reward, strip_end_of_text

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
KILL_GRACE_S = 1.0  # a worker's own timer fires at timeout_s; it is killed only if stuck past this
RETRY_S = 0.05  # the timer re-fires at this interval in case the grading code swallowed the first interrupt
WORKER_START_TIMEOUT_S = 120.0
MAX_IDLE_WORKERS = os.cpu_count() or 1

# We enforce our own timeout; silence math-verify's one-time "timeout is disabled" warning.
math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True


def _use_two_stage_latex_parsing() -> None:
    """Make math-verify's LaTeX parser (latex2sympy's ANTLR grammar) ~3x faster without changing a result.

    ANTLR's two-stage strategy: parse with SLL prediction and, only on a syntax error, again with full LL. ANTLR
    guarantees that a successful SLL parse is the tree LL would build. Checked on a known expression after patching;
    if latex2sympy's internals are not what this expects (it is pinned by math-verify), it is left as it was.
    """
    converter = getattr(latex2sympy2, "_Latex2Sympy", None)
    create_parser = getattr(converter, "create_parser", None)
    if create_parser is None:
        return

    def two_stage_parser(self, latex: str):
        parser = create_parser(self, latex)
        parser._interp.predictionMode = PredictionMode.SLL
        parse_math = parser.math

        def math():
            try:
                return parse_math()
            except Exception:  # latex2sympy's error listener raises on a syntax error: retry with full LL
                parser.reset()
                parser._interp.predictionMode = PredictionMode.LL
                return parse_math()

        parser.math = math
        return parser

    converter.create_parser = two_stage_parser
    try:
        works = str(latex2sympy2.latex2sympy(r"x^2+10x+\frac{1}{2}")) == "x**2 + 10*x + 1/2"
    except Exception:
        works = False
    if not works:
        converter.create_parser = create_parser


_use_two_stage_latex_parsing()

_KEYWORD = re.compile(r"\b(?:final answer|answer|therefore|thus)\b", re.IGNORECASE)
_PHRASE_TAIL = re.compile(r"[^\n<|]{0,40}?(?:\bis\b:?|:|=)\s*([^\n<|]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\\[dt]?frac\{\d+\}\{\d+\}|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?(?:/\d+)?")
_PLAIN_NUMBER = re.compile(
    r"(?P<sign>-?)(?:\\[dt]?frac\{(?P<num>\d+)\}\{(?P<den>\d+)\}|(?P<a>\d+)/(?P<b>\d+)|(?P<dec>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?))"
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")
_SENTENCE_END = re.compile(r"\.(?!\d)|,\s+(?=[a-z]{2,}\b)")  # "42, which is even." -> "42"
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")  # math already delimited (an escaped \$ is a dollar sign)


class _Timeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so `except Exception` in math-verify and sympy lets it pass."""


def grade(response: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the final answer in `response` equals `ground_truth`, else 0.0 — also on any error or timeout."""
    return float(_grade_bounded(response, ground_truth, timeout_s) is True)


@register_reward("math")
def math_reward(response: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """`grade` as a reward; a timeout raises GraderTimeout so the pool counts it in `reward/grader_timeouts`."""
    verdict = _grade_bounded(response, answer, DEFAULT_TIMEOUT_S)
    if verdict is None:
        raise GraderTimeout(f"math grading took longer than {DEFAULT_TIMEOUT_S}s")
    return float(verdict)


math_verify_reward = register_reward("math_verify")(math_reward)  # the original name, kept for configs using it


def extract_answer(response: str) -> str | None:
    r"""The final answer in `response`: last `\boxed{}`, else `\fbox{}`, else an "answer is" phrase, else a number."""
    text = strip_end_of_text(response)
    for command in ("\\boxed", "\\fbox"):
        boxed = last_boxed(text, command)
        if boxed is not None:
            return boxed.strip()
    for keyword in reversed(list(_KEYWORD.finditer(text))):
        tail = _PHRASE_TAIL.match(text, keyword.end())
        if tail:
            phrase = _SENTENCE_END.split(tail.group(1), maxsplit=1)[0].strip(" \t*")
            if phrase:
                return phrase
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _grade_bounded(response: str, ground_truth: str, timeout_s: float) -> bool | None:
    """The verdict, or None when grading ran out of time; an error is a wrong answer."""
    try:
        if _alarm_usable():
            return _on_main_thread(response, ground_truth, timeout_s)
        return _in_worker(response, ground_truth, timeout_s)
    except Exception as error:
        logger.debug("math grading failed (%s: %s); scoring 0", type(error).__name__, error)
        return False


def _verdict(response: str, ground_truth: str) -> bool:
    gold = ground_truth.strip()
    prediction = extract_answer(response)
    if not gold or prediction is None:
        return False
    plain = _plain_text(prediction)
    if not plain:
        return False
    if plain == _plain_text(gold):
        return True
    numbers = _number(gold), _number(prediction)
    if None not in numbers:
        equal = _numbers_equal(*numbers, exact="." not in gold + prediction)
        if equal is not None:
            return equal
    return verify(_parse_gold(gold), parse(_latex(prediction), parsing_timeout=None), timeout_seconds=None)


def _plain_text(answer: str) -> str:
    return "".join(_TEXT_WRAPPER.sub(r"\1", answer).strip("$").split())


def _latex(answer: str) -> str:
    """Math-verify parses a bare answer (`0.5`, `\\frac12`) best as inline math; delimited text stays as it is."""
    return answer if _DELIMITED.search(answer) else f"${answer}$"


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    parsed = parse(_latex(gold), parsing_timeout=None)
    if all(isinstance(p, str) for p in parsed):  # math-verify returns the raw text when it cannot parse
        logger.warning("math-verify cannot parse the reference answer %r; only identical text scores 1", gold)
    return parsed


def _number(text: str) -> Fraction | None:
    """A plain number as an exact fraction, or None (anything else, or too long to be ordinary)."""
    match = _PLAIN_NUMBER.fullmatch(text.strip().strip("$").strip()) if len(text) <= 40 else None
    if match is None:
        return None
    if match["num"] is not None or match["a"] is not None:
        numerator, denominator = int(match["num"] or match["a"]), int(match["den"] or match["b"])
        if denominator == 0:
            return None
        value = Fraction(numerator, denominator)
    else:
        value = Fraction(match["dec"].replace(",", ""))
    return -value if match["sign"] else value


def _numbers_equal(gold: Fraction, prediction: Fraction, exact: bool) -> bool | None:
    """math-verify's verdict on two plain numbers, or None where its rounding to 6 decimals could decide."""
    if gold == prediction:
        return True
    if exact or abs(gold - prediction) > Fraction(1, 10**5):
        return False
    return None


# ---- the time limit -------------------------------------------------------------------------------


def _alarm_usable() -> bool:
    """SIGALRM works on the main thread of the main interpreter, when the current handler is a Python one."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) is not None
    )


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _Timeout


def _on_main_thread(response: str, ground_truth: str, timeout_s: float) -> bool | None:
    previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s, RETRY_S)
    start = time.monotonic()
    try:
        try:
            return _verdict(response, ground_truth)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:  # also when it fires inside the inner `finally`, before the timer is disarmed
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:  # the caller's own timer: re-arm it with what is left (late by at most timeout_s)
            remaining = max(previous_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


class _Worker:
    """A grading subprocess: one JSON line `[response, ground_truth, timeout_s]` in, one verdict line out."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this checkout of logra_rl
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-c", "from logra_rl.rewards.math import serve; serve()"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self._reply(WORKER_START_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError(f"the math grading worker did not start within {WORKER_START_TIMEOUT_S}s")

    def grade(self, response: str, ground_truth: str, timeout_s: float) -> bool | None:
        self.process.stdin.write(json.dumps([response, ground_truth, timeout_s]) + "\n")
        self.process.stdin.flush()
        reply = self._reply(timeout_s + KILL_GRACE_S)
        if reply is None:  # stuck where its own timer cannot reach: kill it, a fresh one takes its place
            self.close()
            return None
        if reply not in _VERDICTS:
            self.close()
            raise RuntimeError(f"the math grading worker replied {reply!r}")
        return _VERDICTS[reply]

    def _reply(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the math grading worker exited with code {self.process.returncode}")
        return line.strip()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


_VERDICTS = {"1": True, "0": False, "T": None}  # the worker's reply lines
_idle_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _forget_workers() -> None:
    """In a forked child the parent's workers are not ours to use (and the lock may be held)."""
    global _idle_workers, _workers_lock
    _idle_workers, _workers_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _in_worker(response: str, ground_truth: str, timeout_s: float) -> bool | None:
    with _workers_lock:
        worker = _idle_workers.pop() if _idle_workers else None
    if worker is None or not worker.alive:  # an idle worker can die (e.g. killed for memory): start another
        worker = _Worker()
    verdict = worker.grade(response, ground_truth, timeout_s)
    if worker.alive:
        with _workers_lock:
            keep = len(_idle_workers) < MAX_IDLE_WORKERS
            if keep:
                _idle_workers.append(worker)
        if not keep:
            worker.close()
    return verdict


def serve() -> None:
    """The worker loop: grade each request on this process's main thread until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else written to stdout, even from C, goes to stderr instead of the reply pipe
    sys.stdout = sys.stderr
    print("ready", file=replies, flush=True)
    reply_lines = {verdict: line for line, verdict in _VERDICTS.items()}
    for line in sys.stdin:
        response, ground_truth, timeout_s = json.loads(line)
        print(reply_lines[_grade_bounded(response, ground_truth, timeout_s)], file=replies, flush=True)
