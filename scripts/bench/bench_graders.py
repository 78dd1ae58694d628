#!/usr/bin/env python
"""Math grader throughput and timeout behaviour, on one CPU core.

    .venv/bin/python scripts/bench/bench_graders.py                          # ~1 min
    .venv/bin/python scripts/bench/bench_graders.py --math500 math500.jsonl  # also MATH-500's own answers

Gradings/s of `logra_rl.rewards.math.grade` for ordinary correct and wrong answers of several kinds (each item has
its own reference answer, so no cache helps) and the fraction of each graded as it should be (run it with
PYTHONPATH=<an older checkout> to compare graders), on the main thread (signal timer) and from a worker thread
(persistent
grading subprocess), then how long pathological answers take to come back 0 with a 1 s limit. With --math500 (a
local copy with `solution` and `answer` columns) it also grades each official solution against its own answer
(correct) and against the next problem's answer (wrong). The process is pinned to one core (with its grading
subprocess), prints a table and writes JSON; docs/data.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import datasets

from logra_rl.rewards.math import grade
from logra_rl.utils.timing import timed

REASONING = "Let us work through the problem step by step. " * 20  # ~1 KB of text before the answer
PATHOLOGICAL = [r"\boxed{2^{2^{2^{2^{2^2}}}}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{9})!}"]


def _pair(kind: str, i: int, correct: bool) -> tuple[str, str]:
    """(response, reference answer) of one kind; a wrong answer is off by one somewhere."""
    k = i if correct else i + 1
    gold, answer = {
        "integer, Answer: line": (f"{i}", f"Answer: {k}"),
        "integer, boxed": (f"{i}", rf"\boxed{{{k}}}"),
        "fraction vs decimal": (rf"\frac{{{i}}}{{4}}", rf"\boxed{{{k / 4}}}"),
        "a/b vs frac": (rf"\frac{{{i}}}{{{i + 1}}}", rf"\boxed{{{k}/{i + 1}}}"),
        "sqrt form": (rf"{i}\sqrt{{2}}", rf"\boxed{{\sqrt{{{2 * k * k}}}}}"),
        "expression": (rf"x^2+{i}x", rf"\boxed{{x({k}+x)}}"),
        "interval": (rf"[{i}, {i + 5})", rf"\boxed{{\left[{k}, {i + 5}\right)}}"),
        "several boxes": (f"{i}, -{i + 1}", rf"The solutions are \boxed{{{k}}} and \boxed{{-{i + 1}}}."),
        "inline math, no box": (f"({i}, {i + 5})", f"... so the pair is $({k}, {i + 5})$."),
        "answer phrase, then words": (f"{i}", f"The answer is {k} because {k} - {i} = {k - i}."),
        "box after thinking": (f"{i}", rf"<think>{REASONING}</think> The answer is \boxed{{{k}}}."),
        "set relation": (rf"x \in [-{i}, {i + 5}]", rf"\boxed{{-{k} \le x \le {i + 5}}}"),
    }[kind]
    return f"{REASONING}\n\n{answer}", gold


KINDS = ["integer, Answer: line", "integer, boxed", "fraction vs decimal", "a/b vs frac", "sqrt form", "expression"]
KINDS += ["interval", "several boxes", "inline math, no box", "answer phrase, then words", "box after thinking"]
KINDS += ["set relation"]
# MATH-500's reference answers: 73% plain numbers (integers, decimals, fractions), the rest symbolic.
MIX = {"integer, boxed": 6, "fraction vs decimal": 1, "a/b vs frac": 1, "sqrt form": 1, "expression": 1, "interval": 1}


def _rate(kinds: list[str], correct: bool, seconds: float, run: Callable = lambda f: f()) -> tuple[float, float]:
    """Gradings/s over `seconds` of fresh items (kinds in turn), and the fraction graded as they should be."""
    result = {}

    def body() -> None:
        start, n, right = time.perf_counter(), 0, 0
        while time.perf_counter() - start < seconds:
            response, gold = _pair(kinds[n % len(kinds)], 10 + n, correct)
            right += grade(response, gold) == float(correct)
            n += 1
        result["rate"], result["right"] = n / (time.perf_counter() - start), right / n

    run(body)
    return result["rate"], result["right"]


def _math500(path: str) -> dict:
    """Official solutions graded against their own answers and against the next problem's (all 500, one pass)."""
    records = datasets.load_dataset("parquet" if path.endswith(".parquet") else "json", data_files=path, split="train")
    solutions, answers = records["solution"], records["answer"]
    row = {"kind": f"MATH-500 solutions ({len(answers)})"}
    for key, shift in [("correct", 0), ("wrong", 1)]:
        rewards, seconds = timed(
            lambda shift=shift: [grade(s, answers[(i + shift) % len(answers)]) for i, s in enumerate(solutions)]
        )
        row[f"{key}_per_s"] = len(rewards) / seconds
        row[f"{key}_rewarded"] = sum(rewards)
        row[f"{key}_graded_right"] = (sum(rewards) if key == "correct" else len(rewards) - sum(rewards)) / len(rewards)
    return row


