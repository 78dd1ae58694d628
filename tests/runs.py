"""Running `logra-train` from a test and reading what it wrote: launch, wait for records, find its Ray actors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

LOGRA_TRAIN = str(Path(sys.executable).parent / "logra-train")
VOLATILE = ("timing_s/", "perf/", "memory/", "fault/")  # wall-clock, process sizes and fault counts


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(record: dict, volatile: tuple[str, ...] = VOLATILE) -> dict:
    """A record without the keys that differ between two runs of the same job."""
    return {k: v for k, v in record.items() if not k.startswith(volatile)}


def launch(args: list[str], cwd: Path) -> subprocess.Popen:
    """`logra-train args` in the background, in its own session, its output captured."""
    return subprocess.Popen(
        [LOGRA_TRAIN, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_records(process: subprocess.Popen, run_dir: Path, count: int, timeout_s: float = 300) -> None:
    """Until the run has written `count` records (or ended, or the time is up)."""
    path, deadline = run_dir / "metrics.jsonl", time.time() + timeout_s
    while time.time() < deadline and process.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)


def actor_processes(process: subprocess.Popen, actor: str) -> list[psutil.Process]:
    """The processes of the run's Ray actors of class `actor` (Ray titles them `ray::Class.method`)."""
    found = []
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.cmdline() and child.cmdline()[0].startswith(f"ray::{actor}"):
                found.append(child)
        except psutil.Error:
            continue
    return found


def short_job(model_path: str, checkpoint_every: int) -> list[str]:
    """Overrides of an 8-step quickstart-model run with evals at steps 0, 4 and 8: a minute on 2 cores."""
    return [
        "model=hf",
        f"model.path={model_path}",
        "logra=quickstart",
        "trainer.prompts_per_step=16",
        "trainer.total_steps=8",
        "eval.every=4",
        f"trainer.checkpoint_every={checkpoint_every}",
        "logger.progress=false",
        "logger.plot=false",
    ]


def run_to_the_end(args: list[str], cwd: Path, name: str) -> list[dict]:
    """Run `logra-train args` as `trainer.run_name=name` to its end; its records."""
    result = subprocess.run(
        [LOGRA_TRAIN, *args, f"trainer.run_name={name}"], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return records(cwd / "outputs/quickstart" / name)
