"""logra-plot on three small run directories written by hand, and plot_run as the trainer calls it."""

import json
from collections.abc import Iterator
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
import yaml

from logra_rl.utils.plot import Run, default_labels, plot_main, plot_run


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


def dense_records() -> list[dict]:
    """10 steps without logra/* keys."""
    records = [
        train_record(s, 0.5, 2.0, **{"memory/train_avg_gib": 3.0, "memory/train_peak_gib": 4.0}) for s in range(10)
    ]
    for record in records:
        record["perf/updates_per_hour"] = 1800.0
    records[0] |= {"eval/gsm8k/pass@1": 0.3, "eval/gsm8k/pass@4": 0.4}
    return [*records, {"step": 10, "eval/gsm8k/pass@1": 0.4, "eval/gsm8k/pass@4": 0.6}]


def short_records() -> list[dict]:
    """Stopped after 6 of 10 steps: no final eval, no memory or speed metrics, an eval at step 0 only."""
    records = [train_record(s, 0.2, 1.0) for s in range(6)]
    records[0] |= {"eval/gsm8k/pass@1": 0.25, "eval/gsm8k/pass@4": 0.5, "train/kl_realized": 0.0}
    return records


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


@pytest.fixture
def figures(monkeypatch) -> Iterator[list]:
    """The figures plot_run and plot_comparison draw, kept open so that a test can read what they show."""
    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for figure in kept:
        close(figure)


def kl_axis(figure) -> plt.Axes:
    return next(axis for axis in figure.axes if axis.get_title().startswith("KL per token"))


