"""Run directories written by hand for the plot tests (tests/utils/test_plot.py, tests/apps/test_plot.py), and
what a drawn figure shows (the `figures` fixture, tests/conftest.py, keeps them open)."""

import json
from pathlib import Path

import matplotlib.pyplot as plt
import yaml


def write_run(
    run_dir: Path, optimizer: str, records: list[dict], total_steps: int = 10, max_overshoot: float | None = None
) -> Path:
    """The two files logra-train writes that logra-plot reads (the config holds only the keys it uses; runs from
    before the KL guard have no logra.kl.max_overshoot)."""
    run_dir.mkdir(parents=True)
    config = {
        "optimizer": {"name": optimizer},
        "data": {"task": "gsm8k"},
        "eval": {"samples": 4},
        "trainer": {"total_steps": total_steps},
    }
    if max_overshoot is not None:
        config["logra"] = {"kl": {"max_overshoot": max_overshoot}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def train_record(step: int, reward: float, timing: float, **extra: float | None) -> dict:
    return {"step": step, "reward/mean": reward, "timing_s/step": timing, **extra}


def logra_records() -> list[dict]:
    """10 steps, reward step/10, KL realised 0.01 (one null) / predicted 0.02 / budget 0.01, evals at 0, 5 and the
    final one; no KL guard metrics (a run from before the guard)."""
    records = []
    for step in range(10):
        record = train_record(
            step,
            step / 10,
            1.5,
            **{
                "train/kl_realized": None if step == 3 else 0.01,
                "logra/kl_predicted": 0.02,
                "logra/kl_budget": 0.01,
                "memory/train_avg_gib": 1.0 if step % 2 else 1.5,
                "memory/train_peak_gib": 2.0 + step / 10,
                "perf/updates_per_hour": 1000.0 + 100 * step,
                "sync/payload_bytes": 2048.0,
                "sync/full_resync_bytes": 10240.0 if step == 9 else 0.0,
            },
        )
        if step in (0, 5):
            record |= {"eval/gsm8k/pass@1": 0.1 * (1 + step / 5), "eval/gsm8k/pass@4": 0.2 * (1 + step / 5)}
        records.append(record)
    return [*records, {"step": 10, "eval/gsm8k/pass@1": 0.5, "eval/gsm8k/pass@4": 0.8}]


def guarded_records() -> list[dict]:
    """8 steps with the KL guard's metrics, budget 0.01, step 6 refused (nothing committed: no realised or predicted
    KL), and the held-out referee: rows withheld at steps 0 and 4 (1.2× and 2.5× the budget), and at step 3 a batch
    one update behind whose behaviour KL is 3× the budget of the update of step 2 that it measures."""
    held_out = {0: 0.012, 4: 0.025}
    records = []
    for step in range(8):
        guard = {"logra/kl_budget": 0.01, "logra/alpha_proposed": 1.0, "logra/overshoot_refused": float(step == 6)}
        if step == 6:
            guard |= {"logra/line_search_tries": 4.0, "logra/kl_realized_over_predicted": 3.0}
        else:
            guard |= {
                "logra/alpha": 1.0,
                "logra/line_search_tries": 1.0,
                "logra/kl_predicted": 0.01,
                "train/kl_realized": 0.01,
                "logra/kl_realized_over_predicted": 1.0,
            }
        if step in held_out:
            guard |= {"heldout/kl": held_out[step], "heldout/kl_budget": 0.01}
        if step == 3:
            guard |= {"async/staleness": 1.0, "async/behaviour_kl": 0.03, "async/behaviour_kl_budget": 0.01}
        records.append(train_record(step, 0.5, 1.0, **guard, **{"timing_s/line_search": 0.1}))
    return records


def kl_axis(figure) -> plt.Axes:
    return next(axis for axis in figure.axes if axis.get_title().startswith("KL per token"))


def lines(axis: plt.Axes) -> dict[str, tuple[list[float], list[float]]]:
    """(steps, values) of each line of `axis`, by its label."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.lines}


def legend(axis: plt.Axes) -> list[str]:
    return [text.get_text() for text in axis.get_legend().get_texts()]
