import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from logra_rl.rewards import GradeRequest, GraderTimeout, RewardPool, math_reward
from logra_rl.rewards import math as math_grader
from logra_rl.rewards.math import gold_parses, grade

TIMEOUT_S = 1.0
TOWER = r"\boxed{2^{2^{2^{2^{2^2}}}}}"  # sympy would evaluate this far beyond any timeout
PATHOLOGICAL = [TOWER, r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{9})!}"]
# Graded against a symbolic answer: against a number, arithmetic on numbers alone is refused before sympy.
SYMBOLIC = r"\sqrt{3}"

# (response, reference answer, verdict) — verdicts are math-verify's, except where the docstring of
# logra_rl.rewards.math says the text comparison decides first (`\text{Evelyn}` vs `Evelyn`).
CASES = [
    # fractions and decimals
    (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{2/4}", r"\frac{1}{2}", 1.0),
    (r"\boxed{-\frac{3}{2}}", "-1.5", 1.0),
    (r"\boxed{1.5}", "-1.5", 0.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    (r"\boxed{0.333333}", r"\frac{1}{3}", 1.0),  # math-verify rounds to 6 decimals
    (r"\boxed{\frac{14}{3}}", r"\frac{14}{3}", 1.0),
    (r"\boxed{\frac{13}{3}}", r"\frac{14}{3}", 0.0),
    (r"\boxed{3.0}", "3", 1.0),
    # integers
    (r"\boxed{42}", "42", 1.0),
    (r"\boxed{43}", "42", 0.0),
    (r"\boxed{-50}", "-50", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{10080}", r"10,\!080", 1.0),
    # square roots
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
    (r"\boxed{\frac{3\sqrt{3}}{4}}", r"\frac{3\sqrt{3}}{4}", 1.0),
    # intervals
    (r"\boxed{[1, 3)}", "[1,3)", 1.0),
    (r"\boxed{(1, 3)}", "[1,3)", 0.0),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", 1.0),
    (r"\boxed{\left(2, \infty\right)}", r"(2,\infty)", 1.0),
    # tuples
    (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{(2,-6)}", "(2, -6)", 1.0),
    (r"\boxed{(-6, 2)}", "(2, -6)", 0.0),
    # units, degrees, currency
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{5}", r"5\text{ cm}", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{90}", r"90^\circ", 1.0),
    (r"\boxed{36}", r"\$36", 1.0),
    (r"\boxed{\$18.90}", r"\$18.90", 1.0),
    # text answers
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", 1.0),
    (r"\boxed{Evelyn}", r"\text{Evelyn}", 1.0),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", 1.0),
    (r"\boxed{C}", r"\text{(C)}", 1.0),
    (r"\boxed{\text{(B)}}", r"\text{(C)}", 0.0),
    (r"\boxed{\text{even}}", r"\text{odd}", 0.0),
    # percentages: math-verify reads 50\% as 50
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{0.5}", r"50\%", 0.0),
    # expressions and equations
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{x^2+1}", "x^2-1", 0.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{6 - 5i}", "6-5i", 1.0),
    (r"\boxed{p-q}", "p - q", 1.0),
    # arithmetic left to do is no answer to a number: a policy that echoes "Calculate 36 - 5." scored 1.0 before
    ("36 - 5", "31", 0.0),
    (r"\boxed{35 - 54}", "-19", 0.0),
    (r"\boxed{7 \times 8}", "56", 0.0),
    (r"\boxed{7 \cdot 8}", "56", 0.0),
    (r"\boxed{2^{10}}", "1024", 0.0),
    (r"\boxed{\frac{36-5}{1}}", "31", 0.0),
    (r"\boxed{x = 36 - 5}", "31", 0.0),
    ("36 - 5 = 31", "31", 1.0),  # worked, then answered
    (r"\boxed{1.5 \times 10^{3}}", "1500", 1.0),  # scientific notation is a number
    (r"\boxed{\frac{-1}{2}}", "-0.5", 1.0),  # a sign, not a subtraction
    (r"\boxed{x = 1/3}", "1/3", 1.0),  # a fraction is a number, not a division left to do
    (r"\boxed{\left(-19\right)}", "-19", 1.0),
    (r"\boxed{\sqrt{4}}", "2", 1.0),  # not arithmetic on numbers alone: math-verify decides
    (r"\boxed{2+3}", "2+3", 1.0),  # the reference answer is itself an expression
    # no answer at all
    ("I am not sure how to solve this.", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{}", "3", 0.0),
    (r"\boxed{3}", "", 0.0),  # an empty reference answer matches nothing
    (r"\boxed{7}", r"$\boxed{7}$", 1.0),  # an already-delimited reference answer
    # several boxes: the last one counts, and \boxed beats \fbox
    (r"First \boxed{2}, on reflection \boxed{3}", "3", 1.0),
    (r"It is \boxed{3}, not \boxed{2}", "3", 0.0),
    (r"\fbox{7}", "7", 1.0),
    (r"\boxed{8}, not \fbox{7}", "8", 1.0),
    (r"The answer is 4, so \boxed{\frac{1}{2}", "4", 1.0),  # an unclosed box is no box
    # answer phrases (DAPO-Math asks for an "Answer:" line)
    ("The answer is 42.", "42", 1.0),
    ("Answer: 34", "34", 1.0),
    ("**Final Answer:** 17", "17", 1.0),
    ("Therefore, x = 5.", "5", 1.0),
    ("Thus the area is 12 square units.", "12", 1.0),
    (r"The answer is $\frac{3}{4}$.", "0.75", 1.0),
    ("The answer is 42, which is even.", "42", 1.0),
    ("I thought the answer is 41. Rechecking, the answer is 42", "42", 1.0),
    # the last number
    ("We add 3 apples and 4 pears to get 7", "7", 1.0),
    ("so we get 7 and then 8", "7", 0.0),
    ("so we end at -2.5", "-2.5", 1.0),
    (r"so we get \frac{3}{4}", "0.75", 1.0),
    ("a total of 1,234 apples", "1234", 1.0),
    # end-of-text markers left by a decoder
    (r"\boxed{7}<|im_end|>", "7", 1.0),
]


@pytest.mark.parametrize(("response", "answer", "expected"), CASES)
def test_grade(response, answer, expected):
    assert grade(response, answer) == expected
    assert math_reward(response, answer, {}) == expected


def test_latex_parsing_is_two_stage_and_falls_back_to_full_ll():
    from latex2sympy2_extended import latex2sympy2

    assert latex2sympy2._Latex2Sympy.create_parser.__name__ == "two_stage_parser"  # else grading is ~3x slower
    # The first needs full LL (SLL reports a syntax error), the others parse in SLL: all as LL alone would.
    for latex, expected in [
        ("x^2+10x", "x**2 + 10*x"),
        (r"\left[1, 3\right)", "Interval.Ropen(1, 3)"),
        ("2^{10}", "2**10"),
    ]:
        assert str(latex2sympy2.latex2sympy(latex)) == expected


def test_an_unparseable_reference_answer_only_matches_itself_and_is_not_usable():
    assert grade(r"\boxed{1}", ")(") == 0.0
    assert grade(r"\boxed{)(}", ")(") == 1.0
    assert not gold_parses(")(") and not gold_parses(" ")  # counted in reward/bad_ground_truths (test_grading)
    assert gold_parses("12") and gold_parses(r"\frac{1}{2}") and gold_parses("[1, 2)")


def test_pathological_answers_time_out_on_the_main_thread_and_restore_the_callers_alarm():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        for response in PATHOLOGICAL:
            start = time.monotonic()
            assert grade(response, SYMBOLIC, timeout_s=TIMEOUT_S) == 0.0
            assert time.monotonic() - start < TIMEOUT_S + 0.5
        assert grade(r"\boxed{\frac{1}{2}}", "0.5", timeout_s=TIMEOUT_S) == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < remaining < 30.0  # the caller's timer runs on, minus the time spent
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_math_reward_reports_its_timeout(monkeypatch):
    monkeypatch.setattr(math_grader, "DEFAULT_TIMEOUT_S", TIMEOUT_S)
    with pytest.raises(GraderTimeout, match=r"longer than 1\.0s"):
        math_reward(TOWER, SYMBOLIC, {})


def _timed(response: str, answer: str) -> tuple[float, float]:
    start = time.monotonic()
    return grade(response, answer, timeout_s=TIMEOUT_S), time.monotonic() - start


def test_worker_threads_grade_in_subprocesses_with_the_same_timeout():
    ordinary = [(rf"\boxed{{\frac{{{i}}}{{4}}}}", str(i / 4)) for i in range(20)] + [(r"\boxed{x^2}", "x^3")]
    with ThreadPoolExecutor(max_workers=2) as threads:
        assert list(threads.map(lambda pair: grade(*pair), ordinary)) == [1.0] * 20 + [0.0]
        # One at a time, on a grading subprocess the items above started (its start-up is not timed).
        timed = threads.submit(lambda: [_timed(response, SYMBOLIC) for response in PATHOLOGICAL]).result()
    assert [reward for reward, _ in timed] == [0.0] * len(PATHOLOGICAL)
    assert max(seconds for _, seconds in timed) < TIMEOUT_S + 0.5


def test_a_stuck_grading_subprocess_is_killed_and_replaced():
    result = {}

    def body():
        grade(r"\boxed{1}", "1")  # a worker is started and parked
        [worker] = math_grader._idle_workers[-1:]
        os.kill(worker.process.pid, signal.SIGSTOP)  # stuck: not even its own timer can answer
        result["stuck"] = _timed(r"\boxed{1}", "1")
        result["killed"] = worker.process.poll() is not None
        result["next"] = grade(r"\boxed{1}", "1")

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    reward, seconds = result["stuck"]
    assert reward == 0.0 and TIMEOUT_S <= seconds < TIMEOUT_S + math_grader.KILL_GRACE_S + 0.5
    assert result["killed"] and result["next"] == 1.0


def test_a_process_pool_grades_on_its_workers_main_threads():
    items = [(r"\boxed{\frac{1}{2}}", "0.5"), (TOWER, SYMBOLIC), ("Answer: 34", "34"), (r"\boxed{2}", "3")]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as processes:
        start = time.monotonic()
        rewards = list(processes.map(grade, *zip(*items, strict=True), [TIMEOUT_S] * len(items)))
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert time.monotonic() - start < TIMEOUT_S + 2.0


def test_the_reward_pool_grades_math_and_counts_timeouts():
    with RewardPool(num_workers=1, timeout_s=TIMEOUT_S) as pool:
        requests = [GradeRequest("math", r"\boxed{\frac{1}{2}}", "0.5"), GradeRequest("math", "Answer: 7", "8")]
        results = pool.grade([*requests, GradeRequest("tests.rewards.test_math:_timing_out", "x", "y")])
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert [r.timed_out for r in results] == [False, False, True]
    assert pool.summary["timeouts"] == 1 and pool.summary["errors"] == 0


def _timing_out(response, answer, metadata):
    raise GraderTimeout("gave up")
