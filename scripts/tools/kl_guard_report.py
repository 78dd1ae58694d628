"""How well did the KL trust region hold, and what did it cost? A table and JSON from finished run directories.

    logra-train -m trainer.seed=1,2,3,4,5 trainer.run_name=guard     # five quickstart seeds, one directory each
    .venv/bin/python scripts/tools/kl_guard_report.py outputs/quickstart/guard_*  --out bench_results/kl_guard.json

Per run, from `metrics.jsonl` and `config.yaml` only:
- the bound: committed steps whose `train/kl_realized` exceeds `logra.kl.max_overshoot` × `logra/kl_budget`
  (for runs from before the guard, the same count against the 1.5 default), and updates the guard refused;
- the prediction's calibration: realised / predicted KL at the proposed α (median, 90th percentile, max), from
  `logra/kl_realized_over_predicted`, or for older runs realised over predicted at the committed α (then the same);
- learning: mean reward of the first and last 5 steps, the best 10-step window against the last 10 steps
  (a collapse is a last-10 mean more than 0.1 under the best window), the last eval's pass@1;
- cost: line-search tries per step, the probe's and the line search's share of the summed step time.
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

from logra_rl.utils.plot import load_run

COLLAPSE_DROP = 0.1


def _quantile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else None


def _window_means(values: list[float], width: int) -> list[float]:
    return [statistics.mean(values[i : i + width]) for i in range(len(values) - width + 1)]


def summarize(run: Path) -> dict[str, Any]:
    loaded = load_run(run)
    records, overshoot = loaded.records, loaded.max_overshoot
    steps = [r for r in records if r.get("reward/mean") is not None]
    rewards = [r["reward/mean"] for r in steps]
    committed = [r for r in steps if r.get("train/kl_realized") is not None and r.get("logra/kl_budget")]
    over = [r["step"] for r in committed if r["train/kl_realized"] > overshoot * r["logra/kl_budget"]]
    calibration = [
        r["logra/kl_realized_over_predicted"]
        if r.get("logra/kl_realized_over_predicted") is not None
        else r["train/kl_realized"] / r["logra/kl_predicted"]
        for r in committed
        if r.get("logra/kl_realized_over_predicted") is not None
        or (r.get("logra/kl_predicted") and "logra/line_search_tries" not in r)  # a run from before the guard
    ]
    tries = [r["logra/line_search_tries"] for r in steps if r.get("logra/line_search_tries") is not None]
    evals = [(r["step"], v) for r in records for k, v in r.items() if k.startswith("eval/") and k.endswith("pass@1")]
    step_seconds = sum(r.get("timing_s/step") or 0 for r in steps) or float("nan")
    windows = _window_means(rewards, 10)
    return {
        "run": str(run),
        "steps": len(steps),
        "max_overshoot": overshoot,
        "committed": len(committed),
        "over_bound": len(over),
        "over_bound_steps": over,
        "worst_realized_over_budget": max(
            (r["train/kl_realized"] / r["logra/kl_budget"] for r in committed), default=None
        ),
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
        "step_seconds_median": statistics.median(seconds)
        if (seconds := [r["timing_s/step"] for r in steps if r.get("timing_s/step")])
        else None,
    }


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="KL trust region per run")
    columns = [
        "run",
        "over bound",
        "refused",
        "realised/predicted median · p90 · max",
        "reward first5 → last5 (gain)",
        "best10 / last10",
        "final pass@1",
        "tries mean",
        "probe · line-search share",
    ]
    for column in columns:
        out.add_column(column, justify="left" if column == "run" else "right")
    for row in rows:
        final = row["eval_pass1"][max(row["eval_pass1"])] if row["eval_pass1"] else None
        out.add_row(
            Path(row["run"]).name,
            f"{row['over_bound']} / {row['committed']}",
            str(row["refused"]),
            " · ".join(_fmt(row[k], ".2f") for k in ("calibration_median", "calibration_p90", "calibration_max")),
            f"{_fmt(row['reward_first5'], '.3f')} → {_fmt(row['reward_last5'], '.3f')} "
            f"({_fmt(row['reward_gain'], '+.3f')})",
            f"{_fmt(row['best10'], '.3f')} / {_fmt(row['last10'], '.3f')}" + (" collapsed" if row["collapsed"] else ""),
            _fmt(final, ".3f"),
            _fmt(row["tries_mean"], ".2f"),
            f"{row['probe_share']:.3f} · {row['line_search_share']:.3f}",
        )
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
    Console(width=220).print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
