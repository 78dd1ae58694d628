"""The end-of-run plot of a run (`plot_run`, which the trainer draws when it ends) and the reading of a run's
metrics.jsonl and config.yaml it shares with `logra-plot` (`apps.plot`), which compares runs side by side."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib
from omegaconf import OmegaConf

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

from logra_rl.utils.metrics import current_names
from logra_rl.utils.renamed_keys import migrate_keys

KL_REALIZED, KL_PREDICTED, KL_BUDGET = "train/kl_realized", "logra/kl_predicted", "logra/kl_budget"
REFUSED = "logra/overshoot_refused"
BEHAVIOUR_KL = "async/behaviour_kl"  # KL(π_behaviour ‖ π_train) per token of the batch a step trained on
STALENESS_BOUND = "async/staleness_bound"  # the bound a stale batch's behaviour KL was read against
REFUSED_KL = "async/refused_behaviour_kl"  # that of a batch past the staleness bound, generated again
# The held-out referee: KL on rows the guard never saw, against the budget(s) of the update(s) it measures
HELDOUT_KL, HELDOUT_BUDGET = "heldout/kl", "heldout/kl_budget"
BEHAVIOUR_BUDGET = "async/behaviour_kl_budget"
HELDOUT_FACTOR = 2.0  # a held-out KL past this many budgets is marked
# logra.kl.max_overshoot's default: runs from before the KL guard have neither the key nor the guard.
DEFAULT_MAX_OVERSHOOT = 1.5
# The held-out referee's points; one past HELDOUT_FACTOR × its budget must stand out in any run's colour; a refused
# step committed nothing.
HELDOUT_STYLE: dict[str, Any] = {"linestyle": "none", "marker": "o", "markersize": 3, "alpha": 0.8, "zorder": 3}
OVER_BOUND_STYLE: dict[str, Any] = {"linestyle": "none", "marker": "x", "markersize": 7, "color": "red", "zorder": 4}
REFUSED_STYLE: dict[str, Any] = {"linestyle": "none", "marker": "v", "markersize": 6, "markeredgecolor": "black"}


def plot_run(metrics_path: Path, output: Path, task: str, k: int) -> Path:
    """The end-of-run PNG; the KL guard's bound (logra.kl.max_overshoot × budget) comes from the config.yaml beside
    `metrics_path`, so that steps over it and refused steps are marked."""
    metrics_path = Path(metrics_path)
    records = read_records(metrics_path)
    config = read_config(metrics_path.parent / "config.yaml")
    max_overshoot = _max_overshoot(config)
    rates = [r["perf/updates_per_hour"] for r in records if r.get("perf/updates_per_hour")]
    panels = [
        ("reward", ["reward/mean", "reward/baseline"]),
        ("eval", [f"eval/{task}/pass@1", f"eval/{task}/pass@{k}"]),
        ("KL per token", [KL_PREDICTED, KL_REALIZED, KL_BUDGET]),
        ("memory (GiB)", ["memory/train_avg_gib", "memory/train_peak_gib"]),
        (
            f"busy fraction (median {statistics.median(rates):.0f} updates/hour)" if rates else "busy fraction",
            ["perf/train_busy", "perf/rollout_busy"],
        ),
        ("staleness", [BEHAVIOUR_KL]),
    ]
    figure, axes = plt.subplots(3, 2, figsize=(11, 10))
    for axis, (title, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, marker="." if len(points) < 30 else None, label=key)
        if title == "KL per token":
            _draw_guard(axis, records, max_overshoot)
            axis.set_yscale("log")
        if title == "staleness":
            _draw_staleness(axis, records, config_value(config, "algorithm.staleness_kl"))
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.lines:
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return Path(output)


def _draw_guard(axis: Any, records: list[dict[str, Any]], max_overshoot: float) -> None:
    """The guard's bound max_overshoot × budget (thin, dotted), the held-out KL of each update it could be measured
    for (dots), red × where that exceeds HELDOUT_FACTOR × its budget, ▽ at the budget of refused steps: how far the
    updates moved the policy where the guard did not look is visible at a glance."""
    budget = [(r["step"], float(r[KL_BUDGET])) for r in records if r.get(KL_BUDGET) is not None]
    if budget:
        steps, values = zip(*budget, strict=True)
        bound = [max_overshoot * value for value in values]
        axis.plot(steps, bound, linestyle=":", linewidth=0.8, color="gray", label=f"bound {max_overshoot:g} × budget")
    if held := heldout_points(records):
        axis.plot([p[0] for p in held], [p[1] for p in held], **HELDOUT_STYLE, color="black", label="held out")
    if over := over_heldout(records):
        axis.plot(
            *zip(*over, strict=True), **OVER_BOUND_STYLE, label=f"held out > {HELDOUT_FACTOR:g}× budget: {len(over)}"
        )
    if refused := refused_updates(records):
        axis.plot(*zip(*refused, strict=True), **REFUSED_STYLE, color="gray", label=f"refused: {len(refused)}")


def _draw_staleness(axis: Any, records: list[dict[str, Any]], bound: float | None) -> None:
    """The behaviour KL against its bound (`async/staleness_bound` as each stale batch was read against it; a run
    from before it: algorithm.staleness_kl), and on a second axis the staleness in updates; ▽ at the behaviour KL
    of a batch past the bound, sampled again."""
    bounds = [(r["step"], r[STALENESS_BOUND]) for r in records if r.get(STALENESS_BOUND) is not None]
    if bounds:
        axis.plot(*zip(*bounds, strict=True), linestyle=":", linewidth=0.8, color="gray", label="bound")
    elif bound is not None and any(r.get(BEHAVIOUR_KL) is not None for r in records):
        axis.axhline(float(bound), linestyle=":", linewidth=0.8, color="gray", label=f"bound {float(bound):g}")
    refused = [(r["step"], r[REFUSED_KL]) for r in records if r.get("async/refused") and r.get(REFUSED_KL) is not None]
    if refused:
        axis.plot(*zip(*refused, strict=True), **REFUSED_STYLE, color="gray", label=f"sampled again: {len(refused)}")
    points = [(r["step"], r["async/staleness"]) for r in records if r.get("async/staleness") is not None]
    if points:
        steps = axis.twinx()
        steps.step(*zip(*points, strict=True), where="mid", color="tab:orange", linewidth=0.8)
        steps.set_ylabel("updates behind", color="tab:orange", fontsize=8)


def read_records(metrics: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{metrics} line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{metrics} line {number} is not a metrics record (a JSON object with a 'step' key)")
        records.append(current_names(record))  # an older run's metrics under today's names
    return records


def read_config(path: Path) -> dict[str, Any]:
    """The resolved config.yaml, or {} without one: only the optimizer name, eval k, step count and the KL guard's
    max_overshoot come from it (a run saved under old key names reads in the new ones)."""
    if not path.is_file():
        return {}
    try:
        config = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as error:
        raise ValueError(f"{path} is not a readable YAML config ({error})") from None
    return migrate_keys(config)[0] if isinstance(config, dict) else {}


def _max_overshoot(config: dict[str, Any]) -> float:
    value = config_value(config, "logra.kl.max_overshoot")
    return float(value) if isinstance(value, int | float) else DEFAULT_MAX_OVERSHOOT


def heldout_points(records: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, KL, budget) of every update whose KL was measured on rows the guard never saw: `heldout/kl` (rows
    withheld from the step, `trainer.heldout_every`), and the behaviour KL of a batch sampled before the update(s)
    it trained after (`algorithm.max_staleness`), placed at the step that made the first of them. The budget is
    what those updates were granted (a run from before `async/behaviour_kl_budget`: the budget of the one update
    committed at that step); dense and LoRA have none and are not listed."""
    points = [
        (r["step"], float(r[HELDOUT_KL]), float(r[HELDOUT_BUDGET]))
        for r in records
        if r.get(HELDOUT_KL) is not None and r.get(HELDOUT_BUDGET)
    ]
    budgets = {r["step"]: r[KL_BUDGET] for r in records if r.get(KL_BUDGET) is not None and r.get("logra/alpha")}
    for r in records:
        if r.get(BEHAVIOUR_KL) is None or not r.get("async/staleness"):
            continue
        step = r["step"] - int(r["async/staleness"])
        budget = r.get(BEHAVIOUR_BUDGET) or (budgets.get(step) if r["async/staleness"] == 1 else None)  # older runs
        if budget:
            points.append((step, float(r[BEHAVIOUR_KL]), float(budget)))
    return sorted(points)


def over_heldout(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, KL) of the held-out points past HELDOUT_FACTOR × their budget."""
    return [(step, kl) for step, kl, budget in heldout_points(records) if kl > HELDOUT_FACTOR * budget]


def refused_updates(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, budget) of steps whose update the guard refused: nothing was committed, so there is no realised KL to
    mark and the budget stands in for it."""
    return [(r["step"], float(r[KL_BUDGET])) for r in records if r.get(REFUSED) and r.get(KL_BUDGET) is not None]


def config_value(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
