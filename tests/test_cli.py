"""`logra-train` as users run it: bad configs fail fast, a killed run resumes to the same metrics."""

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.runs import LOGRA_TRAIN, launch, stable, wait_for_records
from tests.runs import records as metrics


def logra_train(*args, cwd, timeout=300):
    return subprocess.run([LOGRA_TRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def logra_eval(*args, cwd, timeout=300):
    return subprocess.run(
        [str(Path(LOGRA_TRAIN).with_name("logra-eval")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["+experiment=nope"], "unknown experiment 'nope'; choose one of ['dapo_math_1p5b', 'dapo_math_1p5b_dense'"),
        (["trainer.total_stepz=3"], "unknown key 'trainer.total_stepz': trainer has ['checkpoint_every'"),
        (["logra.kl.budjet=1"], "unknown key 'logra.kl.budjet': logra.kl has ['alpha_max', 'budget'"),
        (["optimizer=adam"], "unknown optimizer 'adam'; choose one of ['dense', 'logra', 'lora']"),
        (["logra.rank=0"], "config: logra.rank=0 is invalid"),
        (["model=hf"], "model.path is required"),
        (["model=hf", "model.path=/models/any"], "would get the CPU quickstart's toy LoGRA settings"),
        (["model=hf", "model.path=/models/any", "logra=default"], "add experiment_name=NAME"),
        (["experiment=smollm2"], "picks a preset, which is added with a +: +experiment=smollm2"),
    ],
)
def test_bad_config_fails_fast_with_one_clear_line(tmp_path, args, message):
    start = time.perf_counter()
    result = logra_train(*args, cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_help_names_the_program_and_lists_the_options(tmp_path):
    result = logra_train("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("logra-train: RL post-training of LLMs with LoGRA")
    assert "optimizer: dense, logra, lora" in result.stdout and "reasoning_gym_hard_27b" in result.stdout


@pytest.mark.parametrize("cfg_first", [True, False])
def test_print_resolved_config(tmp_path, cfg_first):
    overrides = ["logra.rank=16", "experiment_name=mine"]
    args = ["--cfg", "job", *overrides] if cfg_first else [*overrides, "--cfg", "job"]
    result = logra_train(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank: 16" in result.stdout and "experiment_name: mine" in result.stdout


def test_old_keys_are_rewritten_with_one_line_each(tmp_path):
    result = logra_train("rollout=vllm", "rollout.residual=float32", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[logra-train] rollout=vllm is now rollout.backend=vllm" in result.stdout
    assert "[logra-train] rollout.residual is now sync.residual" in result.stdout
    printed = yaml.safe_load(result.stdout[result.stdout.index("experiment_name:") :])
    assert printed["rollout"]["backend"] == "vllm" and printed["sync"]["residual"] == "float32"
    assert printed["eval"]["top_p"] == 1.0 and printed["model"]["target_modules"][0] == "q_proj"


def test_a_sweep_writes_one_run_directory_per_job(tmp_path, quickstart_model):
    sweep = ["-m", "trainer.seed=1,2", "trainer.run_name=sweep", "trainer.total_steps=1", "eval.every=0"]
    common = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.prompts_per_step=8"]
    common += ["logger.progress=false"]
    result = logra_train(*sweep, *common, "logger.plot=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "outputs/quickstart").iterdir() if p.is_dir())
    assert runs == ["sweep_0", "sweep_1"]
    seeds = [yaml.safe_load((tmp_path / "outputs/quickstart" / r / "config.yaml").read_text()) for r in runs]
    assert [s["trainer"]["seed"] for s in seeds] == [1, 2]
    assert all([m["step"] for m in metrics(tmp_path / "outputs/quickstart" / r)] == [0] for r in runs)


def test_killed_run_resumes_to_the_same_metrics(tmp_path, quickstart_model):
    common = [
        "model=hf",
        f"model.path={quickstart_model}",
        "logra=quickstart",
        "trainer.prompts_per_step=16",
        "trainer.checkpoint_every=3",
        "eval.every=3",
        "logger.progress=false",
        "logger.plot=false",
    ]
    result = logra_train(*common, "trainer.total_steps=6", "trainer.run_name=straight", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    straight = metrics(tmp_path / "outputs/quickstart/straight")
    assert [r["step"] for r in straight] == list(range(7))  # 6 steps + the final eval record
    assert {"eval/quickstart/pass@1", "eval/quickstart/pass@4"} <= set(
        straight[3]
    ) and "eval/quickstart/pass@4" in straight[6]

    run_dir = tmp_path / "outputs/quickstart/killed"
    process = subprocess.Popen(
        [LOGRA_TRAIN, *common, "trainer.total_steps=1000", "trainer.run_name=killed"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not (run_dir / "checkpoints/latest").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the driver, its Ray cluster and its workers, mid-run
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (run_dir / "checkpoints/step_3/controller.json").exists()

    # relaunching it with other settings is refused before anything starts, leaving the run as it was
    saved = (run_dir / "config.yaml").read_text()
    result = logra_train(*common, "trainer.total_steps=6", "trainer.run_name=killed", "logra.rank=8", cwd=tmp_path)
    assert result.returncode != 0 and "holds a run made with other settings (logra.rank: 32 → 8)" in result.stderr
    assert (run_dir / "config.yaml").read_text() == saved

    result = logra_train(*common, "trainer.total_steps=6", "trainer.run_name=killed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(7))
    assert [stable(r) for r in resumed] == [stable(r) for r in straight]

    # logra-eval on the final checkpoint reproduces the trainer's final eval exactly, with graded samples
    checkpoint = tmp_path / "outputs/quickstart/straight/checkpoints/step_6"
    result = logra_eval(*common, f"eval.checkpoint={checkpoint}", "trainer.run_name=ev", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((tmp_path / "outputs/quickstart/ev/eval_metrics.json").read_text())
    assert evaluated == {k: v for k, v in straight[6].items() if k.startswith("eval/")}
    samples = (tmp_path / "outputs/quickstart/ev/eval/step_6.jsonl").read_text().splitlines()
    assert len(samples) == 10 * 4 and {"prompt", "response", "answer", "reward", "source"} <= set(
        json.loads(samples[0])
    )


def test_logra_eval_of_a_lora_checkpoint_reproduces_the_runs_own_eval(tmp_path, quickstart_model):
    """The export merges the run's adapters with the run's own scale (alpha / rank from its config)."""
    common = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.prompts_per_step=8"]
    common += ["logger.progress=false"]
    common += ["logger.plot=false", "optimizer=lora", "optimizer.lr=1e-2", "optimizer.lora_rank=4"]
    common += ["optimizer.lora_alpha=16"]
    steps = ["trainer.total_steps=2", "eval.every=2", "trainer.checkpoint_every=2", "trainer.run_name=lora"]
    result = logra_train(*common, *steps, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = metrics(tmp_path / "outputs/quickstart/lora")[-1]
    assert trained["step"] == 2

    checkpoint = tmp_path / "outputs/quickstart/lora/checkpoints/step_2"
    result = logra_eval(*common, f"eval.checkpoint={checkpoint}", "trainer.run_name=ev", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((tmp_path / "outputs/quickstart/ev/eval_metrics.json").read_text())
    assert evaluated == {k: v for k, v in trained.items() if k.startswith("eval/")} and evaluated

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs/quickstart/ev/export_step_2").state_dict()
    base = AutoModelForCausalLM.from_pretrained(quickstart_model).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert float((exported[key] - base[key]).abs().max()) > 0  # the adapters were merged in
    assert not any("lora" in k for k in exported)


def test_sigterm_checkpoints_the_step_reached_and_the_printed_command_finishes_the_run(tmp_path, quickstart_model):
    common = [
        "model=hf",
        f"model.path={quickstart_model}",
        "logra=quickstart",
        "trainer.prompts_per_step=16",
        "trainer.checkpoint_every=0",  # the signal's checkpoint is the only one
        "eval.every=3",
        "trainer.total_steps=8",
        "logger.progress=false",
        "logger.plot=false",
    ]
    result = logra_train(*common, "trainer.run_name=straight", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    straight = metrics(tmp_path / "outputs/quickstart/straight")

    run_dir = tmp_path / "outputs/quickstart/signalled"
    process = launch([*common, "trainer.run_name=signalled"], tmp_path)
    wait_for_records(process, run_dir, 2)
    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)  # the driver alone, as Kubernetes signals a container's first process
    _, stderr = process.communicate(timeout=120)
    assert time.perf_counter() - signalled < 30  # within SLURM's default grace
    assert process.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if "interrupted by SIGTERM at step" in line)
    step = int(line.split("at step ")[1].split(":")[0])
    assert 2 <= step < 8 and (run_dir / f"checkpoints/step_{step}/controller.json").exists()
    assert [r["step"] for r in metrics(run_dir)] == list(range(step))  # the steps run, each once

    command = shlex.split(line.split("resume with: ")[1])
    assert command[0] == "logra-train" and command[-1] == "trainer.run_name=signalled"
    result = subprocess.run([LOGRA_TRAIN, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run_dir / f'checkpoints/step_{step}'}" in result.stdout
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(9))  # 8 steps + the final eval, each once
    assert [stable(r) for r in resumed] == [stable(r) for r in straight]


def test_a_second_interrupt_exits_at_once_without_a_traceback(tmp_path, quickstart_model):
    common = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.total_steps=1000"]
    process = launch([*common, "trainer.run_name=twice", "logger.progress=false"], tmp_path)
    wait_for_records(process, tmp_path / "outputs/quickstart/twice", 1)
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT and "Traceback" not in stderr, stderr[-3000:]
    assert "SIGINT: stopping at the next safe point" in stderr


def test_a_signal_during_an_eval_stops_the_run_within_seconds(tmp_path, quickstart_model, monkeypatch):
    """The eval changes nothing a checkpoint holds, so a signal drops it: the run stops within seconds with the
    checkpoint of the step it reached, instead of after an eval that here would grade for 20 minutes (every answer
    hangs 60 s; before, the run waited for the eval to end)."""
    marker = tmp_path / "grading"
    monkeypatch.setenv("LOGRA_TEST_MARKER", str(marker))  # the reward touches it: the step-0 eval is grading
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # the reward lives in tests/
    args = [
        "model=hf",
        f"model.path={quickstart_model}",
        "logra=quickstart",
        "eval.every=1",
        "trainer.total_steps=4",
        "data.reward=tests.orchestration.slow_reward:marks_then_hangs",
        "trainer.grader_timeout_s=120",
        "trainer.run_name=eval_signal",
        "logger.progress=false",
        "logger.plot=false",
    ]
    process = launch(args, tmp_path)
    deadline = time.time() + 300
    while not marker.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), process.communicate(timeout=60)[1][-3000:]
    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert time.perf_counter() - signalled < 30, stderr[-3000:]  # one answer alone would hang 60 s
    assert process.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted by SIGTERM at step 0" in stderr
    run_dir = tmp_path / "outputs/quickstart/eval_signal"
    assert (run_dir / "checkpoints/step_0/controller.json").exists()
    assert not (run_dir / "metrics.jsonl").exists() or metrics(run_dir) == []  # no step was recorded
