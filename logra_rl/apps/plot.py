"""`logra-plot`: runs side by side, in one figure (comparison.png) and one markdown table (comparison.md)."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless, as for the end-of-run plot
import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from logra_rl.utils.plot import (
    HELDOUT_FACTOR,
    HELDOUT_STYLE,
    KL_BUDGET,
    KL_PREDICTED,
    KL_REALIZED,
    OVER_BOUND_STYLE,
    REFUSED,
    REFUSED_STYLE,
    config_value,
    heldout_points,
    over_heldout,
    read_config,
    read_records,
    refused_updates,
)

DASH = "—"
# Predicted on top and thicker: it is the smooth budget-bound curve the noisy realised KL is checked against; the
# budget thin and dotted, as the reference both are measured by.
KL_STYLES: dict[str, dict[str, Any]] = {
    KL_REALIZED: {"linestyle": "-", "linewidth": 0.8, "alpha": 0.7},
    KL_PREDICTED: {"linestyle": "--", "linewidth": 1.6, "zorder": 3},
    KL_BUDGET: {"linestyle": ":", "linewidth": 1.0},
}
KL_NAMES = {KL_REALIZED: "realised", KL_PREDICTED: "predicted (q·α²)", KL_BUDGET: "budget δ"}
RUN_DIR_CONTENTS = "a run directory (outputs/<experiment_name>/<run_name>/) holds metrics.jsonl and config.yaml"


@dataclass
class Run:
    """One run directory: its resolved config, its metrics records, and the eval keys it logged."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    label: str = ""
    pass1_key: str | None = field(init=False, default=None)
    passk_key: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.pass1_key, self.passk_key = _eval_keys(self.config, self.records)

    @property
    def optimizer(self) -> str:
        return str(config_value(self.config, "optimizer.name") or DASH)

    def series(self, key: str | None) -> tuple[list[int], list[float]]:
        """(steps, values) of `key`, skipping records without it or with null (a value that could not be computed)."""
        points = [(r["step"], float(r[key])) for r in self.records if key and r.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def values(self, key: str | None) -> list[float]:
        return self.series(key)[1]

    @property
    def train_steps(self) -> int:
        """Steps that trained (any key besides eval/*): the final eval record at step = total_steps is not one."""
        return sum(any(k != "step" and not k.startswith("eval/") for k in r) for r in self.records)


def load_run(path: Path) -> Run:
    """Read a run directory (or its metrics.jsonl); errors name the path and say what a run directory holds."""
    path = Path(path)
    if path.is_file() and path.name == "metrics.jsonl":
        path = path.parent
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {RUN_DIR_CONTENTS}")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; {RUN_DIR_CONTENTS}")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} has no metrics.jsonl; {RUN_DIR_CONTENTS}")
    records = read_records(metrics)
    if not records:
        raise ValueError(f"{metrics} is empty: the run logged no step yet")
    return Run(path=path, config=read_config(path / "config.yaml"), records=records)


def default_labels(runs: list[Run]) -> list[str]:
    """Run dir name, with the optimizer added when the name does not say it; parent dirs added until unique."""
    labels = []
    for run in runs:
        name, optimizer = run.path.name, run.optimizer
        labels.append(name if optimizer == DASH or optimizer in name else f"{name} ({optimizer})")
    for _ in range(2):  # experiment/run_name, then the next level up
        counts = {label: labels.count(label) for label in labels}
        if all(count == 1 for count in counts.values()):
            return labels
        labels = [
            f"{run.path.resolve().parent.name}/{label}" if counts[label] > 1 else label
            for run, label in zip(runs, labels, strict=True)
        ]
    return [f"{label} #{i}" if labels.count(label) > 1 else label for i, label in enumerate(labels, 1)]


