"""`logra-train` as users run it: bad configs fail fast, a killed run resumes to the same metrics."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.runs import LOGRA_TRAIN, launch, short_job, stable, wait_for_records
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


def test_killed_run_resumes_to_the_same_metrics(tmp_path, quickstart_model, uninterrupted):
    common = short_job(quickstart_model, checkpoint_every=3)
    assert [r["step"] for r in uninterrupted] == list(range(9))  # 8 steps + the final eval record
    assert {"eval/quickstart/pass@1", "eval/quickstart/pass@4"} <= set(uninterrupted[4])
    assert "eval/quickstart/pass@4" in uninterrupted[8]

    run_dir = tmp_path / "outputs/quickstart/killed"
    longer = [argument for argument in common if not argument.startswith("trainer.total_steps=")]
    process = subprocess.Popen(
        [LOGRA_TRAIN, *longer, "trainer.total_steps=1000", "trainer.run_name=killed"],
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
    result = logra_train(*common, "trainer.run_name=killed", "logra.rank=8", cwd=tmp_path)
    assert result.returncode != 0 and "holds a run made with other settings (logra.rank: 32 → 8)" in result.stderr
    assert (run_dir / "config.yaml").read_text() == saved

    # resumed with checkpoints every 4 steps (a resume may change the cadence): one at the end, step_8
    result = logra_train(*common, "trainer.checkpoint_every=4", "trainer.run_name=killed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(9))
    assert [stable(r) for r in resumed] == [stable(r) for r in uninterrupted]

    # logra-eval on the final checkpoint reproduces the trainer's final eval exactly, with graded samples
    checkpoint = run_dir / "checkpoints/step_8"
    result = logra_eval(*common, f"eval.checkpoint={checkpoint}", "trainer.run_name=ev", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((tmp_path / "outputs/quickstart/ev/eval_metrics.json").read_text())
    assert evaluated == {k: v for k, v in uninterrupted[8].items() if k.startswith("eval/")}
    samples = (tmp_path / "outputs/quickstart/ev/eval/step_8.jsonl").read_text().splitlines()
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


def stop_with_sigterm(process: subprocess.Popen, run_dir: Path, records: int, whole_group: bool) -> tuple[int, str]:
    """SIGTERM once the run has `records` records: to its whole process group (SLURM, `timeout`) or to the driver
    alone (docker stop, Kubernetes); checks the stop (within SLURM's 30 s grace, status 0, no traceback, the
    checkpoint of the step reached, each step recorded once); returns that step and the printed resume command."""
    wait_for_records(process, run_dir, records)
    signalled = time.perf_counter()
    if whole_group:
        os.killpg(process.pid, signal.SIGTERM)  # every process the run started: Ray's and the graders' too
    else:
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert time.perf_counter() - signalled < 30, stderr[-3000:]
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if "interrupted by SIGTERM at step" in line)
    step = int(line.split("at step ")[1].split(":")[0])
    assert (run_dir / f"checkpoints/step_{step}/controller.json").exists()
    assert [r["step"] for r in metrics(run_dir)] == list(range(step))  # the steps run, each once
    return step, line.split("resume with: ")[1]


def test_sigterm_to_the_driver_or_the_whole_job_checkpoints_the_step_reached_and_the_run_resumes_exactly(
    tmp_path, quickstart_model, uninterrupted
):
    """Stopped twice (its whole process group, then its driver alone) and resumed each time with the command it
    printed, the run's records are an uninterrupted run's; a copy whose every checkpoint is damaged is refused
    without a byte changed."""
    common = short_job(quickstart_model, checkpoint_every=0)  # the signals' checkpoints are the only ones
    run_dir = tmp_path / "outputs/quickstart/signalled"
    process = launch([*common, "trainer.run_name=signalled"], tmp_path)
    first_stop, command = stop_with_sigterm(process, run_dir, 2, whole_group=True)
    assert 2 <= first_stop < 6

    command = shlex.split(command)
    assert command[0] == "logra-train" and command[-1] == "trainer.run_name=signalled"
    process = launch(command[1:], tmp_path)
    second_stop, _ = stop_with_sigterm(process, run_dir, first_stop + 1, whole_group=False)
    assert first_stop < second_stop < 8
    result = subprocess.run([LOGRA_TRAIN, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run_dir / f'checkpoints/step_{second_stop}'}" in result.stdout
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(9))  # 8 steps + the final eval, each once
    assert [stable(r) for r in resumed] == [stable(r) for r in uninterrupted]

    damaged = tmp_path / "outputs/quickstart/damaged"
    shutil.copytree(run_dir, damaged)
    for shard in (damaged / "checkpoints").glob("step_*/model/*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    before = tree_bytes(damaged)
    started = time.perf_counter()
    result = logra_train(*common, "trainer.run_name=damaged", cwd=tmp_path)
    assert result.returncode != 0 and time.perf_counter() - started < 15 and "Traceback" not in result.stderr
    assert "holds a run that cannot be resumed" in result.stderr and "trainer.resume=never" in result.stderr
    assert "is damaged (model/__0_0.distcp is 100 of" in result.stderr
    assert tree_bytes(damaged) == before  # nothing was changed


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_a_second_run_under_the_same_name_is_refused_and_a_second_interrupt_exits_at_once(tmp_path, quickstart_model):
    """A job resubmitted while it runs is refused in seconds, naming the run that holds the directory, which runs
    on (each step recorded once); then Ctrl-C twice exits at once without a traceback."""
    common = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.total_steps=1000"]
    run_dir = tmp_path / "outputs/quickstart/twice"
    process = launch([*common, "trainer.run_name=twice", "logger.progress=false"], tmp_path)
    wait_for_records(process, run_dir, 1)
    started = time.perf_counter()
    second = logra_train(*common, "trainer.run_name=twice", cwd=tmp_path)
    assert time.perf_counter() - started < 30 and second.returncode != 0  # 6 s on an idle machine
    assert f"is in use by another run (pid {process.pid} on" in second.stderr and "Traceback" not in second.stderr
    assert process.poll() is None  # the first runs on
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(len(steps))) and len(steps) >= 1  # each step once, in order
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr and "SIGINT: stopping at the next safe point" in stderr, stderr[-3000:]
    assert process.returncode == 128 + signal.SIGINT  # Ctrl-C keeps the shell's status (a loop of runs stops)


def test_a_signal_during_an_eval_stops_the_run_within_seconds(tmp_path, quickstart_model, monkeypatch):
    """The eval changes nothing a checkpoint holds, so a signal drops it: the run stops within seconds with the
    checkpoint of the step it reached, instead of after an eval that here would grade for 20 minutes (every answer
    hangs 60 s; before, the run waited for the eval to end)."""
    marker = tmp_path / "grading"
    monkeypatch.setenv("LOGRA_TEST_MARKER", str(marker))  # the reward touches it: the step-0 eval is grading
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # the reward lives in tests/
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
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted by SIGTERM at step 0" in stderr
    run_dir = tmp_path / "outputs/quickstart/eval_signal"
    assert (run_dir / "checkpoints/step_0/controller.json").exists()
    assert not (run_dir / "metrics.jsonl").exists() or metrics(run_dir) == []  # no step was recorded


FILL_THE_DISK = """
set -u
disk="$1"; shift
mount -t tmpfs -o size=2m tmpfs "$disk"
cd "$disk"
for size in 2m 7m 64m; do
    mount -o remount,size=$size "$disk"
    "$@" > "$OUT/stdout_$size" 2> "$OUT/stderr_$size"
    echo $? > "$OUT/status_$size"
    (cd "$disk" && find . | sort) > "$OUT/files_$size"
