"""A train worker killed mid-run: the group is rebuilt from the last checkpoint and the steps after it replayed;
the run ends with the uninterrupted run's records, each step once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

LOGRA_TRAIN = str(Path(sys.executable).parent / "logra-train")
VOLATILE = ("timing_s/", "perf/", "memory/", "fault/")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def train_workers(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for process in root.children(recursive=True):
        try:
            if process.cmdline() and process.cmdline()[0].startswith("ray::TrainWorker"):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_killed_train_worker_is_replaced_and_the_run_replayed_from_its_checkpoint(tmp_path, quickstart_model):
    common = [
        "model=hf",
        f"model.path={quickstart_model}",
        "logra=quickstart",
        "trainer.prompts_per_step=16",
        "trainer.total_steps=8",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=3",
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
    while time.time() < deadline and process.poll() is None:  # past the step-3 checkpoint
        if (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    workers = train_workers(psutil.Process(process.pid))
    assert len(workers) == 2
    os.kill(workers[1].pid, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "rebuilding the train group from" in stdout and "checkpoints/step_" in stdout

    killed = records(run_dir)
    assert [r["step"] for r in killed] == list(range(9))  # each step once: the replayed ones replaced
    assert killed[-2]["fault/train_restarts"] == 1
    assert [stable(r) for r in killed] == [stable(r) for r in straight]
