"""Where metrics go: metrics.jsonl (always), wandb (when configured), a live progress line, a final table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from logra_rl.utils.run_dir import write_atomic
from logra_rl.utils.structs import check

# Metrics renamed by issue 27 (and one before it), old name → name: records read back (a resumed run's
# metrics.jsonl, `logra-plot` of an older run) are read under the current names; docs/training.md lists them.
RENAMED_METRICS = {
    "actor/loss": "train/loss",
    "actor/is_ratio_mean": "train/is_ratio_mean",
    "actor/is_truncated_frac": "train/is_truncated_frac",
    "actor/clip_frac": "train/clip_frac",
    "actor/tokens": "train/tokens",
    "actor/skipped": "train/skipped",
    "actor/kl_realized": "train/kl_realized",
    "logra/kl_realized": "train/kl_realized",  # LoGRA's name for it before dense and LoRA logged it too
    "actor/lr": "train/lr",
    "actor/grad_norm": "train/grad_norm",
    "rollout/logprob_diff_mean": "train/mismatch",
    "sync/weight_max_abs_diff": "sync/drift",
}


def current_names(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its metrics under their current names (RENAMED_METRICS); a current name present wins."""
    renamed = {RENAMED_METRICS.get(key, key): value for key, value in record.items() if key not in RENAMED_METRICS}
    for old, new in RENAMED_METRICS.items():
        if old in record:
            renamed.setdefault(new, record[old])
    return renamed


PROGRESS_KEYS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("α", "logra/alpha", "{:.2f}"),
    ("KL", "train/kl_realized", "{:.1e}"),
    ("step", "timing_s/step", "{:.2f}s"),
)
SUMMARY_KEYS = (
    "reward/mean",
    "eval/{task}/pass@1",
    "logra/alpha",
    "logra/kl_predicted",
    "train/kl_realized",
    "logra/kl_budget",
    "logra/line_search_tries",
    "sync/payload_bytes",
    "sync/drift",
    "memory/train_peak_gib",
    "timing_s/step",
)


@dataclass(frozen=True)
class LoggerConfig:
    """metrics.jsonl always; wandb when `wandb_mode` is online/offline (never waits for a login)."""

    wandb_mode: str = "disabled"
    wandb_project: str = "logra_rl"
    wandb_entity: str | None = None
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        check(
            self.wandb_mode in ("disabled", "offline", "online"),
            "logger.wandb_mode",
            self.wandb_mode,
            "disabled, offline or online",
        )


class MetricsLogger:
    """One JSON object per step in `metrics.jsonl`; on resume, records after the resumed step are dropped."""

    def __init__(
        self, run_dir: Path, config: LoggerConfig, run_config: dict[str, Any], total_steps: int, start_step: int = 0
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._truncate_after(start_step)
        self.console = Console()
        self.history: list[dict[str, Any]] = []
        self._wandb = None
        if config.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(
                project=config.wandb_project,
                entity=config.wandb_entity,
                mode=config.wandb_mode,
                dir=str(run_dir),
                config=run_config,
                name=Path(run_dir).name,
                resume="allow",
            )
        self._progress = None
        if config.progress:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[figures]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, figures="")
            self._progress.start()

    def drop_after(self, step: int) -> None:
        """Forget the records of `step` and after (a run that goes back to a checkpoint replays them)."""
        self._truncate_after(step)
        self.history = [record for record in self.history if record["step"] < step]

    def _truncate_after(self, step: int) -> None:
        """Keep only records of steps before `step`: a resumed run rewrites what came after its checkpoint, and
        the records it keeps are written under the current metric names (a run resumed across a rename)."""
        if not self.path.exists():
            return
        kept = [json.loads(line) for line in self.path.read_text().splitlines() if _step_of(line) < step]
        write_atomic(self.path, "".join(json.dumps(current_names(record)) + "\n" for record in kept))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        self.history.append(record)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._progress is not None:
            figures = "  ".join(
                f"{label} {fmt.format(metrics[key])}" for label, key, fmt in PROGRESS_KEYS if key in metrics
            )
            self._progress.update(self._task, completed=min(step + 1, self._progress.tasks[0].total), figures=figures)

    def summary(self, task: str) -> Table:
        """First and last value (and the mean of the last 5 steps) of the headline metrics."""
        table = Table(title="run summary")
        for column in ("metric", "first", "last", "mean of last 5"):
            table.add_column(column, justify="right" if column != "metric" else "left")
        for template in SUMMARY_KEYS:
            key = template.format(task=task)
            values = [r[key] for r in self.history if key in r and r[key] is not None]
            if values:
                tail = values[-5:]
                table.add_row(key, _fmt(values[0]), _fmt(values[-1]), _fmt(sum(tail) / len(tail)))
        return table

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()


def _step_of(line: str) -> float:
    """A record's step; a line a kill cut short (or an empty one) counts as after every step, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Inf; null marks a value that could not be computed
    return value


def _fmt(value: float) -> str:
    return f"{value:.4g}"