done
"""


def test_a_disk_that_fills_while_writing_the_base_model_or_a_checkpoint_keeps_nothing_partial(tmp_path):
    """On a 2 MiB disk the quickstart's base model (3.9 MiB) cannot be written, on 7 MiB its first checkpoint
    (4 MiB) cannot: each is one line, and leaves no partial model or checkpoint that a later run would trust; on
    64 MiB the same command runs. A tmpfs in a private mount namespace (`unshare`), so nothing outside sees it."""
    unshare = shutil.which("unshare")
    assert unshare, "util-linux's unshare is needed to mount a small tmpfs for this test"
    namespace = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-rm"]
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [
        LOGRA_TRAIN,
        "trainer.run_name=full",
        "model.quickstart_format_steps=10",  # the write, not the pre-training, is under test
        "trainer.total_steps=2",
        "trainer.checkpoint_every=1",
        "eval.every=0",
        "logger.progress=false",
        "logger.plot=false",
    ]
    env = {**os.environ, "OUT": str(tmp_path)}
    result = subprocess.run(
        [*namespace, "bash", "-c", FILL_THE_DISK, "fill", str(disk), *command], env=env, timeout=900, text=True
    )
    assert result.returncode == 0
    run = "./outputs/quickstart/full"
    for size in ("2m", "7m"):
        stderr = (tmp_path / f"stderr_{size}").read_text()
        assert (tmp_path / f"status_{size}").read_text().strip() != "0"
        assert "no space left on the device" in stderr and "Traceback" not in stderr, stderr[-3000:]
        assert stderr.strip().splitlines()[-1].startswith("logra-train: no space left on the device")
    files = {size: (tmp_path / f"files_{size}").read_text().split() for size in ("2m", "7m", "64m")}
    assert not any("base_model" in name or ".tmp" in name for name in files["2m"])  # no half-written model
    assert f"{run}/base_model/model.safetensors" in files["7m"]  # written whole on the larger disk
    assert not any("/checkpoints/" in name for name in files["7m"])  # no partial checkpoint, no `latest`
    assert (tmp_path / "status_64m").read_text().strip() == "0", (tmp_path / "stderr_64m").read_text()[-3000:]
    assert f"{run}/checkpoints/step_2/controller.json" in files["64m"]


STOPPED_EARLY = """
import sys
from logra_rl.apps.cli import {main}
sys.argv = ["{program}", *sys.argv[1:]]
try:
    {main}()
