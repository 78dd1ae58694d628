"""Small local files shaped like DAPO-Math-17k (verl schema, DAPO's own instruction, every problem repeated) and
MATH-500 (problem / solution / answer / subject / level / unique_id). Tests never touch the hub."""

import json
from pathlib import Path

import datasets

DAPO_PROBLEMS = [("What is $1+1$?", "2"), (r"Compute $3 \cdot 4$.", "12"), ("Find $x$ if $2x = 10$.", "5")]
DAPO_COPIES = 3

MATH500_ROWS = [
    {
        "problem": r"What is $\frac{1}{2} + \frac{1}{4}$? Express your answer as a common fraction.",
        "solution": r"We have $\frac{1}{2} + \frac{1}{4} = \frac{2}{4} + \frac{1}{4} = \boxed{\frac{3}{4}}$.",
        "answer": r"\frac{3}{4}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
    {
        "problem": r"Simplify $\sqrt{12}$.",
        "solution": r"Since $12 = 4 \cdot 3$, $\sqrt{12} = \boxed{2\sqrt{3}}$.",
        "answer": r"2\sqrt{3}",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "test/algebra/2.json",
    },
    {
        "problem": "For which real $x$ is $x^2 < 9$? Express your answer in interval notation.",
        "solution": r"$x^2 < 9$ exactly when $|x| < 3$, so the answer is $\boxed{(-3,3)}$.",
        "answer": "(-3,3)",
        "subject": "Algebra",
        "level": 3,
        "unique_id": "test/algebra/3.json",
    },
    {
        "problem": "Evelyn runs 5 km in 20 minutes and Carla runs 5 km in 25 minutes. Who is faster?",
        "solution": r"Evelyn takes less time for the same distance, so $\boxed{\text{Evelyn}}$ is faster.",
        "answer": r"\text{Evelyn}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/4.json",
    },
]


def dapo_record(problem: str, answer: str, index: int) -> dict:
    """One DAPO-Math-17k row, with the instruction DAPO wraps around every problem."""
    content = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        f"Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"uuid-{index}"},
    }


def write_dapo(path: Path) -> str:
    """The DAPO-shaped parquet file (every problem repeated DAPO_COPIES times) at `path`."""
    rows = [dapo_record(p, a, i) for i, (p, a) in enumerate(DAPO_PROBLEMS * DAPO_COPIES)]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def write_math500(path: Path) -> str:
    """The MATH-500-shaped jsonl file at `path`."""
    path.write_text("".join(json.dumps(row) + "\n" for row in MATH500_ROWS))
    return str(path)
