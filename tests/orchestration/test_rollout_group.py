"""A rollout engine killed mid-run is restarted in its bundle, resynced and asked again: the run ends with the
uninterrupted run's samples and rewards, and says it happened."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

LOGRA_TRAIN = str(Path(sys.executable).parent / "logra-train")
VOLATILE = ("timing_s/", "perf/", "memory/", "fault/", "sync/")  # process sizes, times, and the resync it took


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def engine_processes(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for process in root.children(recursive=True):
        try:
            if process.cmdline() and process.cmdline()[0].startswith("ray::HFEngine"):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_killed_engine_changes_no_sampled_token(tmp_path, quickstart_model):
    common = [
        "model=hf",
        f"model.path={quickstart_model}",
        "logra=quickstart",
        "trainer.prompts_per_step=16",
        "trainer.total_steps=8",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=0",
        "logger.progress=false",
        "logger.plot=false",
    ]
    result = subprocess.run(
        [LOGRA_TRAIN, *common, "trainer.run_name=straight"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    straight = records(tmp_path / "outputs/quickstart/straight")

    run_dir = tmp_path / "outputs/quickstart/killed"
    process = subprocess.Popen(
        [LOGRA_TRAIN, *common, "trainer.run_name=killed"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    [engine] = engine_processes(psutil.Process(process.pid))
    os.kill(engine.pid, signal.SIGKILL)  # as the kernel's OOM killer would
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "restarted in its bundle, resyncing and asking again" in stdout

    killed = records(run_dir)
    assert [r["step"] for r in killed] == list(range(9))
    assert killed[-2]["fault/engine_restarts"] == 1 and straight[-2]["fault/engine_restarts"] == 0
    stable = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in killed]
    assert stable == [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in straight]
    assert all(r["sync/weight_max_abs_diff"] == 0.0 for r in killed[:-1])  # the new engine holds bf16(master)


def test_past_max_restarts_a_lost_engine_stops_the_run_with_one_line(tmp_path, quickstart_model):
    args = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.total_steps=1000"]
    args += ["rollout.max_restarts=0", "trainer.run_name=fragile", "logger.progress=false", "logger.plot=false"]
    process = subprocess.Popen(
        [LOGRA_TRAIN, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics_file = tmp_path / "outputs/quickstart/fragile/metrics.jsonl"
    deadline = time.time() + 300
    while not metrics_file.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    [engine] = engine_processes(psutil.Process(process.pid))
    os.kill(engine.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("logra-train: EngineFailure: rollout engine lost after 0 restarts (rollout.max_restarts=0)")
    assert "engine 0: ActorDiedError" in last