def summarize(run: Run) -> dict[str, str]:
    """The table row of one run: the numbers the figure shows, reduced to one value each."""
    rewards = run.values("reward/mean")
    total_steps = config_value(run.config, "trainer.total_steps")
    steps = str(run.train_steps) if total_steps in (None, run.train_steps) else f"{run.train_steps}/{total_steps}"
    last_step = run.records[-1]["step"]
    updates = run.values("perf/updates_per_hour")
    timings = run.values("timing_s/step")
    sync_bytes = _sync_bytes(run)
    held, over = heldout_points(run.records), over_heldout(run.records)
    refusals = run.values(REFUSED)
    return {
        "run": run.label,
        "optimizer": run.optimizer,
        "steps": steps,
        "reward first 5": _num(_mean(rewards[:5]), ".3f"),
        "reward last 5": _num(_mean(rewards[-5:]), ".3f"),
        "eval pass@1 at start": _first_eval(run, run.pass1_key),
        "eval pass@1": _final_eval(run, run.pass1_key, last_step),
        "eval pass@k": _final_eval(run, run.passk_key, last_step),
        "KL realised (mean)": _num(_mean(run.values(KL_REALIZED)), ".2e"),
        "KL predicted (mean)": _num(_mean(run.values(KL_PREDICTED)), ".2e"),
        f"held-out KL > {HELDOUT_FACTOR:g}× budget": f"{len(over)} / {len(held)}" if held else DASH,
        "updates refused": _num(sum(refusals) if refusals else None, ".0f"),
        "mem avg GiB": _num(_mean(run.values("memory/train_avg_gib")), ".2f"),
        "mem peak GiB": _num(max(run.values("memory/train_peak_gib"), default=None), ".2f"),
        "sync KiB/step": _num(_mean(sync_bytes) / 1024 if sync_bytes else None, ",.0f"),
        "updates/h (median)": _num(statistics.median(updates) if updates else None, ",.0f"),
        "wall time": _duration(sum(timings)) if timings else DASH,
    }


def comparison_rows(runs: list[Run]) -> list[dict[str, str]]:
    """One `summarize` row per run; k goes into the pass@k header when the runs share it, else into each cell."""
    ks = {_k(run.passk_key) for run in runs if run.passk_key}
    header = f"eval pass@{next(iter(ks))}" if len(ks) == 1 else "eval pass@k"
    rows = []
    for run in runs:
        row = summarize(run)
        if len(ks) > 1 and row["eval pass@k"] != DASH:
            row["eval pass@k"] += f" (k={_k(run.passk_key)})"
        rows.append({(header if column == "eval pass@k" else column): value for column, value in row.items()})
    return rows


def markdown_table(rows: list[dict[str, str]]) -> str:
    """A GitHub markdown table; every column but the run label and optimizer is right-aligned."""
    columns = list(rows[0])
    align = [":---" if column in ("run", "optimizer") else "---:" for column in columns]
    lines = [columns, align, *([row[c].replace("|", "\\|") for c in columns] for row in rows)]
    return "\n".join(f"| {' | '.join(line)} |" for line in lines) + "\n"


