"""The paper's workloads end to end on a tiny model: DAPO-Math / MATH-500-shaped local files and the hard
Reasoning-Gym mixture, through `logra-train` and `logra-eval`, with the metrics written."""

import json
import subprocess
import sys
from pathlib import Path

from logra_rl.data.reasoning_gym_task import HARD_MIXTURE
from tests.data.math_files import MATH500_ROWS, write_dapo, write_math500

BIN = Path(sys.executable).parent
COMMON = [
    "model=hf",
    "logra=quickstart",  # a tiny model: the toy settings on purpose
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "eval.every=1",
    "trainer.checkpoint_every=2",
    "eval.samples=2",
    "data.max_response_length=8",
    "data.max_prompt_length=2048",
    "logger.progress=false",
    "logger.plot=false",
]


def run(program, args, cwd):
    result = subprocess.run([str(BIN / program), *args], cwd=cwd, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def math_files(directory: Path) -> tuple[str, str]:
    return write_dapo(directory / "dapo-math-17k.parquet"), write_math500(directory / "math500.jsonl")


def test_math_workload_through_train_and_eval(tmp_path, text_model):
    dapo, math500 = math_files(tmp_path)
    data = ["data=math", f"data.train_files=[{dapo}]", f"data.val_files=[{math500}]"]
    run("logra-train", [*COMMON, *data, f"model.path={text_model}", "trainer.run_name=math"], tmp_path)
    run_dir = tmp_path / "outputs/quickstart/math"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("eval/math/pass@1" in r and "eval/math/pass@2" in r for r in records)
    assert all(0 <= r["reward/mean"] <= 1 for r in records[:2])
    samples = [json.loads(line) for line in (run_dir / "eval/step_2.jsonl").read_text().splitlines()]
    assert len(samples) == len(MATH500_ROWS) * 2 and {s["source"] for s in samples} == {"math500"}

    checkpoint = run_dir / "checkpoints/step_2"
    run(
        "logra-eval",
        [*COMMON, *data, f"model.path={text_model}", f"eval.checkpoint={checkpoint}", "trainer.run_name=ev"],
        tmp_path,
    )
    evaluated = json.loads((tmp_path / "outputs/quickstart/ev/eval_metrics.json").read_text())
    assert evaluated == {k: v for k, v in records[2].items() if k.startswith("eval/")}  # the trainer's own numbers


def test_hard_reasoning_gym_mixture_through_train_and_eval(tmp_path, text_model):
    data = ["data=reasoning_gym", "data.reasoning_gym.datasets=hard", "data.train_size=16", "data.eval_size=8"]
    run("logra-train", [*COMMON, *data, f"model.path={text_model}", "trainer.run_name=rg"], tmp_path)
    records = [json.loads(line) for line in (tmp_path / "outputs/quickstart/rg/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/reasoning_gym/pass@1" in records[2]
    sources = {key.split("/")[2] for key in records[2] if key.count("/") == 3}  # per-source breakdown
    assert len(sources) >= 2 and sources <= set(HARD_MIXTURE)
    run("logra-eval", [*COMMON, *data, f"model.path={text_model}", "trainer.run_name=rg_eval"], tmp_path)
    evaluated = json.loads((tmp_path / "outputs/quickstart/rg_eval/eval_metrics.json").read_text())
    assert 0 <= evaluated["eval/reasoning_gym/pass@1"] <= evaluated["eval/reasoning_gym/pass@2"] <= 1
