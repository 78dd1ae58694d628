r"""The `math` reward: extract the final answer, compare it with math-verify, under a hard time limit.

Extraction (logra_rl.rewards.answers, docs/data.md): after any thinking, the last box (with the boxes joined to it),
else the last answer phrase's maths, else the last maths of the response. The prompt is never searched: a response
with no answer scores 0 even if the question contains one.

Comparison: identical text (ignoring spaces and `\text{}` wrappers) is correct; against a number, arithmetic left
to do (`36 - 5` for 31) is wrong, though math-verify would evaluate it (`_is_computation`); two plain numbers
(integers, decimals, `a/b`, `\frac{a}{b}`, mixed numbers) are compared exactly in Python, deferring to math-verify
only where its 6-decimal rounding could matter; inequalities and memberships become intervals; everything else is
`math_verify.verify(parse(gold), parse(prediction))`. The number fast path gives math-verify's verdict without its
LaTeX parse (2-10 ms), which matters because DAPO-Math answers are integers; that parse itself is made ~3x faster by
ANTLR's two-stage parsing (`_use_two_stage_latex_parsing`).

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

from logra_rl.rewards.answers import find_answer
from logra_rl.rewards.graders import GraderTimeout, register_reward

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

_PLAIN_NUMBER = re.compile(  # `-4 4/9` and `918\frac{1}{2}` are mixed numbers
    r"(?P<sign>[-+]?)(?:(?P<whole>\d+) ?)??(?:\\[dt]?frac\{(?P<num>\d+)\}\{(?P<den>\d+)\}|(?P<a>\d+)/(?P<b>\d+)"
    r"|(?P<dec>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d*\.\d+|\d+))"
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")
# `\mathrm{e}` inside `\frac{1}{...}` cuts math-verify's parse short (`1 - \frac{1}{\mathrm{e}}` read as `1`).
_LETTER_FONT = re.compile(r"\\(?:mathrm|mathit|mathbf|text|textrm|textit|textbf|operatorname)\{\s*([a-zA-Z])\s*\}")
_OPERATORS = {"<": (True, False), r"\lt": (True, False), "<=": (True, True), "≤": (True, True), r"\le": (True, True),
              r"\leq": (True, True), r"\leqslant": (True, True), ">": (False, False), r"\gt": (False, False),
              ">=": (False, True), "≥": (False, True), r"\ge": (False, True), r"\geq": (False, True),
              r"\geqslant": (False, True)}  # fmt: skip
_RELATION = re.compile(r"(<=|>=|<|>|≤|≥|\\[lg]eq(?:slant)?(?![a-zA-Z])|\\[lg][et](?![a-zA-Z]))")
_UNION = re.compile(r"\s*(?:\\text\{\s*or\s*\}|\bor\b|\\cup(?![a-zA-Z])|\\l?or(?![a-zA-Z])|\\vee(?![a-zA-Z]))\s*")
_VARIABLE = re.compile(r"[a-zA-Z](?:_\{?\w+\}?)?")
_MEMBERSHIP = re.compile(r"(?P<variable>[a-zA-Z](?:_\{?\w+\}?)?)\s*\\in(?![a-zA-Z])\s*(?P<set>.+)", re.DOTALL)
# Numbers and arithmetic only, once `\times`, `\cdot` and `\div` are operators and spacing, `\left`, `\right` and
# `\frac` are spaces (`\frac{6}{3}` is then `{6}{3}`: a number, as `_number` reads it).
_ARITHMETIC_COMMAND = re.compile(r"\\(?:left|right|[,;:! ]|[dt]?frac|times|cdot|div)(?![a-zA-Z])")
_OPERATOR_OF = {r"\times": "*", r"\cdot": "*", r"\div": "/"}
_ARITHMETIC = re.compile(r"[\d\s.,+\-−*/×÷^(){}\[\]]*\d[\d\s.,+\-−*/×÷^(){}\[\]]*")
_BINARY_OPERATOR = re.compile(r"[\d)}\]]\s*[+\-−*/×÷^]")  # after an operand: `{-1}` is a sign, `3 - 1` is not
_SCIENTIFIC = re.compile(r"[-+]?\d+(?:\.\d+)?\s*[*×]\s*10\s*\^\s*\{?\s*[-+]?\d+\s*\}?")
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")  # math already delimited (an escaped \$ is a dollar sign)


class _Timeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so `except Exception` in math-verify and sympy lets it pass."""


def grade(
    response: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S, grade_thinking: bool = False
) -> float:
    """1.0 if the final answer in `response` equals `ground_truth`, else 0.0 — also on any error or timeout.

    Only what follows `</think>` is graded unless `grade_thinking` (logra_rl.rewards.answers.final_text).
    """
    return float(_grade_bounded(response, ground_truth, timeout_s, grade_thinking) is True)