except SystemExit as stop:
    print(stop, file=sys.stderr)
print(sorted(name for name in ("transformers", "ray", "vllm") if name in sys.modules))
"""


@pytest.mark.parametrize(("program", "main"), [("logra-train", "main"), ("logra-eval", "eval_main")])
def test_a_bad_setting_stops_the_command_before_transformers_or_ray_is_imported(tmp_path, program, main):
    """The settings are checked before the seconds of imports a run needs: a typo costs the time to import torch."""
    code = STOPPED_EARLY.format(main=main, program=program)
    result = subprocess.run(
        [sys.executable, "-c", code, "trainer.total_steps=-1"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "trainer.total_steps=-1 is invalid" in result.stderr, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_stop_in_one_line_before_ray_and_leave_nothing_behind(tmp_path, quickstart_model):
    """Each is found before Ray or a worker starts: one line naming the problem and the fix, no traceback, no run
    directory left behind, in seconds (two at a time: each is a process of its own)."""
    cut_short = tmp_path / "cut_short"
    shutil.copytree(quickstart_model, cut_short)
    weights = cut_short / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (tmp_path / "empty.jsonl").write_text("")
    model = ["model=hf", "logra=quickstart"]
    files = [*model, f"model.path={quickstart_model}", "data=files"]
    cases = {
        "no experiment": (["+experiment=nope"], "unknown experiment 'nope'; choose one of ['dapo_math_1p5b', "),
        "misspelt key": (["trainer.total_stepz=3"], "unknown key 'trainer.total_stepz': trainer has ['checkpoint_"),
        "misspelt nested key": (["logra.kl.budjet=1"], "unknown key 'logra.kl.budjet': logra.kl has ['alpha_max', "),
        "no option": (["optimizer=adam"], "unknown optimizer 'adam'; choose one of ['dense', 'logra', 'lora']"),
        "out of range": (["logra.rank=0"], "config: logra.rank=0 is invalid"),
        "not an integer": (["trainer.seed=abc"], "trainer.seed='abc' is invalid; give an integer"),
        "required key": (["model=hf"], "model.path is required"),
        "toy settings": (["model=hf", "model.path=/models/any"], "would get the CPU quickstart's toy LoGRA settings"),
        "unnamed run": (["model=hf", "model.path=/models/any", "logra=default"], "add experiment_name=NAME"),
        "preset without +": (["experiment=smollm2"], "picks a preset, which is added with a +: +experiment=smollm2"),
        "no output dir": (["trainer.output_dir=/proc/nope"], "cannot make the run directory under trainer.output_dir"),
        "weights cut short": ([*model, f"model.path={cut_short}"], "model.safetensors is cut short ("),
        "no model": ([*model, f"model.path={tmp_path / 'nowhere'}"], "nowhere: no such directory; set model.path"),
        "no data file": ([*files, f"data.train_files=[{tmp_path / 'gone.jsonl'}]"], "gone.jsonl does not exist"),
        "empty data file": ([*files, f"data.train_files=[{tmp_path / 'empty.jsonl'}]"], "empty.jsonl has no records"),
    }

    def run(name: str) -> tuple[subprocess.CompletedProcess, float, Path]:
        cwd = tmp_path / name.replace(" ", "_")
        cwd.mkdir()
        started = time.perf_counter()
        return logra_train(*cases[name][0], cwd=cwd), time.perf_counter() - started, cwd

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(run, cases), strict=True))
    for name, (result, seconds, cwd) in results.items():
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and "Traceback" not in result.stderr, (name, result.stderr[-3000:])
        assert lines[-1].startswith("logra-train: ") and cases[name][1] in lines[-1], (name, result.stderr[-3000:])
        assert "Started a local Ray" not in result.stderr + result.stdout and seconds < 15, (name, seconds)
        assert list(cwd.iterdir()) == [], name  # no run directory, no `outputs/`
