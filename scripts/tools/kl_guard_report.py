"""How well did the KL trust region hold where the guard did not look, and what did it cost? A table and JSON
from finished run directories.

    logra-train -m trainer.seed=1,2,3,4,5 algorithm.max_staleness=1 trainer.run_name=guard   # five seeds
    .venv/bin/python scripts/tools/kl_guard_report.py outputs/quickstart/guard_*  --out bench_results/kl_guard.json

Per run, from `metrics.jsonl` and `config.yaml` only:
- the referee: every update's KL on rows the guard never saw, against its budget (`utils.plot.heldout_points`:
  the next batch's behaviour KL of a one-step-off run, the withheld rows of `trainer.heldout_every`): the share
  of updates past 1.5×, 2× and 4× their budget, the worst, and the summed KL over the summed budget;
- the guard: updates refused, tries per step, the proposal's calibration (measured / predicted KL at the proposed
  α: median, 90th percentile, max);
- learning: mean reward of the first and last 5 steps, the best 10-step window against the last 10 steps (a
  collapse is a last-10 mean more than 0.1 under the best window), the last eval's pass@1;
- cost: the probe's (proposal and guard), the line search's and the held-out rows' share of the summed step time.
A last row pools every run's held-out points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from logra_rl.apps.plot import load_run
from logra_rl.utils.plot import heldout_points

COLLAPSE_DROP = 0.1
FACTORS = (1.5, 2.0, 4.0)


def _quantile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else None


def _window_means(values: list[float], width: int) -> list[float]:
    return [statistics.mean(values[i : i + width]) for i in range(len(values) - width + 1)]


def referee(points: list[tuple[int, float, float]]) -> dict[str, Any]:
    """The held-out points (step, KL, budget) summarised against the budgets."""
    ratios = [kl / budget for _, kl, budget in points]
    return {
        "heldout_points": len(points),
        **{
            f"heldout_over_{factor:g}x": sum(r > factor for r in ratios) / len(ratios) if ratios else None
            for factor in FACTORS
        },
        "heldout_worst": max(ratios, default=None),
        "heldout_median": statistics.median(ratios) if ratios else None,
        "heldout_sum_ratio": sum(kl for _, kl, _ in points) / sum(b for _, _, b in points) if points else None,
    }


def summarize(run: Path) -> dict[str, Any]:
    loaded = load_run(run)
    steps = [r for r in loaded.records if r.get("reward/mean") is not None]
    rewards = [r["reward/mean"] for r in steps]
    calibration = [r["logra/kl_realized_over_predicted"] for r in steps if r.get("logra/kl_realized_over_predicted")]
    tries = [r["logra/line_search_tries"] for r in steps if r.get("logra/line_search_tries") is not None]
    evals = [
        (r["step"], v) for r in loaded.records for k, v in r.items() if k.startswith("eval/") and k.endswith("pass@1")
    ]
    step_seconds = sum(r.get("timing_s/step") or 0 for r in steps) or float("nan")
    windows = _window_means(rewards, 10)
    points = heldout_points(loaded.records)
    return {
        "run": str(run),
        "steps": len(steps),
        **referee(points),
        "points": points,
        "committed": sum(r.get("train/kl_realized") is not None for r in steps),
        "refused": int(sum(r.get("logra/overshoot_refused") or 0 for r in steps)),
        "calibration_median": statistics.median(calibration) if calibration else None,
        "calibration_p90": _quantile(calibration, 0.9),
        "calibration_max": max(calibration, default=None),
        "reward_first5": statistics.mean(rewards[:5]) if rewards else None,
        "reward_last5": statistics.mean(rewards[-5:]) if rewards else None,
        "reward_gain": statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]) if rewards else None,
        "best10": max(windows, default=None),
        "last10": windows[-1] if windows else None,
        "collapsed": bool(windows) and max(windows) - windows[-1] > COLLAPSE_DROP,
        "eval_pass1": dict(evals),
        "tries_mean": statistics.mean(tries) if tries else None,
        "tries_max": max(tries, default=None),
        "probe_share": sum(r.get("timing_s/probe") or 0 for r in steps) / step_seconds,
        "line_search_share": sum(r.get("timing_s/line_search") or 0 for r in steps) / step_seconds,
        "heldout_share": sum(r.get("timing_s/heldout") or 0 for r in steps) / step_seconds,
        "step_seconds_median": statistics.median(seconds)
        if (seconds := [r["timing_s/step"] for r in steps if r.get("timing_s/step")])
        else None,
    }


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]], pooled: dict[str, Any]) -> Table:
    out = Table(title="KL trust region per run: the held-out referee, the guard, learning, cost")
    columns = [
        "run",
        "held out: updates",
        "> 1.5× · 2× · 4×",
        "worst · ΣKL/Σbudget",
        "refused",
        "proposal calibration median · p90",
        "reward first5 → last5 (gain)",
        "best10 / last10",
        "final pass@1",
        "tries",
        "probe · line search · held-out share",
    ]
    for column in columns:
        out.add_column(column, justify="left" if column == "run" else "right")

    def shares(row: dict[str, Any]) -> str:
        return " · ".join(_fmt(row.get(f"heldout_over_{factor:g}x"), ".1%") for factor in FACTORS)

    for row in rows:
        final = row["eval_pass1"][max(row["eval_pass1"])] if row["eval_pass1"] else None
        out.add_row(
            Path(row["run"]).name,
            str(row["heldout_points"]),
            shares(row),
            f"{_fmt(row['heldout_worst'], '.2f')} · {_fmt(row['heldout_sum_ratio'], '.2f')}",
            str(row["refused"]),
            " · ".join(_fmt(row[k], ".2f") for k in ("calibration_median", "calibration_p90")),
            f"{_fmt(row['reward_first5'], '.3f')} → {_fmt(row['reward_last5'], '.3f')} "
            f"({_fmt(row['reward_gain'], '+.3f')})",
            f"{_fmt(row['best10'], '.3f')} / {_fmt(row['last10'], '.3f')}" + (" collapsed" if row["collapsed"] else ""),
            _fmt(final, ".3f"),
            _fmt(row["tries_mean"], ".2f"),
            " · ".join(f"{row[k]:.3f}" for k in ("probe_share", "line_search_share", "heldout_share")),
        )
    if len(rows) > 1:
        worst = f"{_fmt(pooled['heldout_worst'], '.2f')} · {_fmt(pooled['heldout_sum_ratio'], '.2f')}"
        out.add_row("all runs", str(pooled["heldout_points"]), shares(pooled), worst, *[""] * 7)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/kl_guard.json"))
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / "metrics.jsonl").exists()]
    if missing:
        print(f"kl_guard_report: no metrics.jsonl in {missing}; give run directories (outputs/<experiment>/<run>)")
        return 2
    rows = [summarize(run) for run in args.runs]
    pooled = referee([point for row in rows for point in row["points"]])
    Console(width=240).print(table(rows, pooled))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": rows, "pooled": pooled}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