def plot_comparison(runs: list[Run], output: Path, smooth: int = 10) -> Path:
    """A 2×3 grid: reward (smoothed over `smooth` steps, raw faint), eval pass@1, pass@k, KL, memory, updates/hour."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {run.label: colors[i % len(colors)] for i, run in enumerate(runs)}
    figure, axes = plt.subplots(2, 3, figsize=(17, 9))
    reward, pass1, passk, kl, memory, speed = axes.flat

    for run in runs:
        steps, values = run.series("reward/mean")
        if steps:
            reward.plot(steps, values, color=color[run.label], alpha=0.2, linewidth=0.8)
            reward.plot(steps, _moving_average(values, smooth), color=color[run.label], label=run.label)
    reward.set_title(f"reward/mean (moving average over {smooth} steps)" if smooth > 1 else "reward/mean")

    ks = {_k(run.passk_key) for run in runs if run.passk_key}
    for axis, attribute in ((pass1, "pass1_key"), (passk, "passk_key")):
        for run in runs:
            key = getattr(run, attribute)
            steps, values = run.series(key)
            if steps:
                label = run.label if attribute == "pass1_key" or len(ks) == 1 else f"{run.label} (k={_k(key)})"
                axis.plot(steps, values, color=color[run.label], marker="o", markersize=4, label=label)
        axis.set_ylim(-0.02, 1.02)
    pass1.set_title("eval pass@1")
    passk.set_title(f"eval pass@{ks.pop()}" if len(ks) == 1 else "eval pass@k")

    any_held = any_over = any_refused = False
    for run in runs:
        for key, style in KL_STYLES.items():
            steps, values = run.series(key)
            kept = [(s, v) for s, v in zip(steps, values, strict=True) if v > 0]  # log scale: zero KL has no place
            if kept:
                kl.plot(*zip(*kept, strict=True), color=color[run.label], label=f"{run.label} {KL_NAMES[key]}", **style)
        if held := heldout_points(run.records):
            kl.plot([p[0] for p in held], [p[1] for p in held], **HELDOUT_STYLE, color=color[run.label])
            any_held = True
        if over := over_heldout(run.records):
            kl.plot(*zip(*over, strict=True), **OVER_BOUND_STYLE, label=f"{run.label} over bound")
            any_over = True
        if refused := refused_updates(run.records):
            kl.plot(*zip(*refused, strict=True), **REFUSED_STYLE, color=color[run.label], label=f"{run.label} refused")
            any_refused = True
    kl.set_title("KL per token: realised, predicted, held out, budget")
    if kl.lines:
        kl.set_yscale("log")
        handles = [Line2D([], [], color="gray", **style) for style in KL_STYLES.values()]
        names = list(KL_NAMES.values())
        if any_held:  # the markers are explained only where they appear
            handles.append(Line2D([], [], **HELDOUT_STYLE, color="gray"))
            names.append("held out (rows the guard never saw)")
        if any_over:
            handles.append(Line2D([], [], **OVER_BOUND_STYLE))
            names.append(f"held out > {HELDOUT_FACTOR:g}× budget")
        if any_refused:
            handles.append(Line2D([], [], **REFUSED_STYLE, color="gray"))
            names.append("update refused (at its budget)")
        kl.legend(handles, names, fontsize=8)
    else:
        _note(kl, "no logra/kl_* metrics (no LoGRA run)")

    labels = [run.label for run in runs]
    positions = list(range(len(runs)))
    averages = [_mean(run.values("memory/train_avg_gib")) for run in runs]
    peaks = [max(run.values("memory/train_peak_gib"), default=None) for run in runs]
    width = 0.38
    for offset, values, hatch in ((-width / 2, averages, "//"), (width / 2, peaks, None)):
        bars = memory.bar(
            [p + offset for p in positions],
            [v or 0.0 for v in values],
            width,
            color=[color[label] for label in labels],
            alpha=0.55 if hatch else 0.95,
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
        )
        memory.bar_label(bars, labels=[_num(v, ".2f").replace(DASH, "no data") for v in values], fontsize=8)
    memory.set_title("train worker memory (GiB): average and peak")
    handles = [Patch(facecolor="lightgray", hatch="//", edgecolor="black"), Patch(facecolor="gray", edgecolor="black")]
    memory.legend(handles, ["average", "peak"], fontsize=8, loc="lower right")

    medians = [statistics.median(v) if (v := run.values("perf/updates_per_hour")) else None for run in runs]
    bars = speed.bar(positions, [m or 0.0 for m in medians], 0.6, color=[color[label] for label in labels])
    speed.bar_label(bars, labels=[_num(m, ",.0f").replace(DASH, "no data") for m in medians], fontsize=8)
    speed.set_title("optimizer updates per hour (median over steps)")

    rotate = max(map(len, labels)) > 12
    for axis in (memory, speed):
        axis.set_xticks(positions, labels, rotation=20 if rotate else 0, ha="right" if rotate else "center")
        axis.margins(y=0.12)
    for axis in (reward, pass1, passk, kl):
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if not axis.lines and axis is not kl:
            _note(axis, "no values logged")
    for axis in (reward, pass1, passk):
        if axis.lines:
            axis.legend(fontsize=8)
    figure.suptitle(" vs ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs", fontsize=13)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return Path(output)


def plot_main(argv: list[str] | None = None) -> int:
    """`logra-plot RUN_DIR [RUN_DIR ...]`: writes comparison.png and comparison.md, prints the table; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="logra-plot",
        description="Compare runs side by side: a PNG of reward, eval, KL, memory, speed and a markdown table.",
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="outputs/<experiment_name>/<run_name>/")
    parser.add_argument("--out", type=Path, help="output directory (default: <first run's parent>/compare)")
    parser.add_argument("--labels", help="comma-separated labels, one per run (default: from run dir and optimizer)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window for reward, in steps (1 = raw)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be at least 1, got {args.smooth}")
    out = args.out or args.runs[0].resolve().parent / "compare"
    runs = []
    for path in args.runs:
        if path.resolve() == out.resolve() and not (path / "metrics.jsonl").exists():
            print(f"logra-plot: skipping {path}: it is this command's output directory", file=sys.stderr)
            continue  # `logra-plot outputs/quickstart/*` a second time picks up the compare/ it wrote
        try:
            runs.append(load_run(path))
        except (OSError, ValueError) as error:
            print(f"logra-plot: {error}", file=sys.stderr)
            return 2
    if not runs:
        print("logra-plot: no run directories left to compare", file=sys.stderr)
        return 2
    labels = [label.strip() for label in args.labels.split(",")] if args.labels else default_labels(runs)
    if len(labels) != len(runs) or len(set(labels)) != len(labels):
        print(f"logra-plot: --labels needs {len(runs)} distinct labels, got {labels}", file=sys.stderr)
        return 2
    for run, label in zip(runs, labels, strict=True):
        run.label = label
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(comparison_rows(runs))
    (out / "comparison.md").write_text(table)
    png = plot_comparison(runs, out / "comparison.png", smooth=args.smooth)
    print(table)
    print(f"logra-plot: wrote {png} and {out / 'comparison.md'}")
    return 0