def lines(axis: plt.Axes) -> dict[str, tuple[list[float], list[float]]]:
    """(steps, values) of each line of `axis`, by its label."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.lines}


def legend(axis: plt.Axes) -> list[str]:
    return [text.get_text() for text in axis.get_legend().get_texts()]


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    return [
        write_run(tmp_path / "exp" / "logra", "logra", logra_records()),
        write_run(tmp_path / "exp" / "dense", "dense", dense_records()),
        write_run(tmp_path / "exp" / "short", "logra", short_records()),
    ]


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    header, _, *lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown.splitlines()]
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in lines}


def test_compare_three_runs_writes_png_and_table(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert plot_main([*map(str, runs), "--out", str(out), "--smooth", "3"]) == 0
    png = out / "comparison.png"
    assert png.stat().st_size > 10_000
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 500

    markdown = (out / "comparison.md").read_text()
    assert markdown in capsys.readouterr().out
    rows = table_rows(markdown)
    assert list(rows) == ["logra", "dense", "short (logra)"]
    logra, dense, short = rows.values()
    assert (logra["optimizer"], logra["steps"], dense["optimizer"], short["steps"]) == ("logra", "10", "dense", "6/10")
    assert (logra["reward first 5"], logra["reward last 5"]) == ("0.200", "0.700")  # mean of 0..0.4, of 0.5..0.9
    assert (logra["eval pass@1"], logra["eval pass@4"], dense["eval pass@4"]) == ("0.500", "0.800", "0.600")
    assert (short["eval pass@1"], short["eval pass@4"]) == ("0.250 @ step 0", "0.500 @ step 0")
    assert (logra["eval pass@1 at start"], short["eval pass@1 at start"]) == ("0.100", "0.250")
    assert logra["sync KiB/step"] == "3"  # 2 KiB payloads, one 10 KiB resync in 10 steps
    assert (logra["KL realised (mean)"], logra["KL predicted (mean)"]) == ("1.00e-02", "2.00e-02")  # null skipped
    assert dense["KL realised (mean)"] == dense["KL predicted (mean)"] == "—"
    # logra predates the held-out figures and the guard: nothing to count
    assert (logra["held-out KL > 2× budget"], logra["updates refused"]) == ("—", "—")
    assert dense["held-out KL > 2× budget"] == dense["updates refused"] == "—"
    assert (logra["mem avg GiB"], logra["mem peak GiB"], short["mem peak GiB"]) == ("1.25", "2.90", "—")
    assert (logra["updates/h (median)"], dense["updates/h (median)"], short["updates/h (median)"]) == (
        "1,450",
        "1,800",
        "—",
    )
    assert (logra["wall time"], dense["wall time"], short["wall time"]) == ("15.0 s", "20.0 s", "6.0 s")


def test_default_out_dir_labels_and_rerun_over_a_glob(runs, capsys):
    assert plot_main([*map(str, runs), "--labels", "A, B,C"]) == 0
    out = runs[0].parent / "compare"
    assert list(table_rows((out / "comparison.md").read_text())) == ["A", "B", "C"]
    # `logra-plot exp/*` a second time: the glob now includes compare/, which is skipped with a note
    assert plot_main(sorted(str(path) for path in runs[0].parent.iterdir())) == 0
    assert "skipping" in capsys.readouterr().err


def test_bad_inputs_fail_with_one_clear_line(runs, tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    assert plot_main([str(runs[0]), str(empty)]) == 2
    error = capsys.readouterr().err
    assert f"{empty} has no metrics.jsonl" in error and "metrics.jsonl and config.yaml" in error

    assert plot_main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err

    broken = write_run(tmp_path / "broken", "logra", [])
    (broken / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "reward/mean": \n')
    assert plot_main([str(broken)]) == 2
    assert "metrics.jsonl line 2 is not JSON" in capsys.readouterr().err

    assert plot_main([*map(str, runs), "--labels", "a,b"]) == 2
    assert "needs 3 distinct labels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_main([str(runs[0]), "--smooth", "0"])


def test_default_labels_are_unique_across_experiments(tmp_path):
    paths = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "b" / "logra_r64"]
    labels = default_labels([Run(path=path, config={"optimizer": {"name": "logra"}}, records=[]) for path in paths])
    assert labels == ["a/run (logra)", "b/run (logra)", "logra_r64"]


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


def test_table_and_kl_panel_show_the_held_out_kl_against_the_budget_and_refused_updates(tmp_path, figures):
    guarded = write_run(tmp_path / "exp" / "guarded", "logra", guarded_records(), total_steps=8, max_overshoot=2.0)
    old = write_run(tmp_path / "exp" / "old", "logra", logra_records())
    out = tmp_path / "cmp"
    assert plot_main([str(guarded), str(old), "--out", str(out), "--labels", "guarded,old"]) == 0

    rows = table_rows((out / "comparison.md").read_text())
    # held out: 1.2× at step 0, 2.5× at step 4, the next batch's 3× for step 2's update: two past 2× the budget
    assert (rows["guarded"]["held-out KL > 2× budget"], rows["old"]["held-out KL > 2× budget"]) == ("2 / 3", "—")
    assert (rows["guarded"]["updates refused"], rows["old"]["updates refused"]) == ("1", "—")
    assert rows["guarded"]["KL realised (mean)"] == "1.00e-02"  # the refused step has none

    [figure] = figures
    axis = kl_axis(figure)
    assert axis.get_title() == "KL per token: realised, predicted, held out, budget"
    drawn = lines(axis)
    assert drawn["guarded over bound"] == ([2, 4], [0.03, 0.025])  # at the step of the update each measures
    assert "old over bound" not in drawn and "old refused" not in drawn
    assert drawn["guarded refused"] == ([6], [0.01])  # drawn at the budget
    assert drawn["guarded realised"][0] == [0, 1, 2, 3, 4, 5, 7]
    assert drawn["guarded budget δ"] == (list(range(8)), [0.01] * 8)
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker(), line.get_color()) for line in axis.lines}
    assert styles["guarded budget δ"][0] == ":" and styles["guarded predicted (q·α²)"][0] == "--"
    assert styles["guarded over bound"][1:] == ("x", "red")
    assert styles["guarded refused"][2] == styles["guarded realised"][2]  # in the run's colour
    assert legend(axis) == [
        "realised",
        "predicted (q·α²)",
        "budget δ",
        "held out (rows the guard never saw)",
        "held out > 2× budget",
        "update refused (at its budget)",
    ]


def test_kl_legend_of_runs_without_held_out_figures_explains_only_the_lines(runs, tmp_path, figures):
    assert plot_main([*map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    axis = kl_axis(figures[0])
    assert legend(axis) == ["realised", "predicted (q·α²)", "budget δ"]
    assert not any(label.endswith(("over bound", "refused")) for label in lines(axis))


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
    assert staleness["bound 0.1"][1] == [0.1, 0.1]
    assert staleness["sampled again: 1"] == ([3], [0.2])
    assert staleness["async/behaviour_kl"][1] == [0.01] * 6
    [updates] = [axis for axis in figures[0].axes if axis.get_ylabel() == "updates behind"]
    assert list(updates.lines[0].get_ydata()) == [0.0] + [1.0] * 5
