"""The payload's route, measured: the driver's private memory and the sync seconds of LoGRA steps whose payload
is large (Qwen2.5-1.5B's widths at rank 256; docs/benchmarks.md, "The payload's route").

    .venv/bin/python -m logra_rl.models.shapes qwen2.5-1.5b DIR --weights [--layers 16]
    .venv/bin/python scripts/bench/bench_payload_route.py --shape DIR [--steps 3] [--label after]
    .venv/bin/python scripts/bench/bench_payload_route.py --shape DIR --label before --checkout OLD  # a worktree

Runs `logra-train` on the shape (2 FSDP2 ranks, one HF engine) and samples every process's private memory
(RssAnon) every 50 ms (`logra_rl.utils.memory.run_measured`). The driver is the command's own process; its peak
during the steps (after `timing_s/startup`) above its level when the first step began is what the payloads add to
it. `--checkout` runs `logra-train` from another checkout of the project (a `git worktree` of an older commit,
through PYTHONPATH, with the config keys it had before issue 27). Prints a table of every label in the JSON
file and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from logra_rl.utils.memory import GIB, run_measured

OVERRIDES = [
    "model=hf",
    "data=reasoning_gym",
    "logra=default",
    "logra.rank=256",
    "experiment_name=payload_route",
    "trainer.prompts_per_step=4",
    "data.max_response_length=16",
    "trainer.checkpoint_every=0",
    "logger.progress=false",
    "logger.plot=false",
    "cluster.memory_check=false",
]


def measure(shape: Path, steps: int, work: Path, checkout: Path | None) -> dict:
    old_keys = checkout is not None
    if checkout is not None:  # the run's processes import the package from there (Ray's workers inherit it)
        os.environ["PYTHONPATH"] = str(checkout.resolve())
    command = [
        str(Path(sys.executable).with_name("logra-train")),
        *OVERRIDES,
        "trainer.eval_every=0" if old_keys else "eval.every=0",
        f"model.path={shape}",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={work}",
    ]
    work.mkdir(parents=True, exist_ok=True)
    measured = run_measured(command, work / "run.log")
    driver = next(iter(measured.samples))  # the command's own process: sampled first
    metrics = max(work.rglob("metrics.jsonl"), key=lambda p: p.stat().st_mtime)  # this run's
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    startup = rows[0]["timing_s/startup"]
    before = [v for t, v in measured.samples[driver] if t <= startup]
    during = [v for t, v in measured.samples[driver] if t > startup]
    return {
        "driver_at_first_step_gib": before[-1] / GIB,
        "driver_peak_in_steps_gib": max(during) / GIB,
        "driver_rise_in_steps_gib": (max(during) - before[-1]) / GIB,
        "sync_s": [r["timing_s/sync"] for r in rows],
        "step_s": [r["timing_s/step"] for r in rows],
        "payload_bytes": [r["sync/payload_bytes"] for r in rows],
        "by_label": measured.peaks_by_label(),
        "wall_s": measured.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=Path, required=True, help="a shape directory written with --weights")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--label", default="run", help="the result's name in --out (before / after)")
    parser.add_argument("--checkout", type=Path, help="run logra-train from this (older) checkout of the project")
    parser.add_argument("--out", type=Path, default=Path("bench_results/payload_route.json"))
    args = parser.parse_args()
    work = Path("bench_results/payload_route_runs").resolve() / args.label
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = measure(args.shape, args.steps, work, args.checkout)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    table = Table(title="LoGRA steps with a large payload: the driver's private memory and the sync")
    for column in ("label", "payload MB", "driver at step 0 GiB", "driver peak in steps GiB", "rise GiB", "sync s"):
        table.add_column(column, justify="left" if column == "label" else "right")
    for label, r in results.items():
        table.add_row(
            label,
            f"{r['payload_bytes'][-1] / 1e6:.0f}",
            f"{r['driver_at_first_step_gib']:.2f}",
            f"{r['driver_peak_in_steps_gib']:.2f}",
            f"{r['driver_rise_in_steps_gib']:.2f}",
            " / ".join(f"{s:.1f}" for s in r["sync_s"]),
        )
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
