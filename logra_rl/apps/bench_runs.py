"""The benchmarks' runs of `logra-train` (scripts/bench/bench_methods.py, bench_async.py): one directory per arm and
seed, OUT/runs/<arm>/seed<k>/, launched one at a time, a finished one never run again; the spread of a value over
seeds; and measurements run in a fresh interpreter (`child_result`), so that a peak of memory is theirs alone."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from logra_rl.utils.timing import timed


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / arm / f"seed{seed}"


def finished(path: Path, steps: int) -> bool:
    """The run logged the record of step `steps` (the eval after its last update) or went further."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return False
    lines = metrics.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1]).get("step", -1) >= steps


def launch(preset: str, overrides: str, steps: int, seed: int, out: Path, arm: str, checkpoint_every: int) -> None:
    """One `logra-train` run (or the rest of one), its output in OUT/runs/<arm>/seed<k>.log; its wall time,
    summed over the launches that made it, goes to bench_wall_s.json in the run directory."""
    path = run_dir(out, arm, seed)
    arm_overrides = shlex.split(overrides)
    experiment = [] if any(o.startswith("+experiment=") for o in arm_overrides) else [f"+experiment={preset}"]
    command = [
        str(Path(sys.executable).with_name("logra-train")),
        *experiment,
        *arm_overrides,
        f"trainer.total_steps={steps}",
        f"trainer.checkpoint_every={checkpoint_every}",
        f"trainer.seed={seed}",
        f"trainer.output_dir={out / 'runs'}",
        f"experiment_name={arm}",
        f"trainer.run_name=seed{seed}",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{Path(sys.argv[0]).stem}] {arm} seed {seed}: {shlex.join(command)}", flush=True)
    with open(path.parent / f"seed{seed}.log", "a") as log:
        finished, wall = timed(lambda: subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False))
    code = finished.returncode
    if code != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {code}); see {path.parent / f'seed{seed}.log'}")
    record = path / "bench_wall_s.json"
    earlier = json.loads(record.read_text())["wall_s"] if record.is_file() else 0.0
    record.write_text(json.dumps({"wall_s": earlier + wall}))


def spread(values: list[float]) -> dict[str, float | int]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


CHILD_PREFIX = "BENCH_CHILD "  # marks the line a measurement's process prints its JSON result on


def print_child_result(result: dict[str, Any]) -> None:
    """In the measurement's process: its result, where `child_result` reads it among whatever else is printed."""
    print(CHILD_PREFIX + json.dumps(result), flush=True)


def child_result(command: list[str], label: str) -> dict[str, Any]:
    """Run `command` (a script's own measurement mode) in a fresh interpreter and return the result it printed."""
    process = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in process.stdout.splitlines():
        if line.startswith(CHILD_PREFIX):
            return json.loads(line[len(CHILD_PREFIX) :])
    raise RuntimeError(f"{label} failed with exit code {process.returncode}:\n{process.stderr[-3000:]}")
