"""Where the answer is in a response (logra_rl.rewards.answers), graded end to end by the math grader.

One table per kind of answer the extraction must find, each with the near-misses that must stay 0.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from logra_rl.rewards import math_reward
from logra_rl.rewards.answers import extract_answer
from logra_rl.rewards.math import grade

# 1. Several boxes that together form the answer; a correction, a hedge or a repeat is not a list.
SEVERAL_BOXES = [
    (r"The solutions are \boxed{2} and \boxed{-3}.", "2, -3", 1.0),
    (r"The solutions are \boxed{2} and \boxed{-3}.", r"\{-3, 2\}", 1.0),
    (r"The solutions are \boxed{2} and \boxed{-3}.", "-3", 0.0),  # half the answer
    (r"\boxed{(1, 2)}, \boxed{(2, 1)}", "(1,2),(2,1)", 1.0),
    (r"\boxed{k = 4} \quad \text{and} \quad \boxed{n = 7}", "k = 4, n = 7", 1.0),
    (r"$\boxed{1}$, $\boxed{2}$, and $\boxed{3}$", "1, 2, 3", 1.0),
    (r"\[ \boxed{-2} \quad \text{and} \quad \boxed{1}. \]", "1,-2", 1.0),
    (r"\( y_1 = \boxed{2x} \) and \( y_2 = \boxed{3x} \)", "y_1 = 2x, y_2 = 3x", 1.0),  # labelled parts
    (r"\boxed{5} and again \boxed{5}", "5", 1.0),  # a repeat is one answer
    (r"\boxed{5}, \boxed{5}", "5", 1.0),
    # near-misses: a corrected answer, and two boxes that are alternatives rather than parts
    (r"\boxed{3} ... wait, no: \boxed{4}", "4", 1.0),
    (r"\boxed{3} ... wait, no: \boxed{4}", "3", 0.0),
    (r"\boxed{3} ... wait, no: \boxed{4}", "3, 4", 0.0),
    (r"It is \boxed{3}, not \boxed{2}", "3", 0.0),
    (r"It is either \boxed{2} or \boxed{3}.", "2, 3", 0.0),
    (r"First \boxed{2}, on reflection \boxed{3}", "3", 1.0),
]

# 2. No box: the answer is the last piece of inline or display maths, taken whole.
INLINE_MATH = [
    (r"Therefore $x \geq 5$ is the solution.", r"x \geq 5", 1.0),
    (r"Therefore $x \geq 5$ is the solution.", "5", 0.0),
    (r"We find that $x < 3$.", "x < 3", 1.0),
    (r"We find that $x < 3$.", "3", 0.0),
    (r"The result is $\begin{pmatrix}1 & 0\\0 & 1\end{pmatrix}$.", r"\begin{pmatrix}1 & 0\\0 & 1\end{pmatrix}", 1.0),
    (r"... so the pair is $(4, 9)$.", "(4, 9)", 1.0),
    (r"... so the pair is $(4, 9)$.", "9", 0.0),
    (r"The identity is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.", r"\begin{pmatrix}1&0\\0&1\end{pmatrix}", 1.0),
    (r"so the value is \(\frac{1}{3}.\)", r"\frac{1}{3}", 1.0),
    (r"$1, 2, 3, ...$", "1, 2, 3", 0.0),  # an ellipsis is not a full stop
    ("It costs $5 and the other $10, so 15 in all", "15", 1.0),  # dollar signs are not math delimiters
    ("Let $n$ be the number of apples. Then we get 7", "7", 1.0),  # a number after the last span
    ("The sum:\nx^2 + 2x + 1", "(x+1)^2", 1.0),  # a last line that is all maths
]

# 3. An "answer is" phrase ends where its maths ends.
ANSWER_PHRASE = [
    ("The answer is 42 because 6 times 7 is 42.", "42", 1.0),
    ("The answer is 42 and we are done.", "42", 1.0),
    ("The answer is 41 because 6 times 7 is 42.", "42", 0.0),
    ("The answer is 42, which is even.", "42", 1.0),
    ("Thus the area is 12 square units.", "12", 1.0),
    ("Therefore, the sum is 10 and the product 21", "10", 1.0),
    ("The answer is 2, 3, and 5.", "2, 3, 5", 1.0),
    ("The answer is x = 2 when y = 1.", "2", 1.0),
    ("The answer is 4 4/9.", r"\frac{40}{9}", 1.0),  # a mixed number
    ("Thus the winner is Evelyn.", "Evelyn", 1.0),  # words when there is no maths
    ("Answer: A KING IS HE", "A KING IS HE", 1.0),  # a text answer written out whole
    ("Answer: B → B → A", "B → B → A", 1.0),
    ("Final Answer: Jane started 3 hours ago.", "3", 1.0),
    ("The answer is actually 4.", "4", 1.0),
    ("So the answer must be 7 apples.", "7", 1.0),
    ("The answers are 2 and 3.", "2, 3", 1.0),
    ("Thus, 5 is the answer.", "5", 1.0),  # the maths before the verb
    ("Therefore, 42 is the final answer.", "42", 1.0),
    ("The ratio is 3:4.", "3:4", 1.0),
    # a closing remark after the answer does not replace it
    ("The answer is 5. Thus the problem is solved.", "5", 1.0),
    ("Answer: 42\n\nTherefore, this is the correct answer.", "42", 1.0),
    ("Answer: 5.\nThus, it is clear that 4 was wrong.", "5", 1.0),
    ("The answer is 5. Note that the answer is not 4.", "5", 1.0),
    ("The answer is 5. Note that the answer is not 4.", "4", 0.0),
    ("The total is 12. Thus we are done.", "12", 1.0),
    ("The answer is 42. Let me double check the answer: 42/6 = 7 and 7*6 = 42.", "42", 1.0),
    # the verb is never an `=` inside the maths
    ("Therefore $x^2 = 9$, so $x = 3$.", "3", 1.0),
    ("Therefore $x^2 = 9$, so $x = 3$.", "9", 0.0),
    ("Thus, since $3 \\times 4 = 12$, the total is $12 + 5 = 17$.", "17", 1.0),
    ("Thus $x = 3$ and $y = -2$.", "x = 3, y = -2", 1.0),  # spans joined like boxes
    # inequalities, absolute values and dollar signs inside the phrase
    ("The answer is $x < 3$.", "x < 3", 1.0),
    ("Answer: x < 2", "x < 2", 1.0),
    ("Answer: $-1 < x < 2$", "(-1, 2)", 1.0),
    ("The answer is $|-7| = 7$.", "7", 1.0),
    ("The answer is $\\$18$.", "18", 1.0),
    ("The answer is $18 + $2 = $20.", "20", 1.0),
]

# 4. A statement of the final answer after the last box wins; an intermediate box alone does not.
FINAL_STATEMENT = [
    (r"... so \boxed{12} apples per crate. The final answer is $60$.", "60", 1.0),
    (r"... so \boxed{12} apples per crate. The final answer is $60$.", "12", 0.0),
    ("Each crate holds \\boxed{12}.\nAnswer: 60", "60", 1.0),
    (r"... so \boxed{12} apples per crate. So all five crates hold 60.", "60", 0.0),  # no final statement
    (r"$17^{-1} \equiv \boxed{44}$. We may check our answer: $17 \cdot 44 = 748$.", "44", 1.0),  # not a statement
    (r"\boxed{44}. This answer is correct.", "44", 1.0),
    ("\\boxed{5}\n\nWait, I double counted. The answer is actually 4.", "4", 1.0),
    ("\\boxed{5}\n\n...so the final answer should be 4.", "4", 1.0),
    ("\\boxed{12}\n\nTo check the final answer: 12 / 3 = 4.", "12", 1.0),  # a check is no statement
    (r"\boxed{44}. To verify the final answer: $17 \cdot 44 = 748$", "44", 1.0),
]

# 5. Reasoning models: the thinking earns nothing.
THINKING = [
    (r"<think>Maybe \boxed{5}.</think> The answer is \boxed{6}.", "6", 1.0),
    (r"<think>Maybe \boxed{5}.</think> The answer is \boxed{6}.", "5", 0.0),
    (r"<think>It is \boxed{5}</think> I am not sure.", "5", 0.0),  # a box inside the thinking
    (r"<think>The answer is \boxed{5}", "5", 0.0),  # the thinking never closes: no answer
    ("the template opened the thinking...</think>\n\nThe answer is 5.", "5", 1.0),
    (r"<think>a</think><think>b \boxed{1}</think> \boxed{2}", "2", 1.0),
    (r"\boxed{7}<|im_end|>", "7", 1.0),
]

# 6. Set relations: an inequality, a membership and an interval are one answer.
SET_RELATIONS = [
    (r"\boxed{-2 \le x \le 7}", r"x \in [-2, 7]", 1.0),
    (r"\boxed{x \in [-2, 7]}", r"-2 \le x \le 7", 1.0),
    (r"\boxed{[-2, 7]}", r"-2 \leq x \leq 7", 1.0),
    (r"\boxed{-2 < x \le 7}", r"x \in (-2, 7]", 1.0),
    (r"\boxed{7 \geq x > -2}", r"(-2, 7]", 1.0),
    (r"\boxed{x \ge 5}", r"[5, \infty)", 1.0),
    (r"\boxed{-x > -1}", "x < 1", 1.0),
    (r"\boxed{x < -1 \text{ or } x > 2}", r"(-\infty, -1) \cup (2, \infty)", 1.0),
    (r"\boxed{-2 < x \le 7}", r"x \in [-2, 7]", 0.0),  # one endpoint differs
    (r"\boxed{y \in [-2, 7]}", r"-2 \le x \le 7", 0.0),  # another variable
    (r"\boxed{x > 5}", r"[5, \infty)", 0.0),
]

# Where a peer grader differs and ours is right for a correctness reward: kept.
KEPT = [
    (r"\boxed{1,000}", "1000", 1.0),  # a comma groups thousands in English data
    ("The total is 1,234 apples", "1234", 1.0),
    ("So there are 1 000 of them", "1000", 1.0),
    (r"\boxed{f(y)}", "f(x)", 0.0),
    ("So:\n$42$", "42", 1.0),  # an answer on a line of its own inside $...$
    (r"\boxed{2.6667}", "8/3", 0.0),  # no lenient rounding
    (r"\boxed{1 + \frac{1}{\mathrm{e}}}", r"1 - \frac{1}{\mathrm{e}}", 0.0),  # math-verify alone says 1
    ("The code is AZYUK2A", "2", 0.0),  # a digit inside a word is no number
    ("so we end at .5", "0.5", 1.0),
    (r"\boxed{11 7/6}", r"\frac{73}{6}", 0.0),  # not a mixed number
    (r"\boxed{918\frac{1}{2}}", "918.5", 1.0),
]


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    SEVERAL_BOXES + INLINE_MATH + ANSWER_PHRASE + FINAL_STATEMENT + THINKING + SET_RELATIONS + KEPT,
)
def test_grade(response, answer, expected):
    assert grade(response, answer) == expected
    assert math_reward(response, answer, {}) == expected


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"x \boxed{\frac{1}{2}} then \boxed{3}", "3"),
        (r"\fbox{7} and \fbox{8}", "7, 8"),
        (r"\boxed{8}, not \fbox{7}", "8"),  # a box beats an fbox
        (r"The answer is 4, so \boxed{\frac{1}{2}", "4"),  # an unclosed last box is no box
        (r"\boxed{2}, so then \boxed{\frac{1}{2}", r"\frac{1}{2}"),  # an earlier box does not stand in for it
        ("The final answer is: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("Answer: 34\n\nSome trailing text without numbers", "34"),
        ("Therefore, the sum is 10 and the product 21", "10"),
        ("I thought the answer is 41. Rechecking, the answer is 42", "42"),
        ("answer | 5", "5"),  # no phrase ("|" ends it): the last number
        ("There are 3 cats and -4.5 dogs", "-4.5"),
        (r"Let $x$ be it. Then $x = 7$.", "x = 7"),
        ("no digits", None),
        ("", None),
        ("<think>unfinished", None),
    ],
)
def test_extraction_order(response, answer):
    assert extract_answer(response) == answer


def test_the_thinking_can_be_graded_too():
    response = r"<think>It is \boxed{5}"
    assert extract_answer(response, grade_thinking=True) == "5"
    assert grade(response, "5", grade_thinking=True) == 1.0
    assert grade(response, "5") == 0.0
    assert math_reward(response, "5", {"grade_thinking": True}) == 1.0
    assert math_reward(response, "5", {}) == 0.0


def test_long_responses_without_closing_delimiters_grade_within_the_time_limit():
    # Many openers with no closer: each span search must stop at the next delimiter, not rescan the text.
    for opener in ("$", "\\(", "\\[", "$$", "\\boxed{"):
        response = ("We have " + opener + " 5 and ") * 3000 + "so the answer is 7"
        assert grade(response, "7", timeout_s=2.0) == 1.0
        assert grade(("We have " + opener + " 5 and ") * 3000 + "7", "7", timeout_s=2.0) == 1.0  # the last maths


def test_a_runaway_answer_is_no_answer():
    # Degenerate outputs would only cost math-verify its whole time limit: no answer is that long.
    for response in ("1 " * 2500, "The answer is " + "(" * 3000, rf"\boxed{{{'x+' * 600}x}}"):
        assert extract_answer(response) is None
        assert grade(response, "1", timeout_s=2.0) == 0.0
    assert extract_answer(rf"\boxed{{{'x+' * 400}x}}") is not None  # long, but within MAX_ANSWER_CHARS


def test_the_thinking_rule_reaches_the_grading_subprocess():
    # Off the main thread the item is graded in a subprocess: the rule must travel with it.
    response = r"<think>It is \boxed{5}"
    with ThreadPoolExecutor(max_workers=1) as thread:
        verdicts = [thread.submit(grade, response, "5", 5.0, flag).result() for flag in (False, True)]
    assert verdicts == [0.0, 1.0]
