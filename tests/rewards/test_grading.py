"""CompletionGrader: every response graded against its prompt's answer, and a ground truth the grader cannot use
counted each step and named once per run."""

import logging

from logra_rl.data import DataConfig, Prompt, load_task
from logra_rl.rewards import GradeResult, grade_one
from logra_rl.rewards.grading import CompletionGrader
from logra_rl.rollout import Completion


class InProcessPool:
    """RewardPool's answers without its processes."""

    def grade(self, requests):
        return [GradeResult(grade_one(r.reward, r.response, r.answer, r.metadata)) for r in requests]


class TextTokenizer:
    """Token ids are characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def completion(text: str) -> Completion:
    return Completion(prompt_ids=[0], token_ids=[ord(c) for c in text], logprobs=[0.0] * len(text), finished=True)


def test_a_bad_ground_truth_is_counted_every_step_and_warned_about_once(tmp_path, caplog):
    answers = ["4", "", "???", "8"]  # "" and "???" are nothing math-verify can grade against
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{a}"}}\n' for i, a in enumerate(answers)))
    task = load_task(DataConfig(task="files", train_files=[str(path)], answer_key="answer"))
    prompts = [Prompt(example, [0]) for example in task.train]
    grader = CompletionGrader(InProcessPool(), TextTokenizer())
    responses = [completion(r"\boxed{4}"), completion(r"\boxed{8}")]
    with caplog.at_level(logging.WARNING, logger="logra_rl.rewards.grading"):
        for _ in range(2):
            rewards, metrics = grader.grade(prompts, responses * len(prompts))
            assert rewards.tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
            assert metrics["reward/bad_ground_truths"] == 4.0  # two prompts, two responses each
        assert metrics["reward/grader_timeouts"] == metrics["reward/grader_errors"] == 0
    [warning] = caplog.messages
    assert warning.startswith(f"the 'math' reward cannot grade against the ground truth '' ({path}, record 1)")
    assert "2 of this step's 4 prompts" in warning and warning.endswith("Fix the data file")
    assert grader.grade(prompts[:1], responses[:1])[1]["reward/bad_ground_truths"] == 0.0