def gold_parses(gold: str) -> bool:
    """Whether `math` can grade against the reference answer `gold`: it is a plain number, or math-verify reads
    maths in it (else it is blank, or text only a response identical to it matches)."""
    gold = gold.strip()
    return bool(gold) and (_number(gold) is not None or not all(isinstance(p, str) for p in _parse_gold(gold)))


@register_reward("math", answer_check=gold_parses)
def math_reward(response: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """`grade` as a reward; a timeout raises GraderTimeout so the pool counts it in `reward/grader_timeouts`."""
    verdict = _grade_bounded(response, answer, DEFAULT_TIMEOUT_S, bool(metadata.get("grade_thinking", False)))
    if verdict is None:
        raise GraderTimeout(f"math grading took longer than {DEFAULT_TIMEOUT_S}s")
    return float(verdict)


# the original name, kept for configs using it
math_verify_reward = register_reward("math_verify", answer_check=gold_parses)(math_reward)


def _grade_bounded(response: str, ground_truth: str, timeout_s: float, grade_thinking: bool) -> bool | None:
    """The verdict, or None when grading ran out of time; an error is a wrong answer."""
    try:
        if _alarm_usable():
            return _on_main_thread(response, ground_truth, timeout_s, grade_thinking)
        return _in_worker(response, ground_truth, timeout_s, grade_thinking)
    except Exception as error:
        logger.debug("math grading failed (%s: %s); scoring 0", type(error).__name__, error)
        return False


def _verdict(response: str, ground_truth: str, grade_thinking: bool) -> bool:
    gold = ground_truth.strip()
    answer = find_answer(response, grade_thinking)
    if not gold or answer is None:
        return False
    prediction, plain = answer.text, _plain_text(answer.text)
    if not plain:
        return False
    if _plain_text(gold) in (plain, answer.sentence and _plain_text(answer.sentence)):
        return True
    numbers = _number(gold), _number(prediction)
    if numbers[0] is not None and _is_computation(prediction):
        return False  # "Calculate 36 - 5." answered `36 - 5`: math-verify would evaluate it to 31
    if None not in numbers:
        equal = _numbers_equal(*numbers, exact="." not in gold + prediction)
        if equal is not None:
            return equal
    gold_set, prediction_set = _as_set(gold), _as_set(prediction)
    if gold_set or prediction_set:  # `-2 \le x \le 7` = `x \in [-2, 7]` = `[-2, 7]`
        (gold_variable, gold), (variable, prediction) = gold_set or (None, gold), prediction_set or (None, prediction)
        if gold_variable and variable and gold_variable != variable:
            return False
    return verify(_parse_gold(gold), parse(_latex(prediction), parsing_timeout=None), timeout_seconds=None)


def _as_set(answer: str) -> tuple[str, str] | None:
    r"""(variable, interval or set in LaTeX) for `x \in S`, `a < x \le b`, `x \ge a` and unions of those joined by
    `or` / `\cup`; None for anything else (only constant bounds: `x < y` stays a relation)."""
    answer = answer.strip().strip("$").strip()
    membership = _MEMBERSHIP.fullmatch(answer)
    if membership:
        return membership["variable"], membership["set"]
    pieces = [_as_interval(piece) for piece in _UNION.split(answer)]
    if not pieces or None in pieces or len({variable for variable, _ in pieces}) != 1:
        return None
    return pieces[0][0], r" \cup ".join(interval for _, interval in pieces)


def _as_interval(relation: str) -> tuple[str, str] | None:
    """`x > a`, `a < x`, `-x > a` or `a < x <= b` (either direction) as (x, interval)."""
    parts = [part.strip() for part in _RELATION.split(relation)]
    operators = [_OPERATORS[op] for op in parts[1::2]]  # (is `<`-like, includes equality)
    if len(parts) == 3:
        (less, closed), variable_left = operators[0], bool(_VARIABLE.fullmatch(parts[0].lstrip("-")))
        variable, bound = (parts[0], parts[2]) if variable_left else (parts[2], parts[0])
        if variable.startswith("-"):  # -x > a  <=>  x < -a
            variable, bound, less = variable[1:].strip(), f"-({bound})", not less
        if not (_VARIABLE.fullmatch(variable) and _constant(bound)):
            return None
        if less == variable_left:  # x < a
            return variable, rf"(-\infty, {bound}{']' if closed else ')'}"
        return variable, rf"{'[' if closed else '('}{bound}, \infty)"
    if len(parts) == 5:
        low, variable, high = parts[0::2]
        same_direction = operators[0][0] == operators[1][0]
        if not (same_direction and _VARIABLE.fullmatch(variable) and _constant(low) and _constant(high)):
            return None
        closed = [c for _, c in operators]
        if not operators[0][0]:  # b > x > a
            low, high, closed = high, low, closed[::-1]
        return variable, f"{'[' if closed[0] else '('}{low}, {high}{']' if closed[1] else ')'}"
    return None


def _constant(bound: str) -> bool:
    r"""A bound with no letters outside LaTeX commands (`-2`, `\frac{1}{2}`, `2\pi`), so not a variable."""
    return bool(bound) and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", bound))


def _plain_text(answer: str) -> str:
    return "".join(_TEXT_WRAPPER.sub(r"\1", answer).strip("$").split())


def _latex(answer: str) -> str:
    """Math-verify parses a bare answer (`0.5`, `\\frac12`) best as inline math; delimited text stays as it is."""
    answer = _LETTER_FONT.sub(r"\1", answer)
    return answer if _DELIMITED.search(answer) else f"${answer}$"


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """math-verify's parse of a reference answer: the raw text alone when it reads nothing (`gold_parses`)."""
    return parse(_latex(gold), parsing_timeout=None)


def _number(text: str) -> Fraction | None:
    """A plain number as an exact fraction, or None (anything else, or too long to be ordinary)."""
    match = _PLAIN_NUMBER.fullmatch(text.strip().strip("$").strip()) if len(text) <= 40 else None
    if match is None:
        return None
    if match["num"] is not None or match["a"] is not None:
        numerator, denominator = int(match["num"] or match["a"]), int(match["den"] or match["b"])
        if denominator == 0:
            return None
        if match["whole"] is not None and numerator >= denominator:
            return None  # `11 7/6` is not a mixed number
        value = Fraction(numerator, denominator) + int(match["whole"] or 0)
    elif match["whole"] is not None:  # `1 000`
        return None
    else:
        value = Fraction(match["dec"].replace(",", ""))
    return -value if match["sign"] == "-" else value


def _is_computation(answer: str) -> bool:
    r"""Whether the answer (its right-hand side after any `=`) is arithmetic on numbers left to do: `36 - 5`,
    `7 \times 8`, `2^{10}`. Against a number, such an answer restates the question rather than answering it, as in
    PRM800K's grader, where an integer reference answer takes only an integer; a number written in scientific
    notation (`1.5 \times 10^{3}`), a signed fraction (`\frac{-1}{2}`) and a plain number (`1/3`, `x = 1/3`) are
    numbers, not computations."""
    answer = answer.rsplit("=", 1)[-1].strip().strip("$")
    if _number(answer) is not None:
        return False
    answer = _ARITHMETIC_COMMAND.sub(lambda command: _OPERATOR_OF.get(command[0], " "), answer).strip()
    if not answer or _SCIENTIFIC.fullmatch(answer) or not _ARITHMETIC.fullmatch(answer):
        return False
    return bool(_BINARY_OPERATOR.search(answer))


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


def _on_main_thread(response: str, ground_truth: str, timeout_s: float, grade_thinking: bool) -> bool | None:
    previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s, RETRY_S)
    start = time.monotonic()
    try:
        try:
            return _verdict(response, ground_truth, grade_thinking)
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
    """A grading subprocess: a JSON line `[response, ground_truth, timeout_s, grade_thinking]` in, a verdict out."""

    def __init__(self) -> None:
        # `python -c` puts the working directory first on sys.path; this checkout goes there instead, so the child
        # runs the same logra_rl as its parent wherever it starts (not another copy in the working directory).
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path[0] = {root!r}; from logra_rl.rewards.math import serve; serve()"
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        self.process = subprocess.Popen([sys.executable, "-c", code], **pipes, text=True)
        if self._reply(WORKER_START_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError(f"the math grading worker did not start within {WORKER_START_TIMEOUT_S}s")

    def grade(self, response: str, ground_truth: str, timeout_s: float, grade_thinking: bool) -> bool | None:
        self.process.stdin.write(json.dumps([response, ground_truth, timeout_s, grade_thinking]) + "\n")
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


def _in_worker(response: str, ground_truth: str, timeout_s: float, grade_thinking: bool) -> bool | None:
    with _workers_lock:
        worker = _idle_workers.pop() if _idle_workers else None
    if worker is None or not worker.alive:  # an idle worker can die (e.g. killed for memory): start another
        worker = _Worker()
    verdict = worker.grade(response, ground_truth, timeout_s, grade_thinking)
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
        verdict = _grade_bounded(*json.loads(line))
        print(reply_lines[verdict], file=replies, flush=True)