def _eval_keys(config: dict[str, Any], records: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """The pass@1 and pass@k keys: k = eval.samples, the task from the keys (task.name may differ from
    data.task, e.g. for reasoning_gym), preferring data.task when several tasks were evaluated."""
    keys = {key for record in records for key in record if re.fullmatch(r"eval/.+/pass@\d+", key)}
    tasks = sorted({key.rsplit("/", 1)[0] for key in keys})
    if not tasks:
        return None, None
    prefix = f"eval/{config_value(config, 'data.task')}"
    prefix = prefix if prefix in tasks else tasks[0]
    k = config_value(config, "eval.samples")
    ks = sorted(_k(key) for key in keys if key.startswith(f"{prefix}/pass@"))
    pass1 = f"{prefix}/pass@1" if 1 in ks else None
    passk = f"{prefix}/pass@{k}" if k in ks else f"{prefix}/pass@{ks[-1]}"
    return pass1, passk


def _first_eval(run: Run, key: str | None) -> str:
    """The first eval value (step 0 in a run that evaluates before training)."""
    steps, values = run.series(key)
    return f"{values[0]:.3f}" if steps else DASH


def _sync_bytes(run: Run) -> list[float]:
    """Bytes sent to the engines per train step: the payloads plus any full resync."""
    records = [r for r in run.records if "sync/payload_bytes" in r]
    return [r["sync/payload_bytes"] + r.get("sync/full_resync_bytes", 0.0) for r in records]


def _final_eval(run: Run, key: str | None, last_step: int) -> str:
    """The last eval value; its step is added when it is not the run's last record (e.g. the final eval is missing)."""
    steps, values = run.series(key)
    if not steps:
        return DASH
    return f"{values[-1]:.3f}" if steps[-1] == last_step else f"{values[-1]:.3f} @ step {steps[-1]}"


def _k(key: str | None) -> int:
    return int(key.rsplit("@", 1)[1]) if key else 0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values, so the curve starts at step 0 rather than `window` steps in."""
    return [_mean(values[max(0, i + 1 - window) : i + 1]) or 0.0 for i in range(len(values))]


def _num(value: float | None, spec: str) -> str:
    return DASH if value is None else format(value, spec)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _note(axis: Any, text: str) -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes, color="gray")
