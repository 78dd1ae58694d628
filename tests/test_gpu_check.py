"""scripts/gpu_check.py in CPU mode, as the lent GPU machine would run it: without Hydra, OmegaConf, Ray,
vLLM or the data and grading packages (hidden from the interpreter here), every check asserted."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def test_cpu_mode_runs_without_the_cluster_packages_and_asserts_its_checks(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # not the project: the script finds it itself
    probe = subprocess.run([sys.executable, "-c", "import omegaconf"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'omegaconf'" in probe.stderr  # the double works
    script = REPO / "scripts" / "gpu_check.py"
    command = [sys.executable, str(script), "--device", "cpu", "--small", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert figures["failed_checks"] == []
    assert figures["worker_state_exact"] and figures["worker_buckets_exact"]
    assert figures["worker_logprob_max_abs_diff"] <= 1e-3
    assert 0 < figures["sketch_rel_error_bf16"] < 0.05
    assert figures["apply r=16 exact"] and figures["apply r=64 exact"] and figures["projection_device_exact"]
    for key in ("kl_fd_bf16_over_jvp_fp32", "kl_realized_bf16_over_fp32", "kl_guard_bf16_over_fp32"):
        assert 0.8 <= figures[key] <= 1.25, key


def test_a_failed_check_is_one_line():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    good = {
        "worker_state_exact": True,
        "worker_buckets_exact": True,
        "worker_logprob_max_abs_diff": 0.0,
        "sketch_rel_error_bf16": 0.01,
        "apply r=16 exact": True,
        "peak_gib dense": 10.0,
        "peak_gib logra r=64": 4.0,
        "projection_device_exact": True,
        "kl_fd_bf16_over_jvp_fp32": 0.97,
        "kl_realized_bf16_over_fp32": 1.0,
        "kl_guard_bf16_over_fp32": 1.02,
        "cuda_graph_sees_merge": True,
    }
    assert gpu_check.failed_checks(good, cuda=True) == []
    bad = {**good, "apply r=16 exact": False, "peak_gib logra r=64": 12.0, "sketch_rel_error_bf16": float("nan")}
    bad |= {"kl_fd_bf16_over_jvp_fp32": 60.0, "cuda_graph_sees_merge": False}
    failed = gpu_check.failed_checks(bad, cuda=True)
    assert len(failed) == 5 and any("apply r=16 exact" in line for line in failed)
    assert any("kl_fd_bf16_over_jvp_fp32 = 60" in line for line in failed)
    assert any("CUDA graph" in line for line in failed)
    assert any("not below dense" in line for line in failed) and any("sketch error nan" in line for line in failed)
