"""scripts/tools/compare_metrics.py: two runs equal in every value but time and memory, old names read as today's;
one changed value, or a metric only one run has, is a difference (exit 1)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "compare_metrics.py"


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True, check=False)


def test_a_run_before_the_renames_equals_the_same_run_after_them(tmp_path):
    old = write(
        tmp_path / "old.jsonl",
        [{"step": 0, "actor/loss": 0.5, "sync/weight_max_abs_diff": 0.0, "timing_s/step": 1.0, "memory/x": 2.0}],
    )
    new = write(
        tmp_path / "new.jsonl",
        [{"step": 0, "train/loss": 0.5, "sync/drift": 0.0, "timing_s/step": 9.0, "memory/x": 3.0}],
    )
    result = compare(old, new)
    assert result.returncode == 0, result.stdout
    assert "2 values compared" in result.stdout and "equal" in result.stdout


def test_a_changed_value_and_a_missing_metric_are_differences(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"step": 0, "train/loss": 0.5, "reward/mean": 0.1}])
    b = write(tmp_path / "b.jsonl", [{"step": 0, "train/loss": 0.5000001}])
    result = compare(a, b)
    assert result.returncode == 1
    assert "step 0 train/loss: 0.5 | 0.5000001" in result.stdout
    assert "step 0 reward/mean: 0.1 | absent" in result.stdout
    assert "2 differences" in result.stdout
