"""logra-plot on three small run directories written by hand."""

from pathlib import Path

import matplotlib.image
import pytest

from logra_rl.apps.plot import Run, default_labels, plot_main
from tests.plot_runs import guarded_records, kl_axis, legend, lines, logra_records, train_record, write_run


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
