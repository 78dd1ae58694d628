"""plot_run as the trainer calls it, on small run directories written by hand."""

import pytest
import yaml

from logra_rl.utils.plot import plot_run
from tests.plot_runs import guarded_records, kl_axis, legend, lines, logra_records, train_record, write_run


def test_plot_run_still_writes_the_end_of_run_png(tmp_path, figures):
    run = write_run(tmp_path / "logra", "logra", logra_records())
    png = plot_run(run / "metrics.jsonl", tmp_path / "run.png", task="gsm8k", k=4)
    assert png.stat().st_size > 10_000
    # a run from before the guard: the default bound 1.5 × budget, no step over it, nothing refused
    assert legend(kl_axis(figures[0])) == [
        "logra/kl_predicted",
        "train/kl_realized",
        "logra/kl_budget",
        "bound 1.5 × budget",
    ]
    assert lines(kl_axis(figures[0]))["bound 1.5 × budget"][1] == pytest.approx([0.015] * 10)


def test_plot_run_marks_the_bound_from_config_yaml_and_the_held_out_kl(tmp_path, figures):
    run = write_run(tmp_path / "logra", "logra", guarded_records(), total_steps=8, max_overshoot=2.0)
    png = plot_run(run / "metrics.jsonl", tmp_path / "run.png", task="gsm8k", k=4)
    assert png.stat().st_size > 10_000
    drawn = lines(kl_axis(figures[0]))
    assert drawn["bound 2 × budget"] == (list(range(8)), [0.02] * 8)
    assert drawn["held out"] == ([0, 2, 4], [0.012, 0.03, 0.025])
    assert drawn["held out > 2× budget: 2"] == ([2, 4], [0.03, 0.025])
    assert drawn["refused: 1"] == ([6], [0.01])
    assert drawn["train/kl_realized"][0] == [0, 1, 2, 3, 4, 5, 7]


def test_plot_run_shows_busy_fractions_and_the_behaviour_kl_against_its_bound(tmp_path, figures):
    """An asynchronous run (algorithm.max_staleness=1): each group's busy fraction, updates per hour in the title,
    the behaviour KL under the bound from config.yaml, the batch sampled again marked, the staleness in updates."""
    records = [
        train_record(
            step,
            0.5,
            1.0,
            **{
                "perf/train_busy": 0.9,
                "perf/rollout_busy": 0.6,
                "perf/updates_per_hour": 3600.0,
                "async/staleness": float(step > 0),
                "async/behaviour_kl": 0.01,
                "async/refused": float(step == 3),
                **({"async/refused_behaviour_kl": 0.2} if step == 3 else {}),
            },
        )
        for step in range(6)
    ]
    run = write_run(tmp_path / "async", "logra", records, total_steps=6)
    config = yaml.safe_load((run / "config.yaml").read_text()) | {"algorithm": {"staleness_kl": 0.1}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    plot_run(run / "metrics.jsonl", tmp_path / "run.png", task="gsm8k", k=4)
    titles = {axis.get_title(): axis for axis in figures[0].axes}
    busy = lines(titles["busy fraction (median 3600 updates/hour)"])
    assert busy["perf/train_busy"] == (list(range(6)), [0.9] * 6) and busy["perf/rollout_busy"][1] == [0.6] * 6
    staleness = lines(titles["staleness"])
    assert staleness["bound 0.1"][1] == [0.1, 0.1]  # a run from before the bound was logged: the config's
    assert staleness["sampled again: 1"] == ([3], [0.2])
    assert staleness["async/behaviour_kl"][1] == [0.01] * 6
    [updates] = [axis for axis in figures[0].axes if axis.get_ylabel() == "updates behind"]
    assert list(updates.lines[0].get_ydata()) == [0.0] + [1.0] * 5
    # the bound each stale batch was read against (it follows the budget schedule and the measured numerics)
    for step, record in enumerate(records[1:], 1):
        record["async/staleness_bound"] = 0.3 - 0.01 * step
    run = write_run(tmp_path / "async_bound", "logra", records, total_steps=6)
    plot_run(run / "metrics.jsonl", tmp_path / "bound.png", task="gsm8k", k=4)
    titles = {axis.get_title(): axis for axis in figures[1].axes}
    drawn = lines(titles["staleness"])["bound"]
    assert drawn[0] == [1, 2, 3, 4, 5] and drawn[1] == pytest.approx([0.29, 0.28, 0.27, 0.26, 0.25])
