"""The end-of-run PNG: reward, eval accuracy, KL predicted vs realised, and training memory."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend


def plot_run(metrics_path: Path, output: Path, task: str, k: int) -> Path:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line]
    panels = [
        ("reward", ["reward/mean", "reward/baseline"]),
        ("eval", [f"eval/{task}/pass@1", f"eval/{task}/pass@{k}"]),
        ("KL per token", ["logra/kl_predicted", "logra/kl_realized", "logra/kl_budget"]),
        ("memory (GiB)", ["memory/train_avg_gib", "memory/train_peak_gib"]),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    for axis, (title, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, marker="." if len(points) < 30 else None, label=key)
        if title == "KL per token":
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return Path(output)
