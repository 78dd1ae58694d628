"""scripts/bench/bench_methods.py's accounting, on run directories written here: pass@1 over seeds, the cumulative
KL at each eval (the updates before it), pass@1 at equal cumulative KL, and a longer run cut at the asked steps."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_methods.py"


def write_run(path: Path, kl: list[float], pass1: dict[int, float]) -> None:
    """A run of len(kl) steps (an eval record at each key of pass1; step len(kl) is the final eval only)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("data:\n  task: products\neval:\n  samples: 4\n")
    records = []
    for step in range(len(kl) + 1):
        record: dict = {"step": step}
        if step < len(kl):
            record |= {"reward/mean": 0.1 * step, "train/kl_realized": kl[step], "timing_s/step": 10.0 + step}
            record |= {"memory/train_avg_gib": 2.0, "memory/train_peak_gib": 3.0 + step, "train/skipped": 0.0}
        if step in pass1:
            record |= {"eval/products/pass@1": pass1[step], "eval/products/pass@4": min(1.0, 2 * pass1[step])}
            record |= {"eval/products/pass@1_stderr": 0.01 + 0.01 * step}
        records.append(record)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_report_means_seeds_and_compares_at_equal_cumulative_kl(tmp_path):
    out = tmp_path / "bench"
    write_run(out / "runs/a/seed1", [0.01, 0.01, 0.01, 0.01], {0: 0.4, 2: 0.6, 4: 0.8})
    write_run(out / "runs/a/seed2", [0.03, 0.01, 0.01, 0.01], {0: 0.4, 2: 0.5, 4: 0.7})
    write_run(out / "runs/b/seed1", [0.001] * 6, {0: 0.4, 2: 0.45, 4: 0.5, 6: 0.9})  # longer: cut at 4
    write_run(out / "runs/b/seed2", [0.001] * 4, {0: 0.4, 2: 0.55, 4: 0.6})
    args = ["--report-only", "--steps", "4", "--seeds", "1,2", "--out", str(out), "--arm", "a=", "--arm", "b="]
    args += ["--late-window", "2"]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "methods.json").read_text())
    a, b = report["arms"]["a"], report["arms"]["b"]
    assert sorted(a["evals"]) == sorted(b["evals"]) == ["0", "2", "4"]
    assert a["evals"]["4"]["pass@1"]["mean"] == pytest.approx(0.75)
    assert a["evals"]["4"]["pass@1"]["std"] == pytest.approx(0.0707107, rel=1e-5)
    assert b["evals"]["4"]["pass@1"]["mean"] == pytest.approx(0.55)  # seed 1's step-6 eval is past the cut
    assert a["evals"]["2"]["cumulative_kl"]["mean"] == pytest.approx(0.03)  # seed 1: 0.02, seed 2: 0.04
    assert a["evals"]["4"]["pass@1_stderr"] == pytest.approx(0.05)  # the eval's sampling noise, over seeds
    # the gain over the last 2 steps (eval 2 → 4): a's seeds +0.2 each, b's +0.05 each
    assert a["late_gain"]["mean"] == pytest.approx(0.2) and b["late_gain"]["mean"] == pytest.approx(0.05)
    assert b["evals"]["4"]["cumulative_kl"]["mean"] == pytest.approx(0.004)
    # equal KL: b's final 0.004 is the smaller; a's mean curve (0 → 0.4, 0.03 → 0.55) gives 0.42 there
    assert report["pass@1_at_equal_kl"] == pytest.approx({"kl": 0.004, "a": 0.42, "b": 0.55})
    # train reward (3-step mean, one point per step) at the largest KL every run reached: b's 0.003 before step 3;
    # a: 0.05 at KL 0 and 0.1 at its step 1 (KL 0.01, seed 2: 0.03), so 0.065 and 0.055 there; b: 0.25 (steps 2, 3)
    reward = report["train_reward_at_equal_kl"]
    assert reward["kl"] == pytest.approx(0.003)
    assert reward["a"]["mean"] == pytest.approx(0.06) and reward["b"]["mean"] == pytest.approx(0.25)
    assert b["train_memory_peak_gib"]["mean"] == pytest.approx(6.0)  # max over steps 0..3, not the cut steps
    assert a["updates_per_hour"]["mean"] == pytest.approx(3600 / 12.0)  # median step time over steps 1..3
    assert (out / "methods.png").stat().st_size > 10_000


def test_a_bad_arm_names_the_form_it_takes():
    spec = importlib.util.spec_from_file_location("bench_methods", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_arms(["dense=optimizer=dense"], "smollm2") == {"dense": "optimizer=dense"}
    assert module.parse_arms([], "smollm2")["lora"] == "+experiment=smollm2_lora"  # the tuned baseline's preset
    with pytest.raises(SystemExit, match=r'LABEL="key=value \.\.\."'):
        module.parse_arms(["optimizer.lr"], "smollm2")