def _in_thread(fn: Callable[[], None]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument("--out", default="bench_results/graders.json")
    parser.add_argument("--math500", help="a local MATH-500 .jsonl/.parquet (problem, solution, answer)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, inherited by the grading subprocess

    _in_thread(lambda: grade(r"\boxed{1}", "1"))  # start the grading subprocess outside the measurements
    mix = [kind for kind, weight in MIX.items() for _ in range(weight)]
    rows = []
    for label, kinds in [*[(kind, [kind]) for kind in KINDS], ("mix (MATH-500-like)", mix)]:
        row = {"kind": label}
        for correct in (True, False):
            key = "correct" if correct else "wrong"
            row[f"{key}_per_s"], row[f"{key}_graded_right"] = _rate(kinds, correct, args.seconds)
            if label.startswith("mix"):
                row[f"{key}_thread_per_s"], _ = _rate(kinds, correct, args.seconds, _in_thread)
        rows.append(row)
        print(
            f"{label:26} correct {row['correct_per_s']:8.0f}/s ({row['correct_graded_right']:4.0%} scored 1)   "
            f"wrong {row['wrong_per_s']:8.0f}/s ({row['wrong_graded_right']:4.0%} scored 0)",
            flush=True,
        )
    if args.math500:
        rows.append(_math500(args.math500))
        print(
            f"{rows[-1]['kind']:24} correct {rows[-1]['correct_per_s']:8.0f}/s   wrong {rows[-1]['wrong_per_s']:8.0f}/s"
        )

    timeouts = []
    for response in PATHOLOGICAL:
        for where, run in [("main thread", lambda f: f()), ("worker thread", _in_thread)]:
            result = {}

            def body(response: str = response, result: dict = result) -> None:
                result["reward"], result["seconds"] = timed(lambda: grade(response, r"\sqrt{3}", timeout_s=1.0))

            run(body)
            timeouts.append({"response": response, "where": where, "timeout_s": 1.0, **result})
            print(f"timeout 1 s, {where:13} {response:32} -> {result['reward']} in {result['seconds']:.2f} s")

    print("\n| answer kind | correct /s | wrong /s | correct scored 1 | wrong scored 0 |\n|---|---|---|---|---|")
    for row in rows:
        right = [f"{row[k]:.0%}" if k in row else "" for k in ("correct_graded_right", "wrong_graded_right")]
        print(f"| {row['kind']} | {row['correct_per_s']:.0f} | {row['wrong_per_s']:.0f} | {right[0]} | {right[1]} |")
    mix = next(row for row in rows if "correct_thread_per_s" in row)
    print(f"| mix, from a worker thread | {mix['correct_thread_per_s']:.0f} | {mix['wrong_thread_per_s']:.0f} | | |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "seconds_per_measurement": args.seconds}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "throughput": rows, "timeouts": timeouts}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
