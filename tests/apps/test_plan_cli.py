"""`logra-plan +experiment=PRESET` plans a GPU preset from any machine: no weights, no GPU, no hub."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOGRA_PLAN = str(Path(sys.executable).with_name("logra-plan"))
# No GPU here whatever the machine has (the plan is the preset's node's), and rich's lines unwrapped.
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "200"}


def logra_plan(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run([LOGRA_PLAN, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)
    return result, time.perf_counter() - start


@pytest.mark.parametrize(
    ("preset", "model", "train_gpu_gib", "rollout_gpu_gib"),
    [  # docs/gpu.md, "What fits": LoGRA's need per train GPU and per rollout GPU on 8×H100-80GB
        ("dapo_math_7b", "Qwen/Qwen2.5-7B", "28.82", "52.75"),
        ("reasoning_gym_hard_27b", "google/gemma-3-27b-it", "69.47", "52.52"),
    ],
)
def test_a_gpu_preset_is_planned_from_its_models_known_shape(tmp_path, preset, model, train_gpu_gib, rollout_gpu_gib):
    result, seconds = logra_plan(f"+experiment={preset}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    train = next(line for line in lines if "each train GPU needs" in line)
    rollout = next(line for line in lines if "each rollout GPU needs" in line)
    assert train_gpu_gib in train and "80.0 GiB available fits" in train
    assert rollout_gpu_gib in rollout and "fits" in rollout
    assert f"- planned from the known shape of {model}; no weights read" in lines
    assert any(line.startswith(f"- planned for the GPU node {preset} is made for") for line in lines)
    assert "Traceback" not in result.stderr and "huggingface.co" not in result.stderr  # nothing fetched
    assert list(tmp_path.iterdir()) == []  # the model's config lived in a scratch directory
    assert seconds < 20


@pytest.mark.parametrize("path", ["nobody/none", "/models/not-here"])
def test_a_model_neither_local_nor_of_known_shape_is_one_line_naming_the_fix(tmp_path, path):
    result, seconds = logra_plan("+experiment=dapo_math_7b", f"model.path={path}", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"model.path={path} is neither a local directory nor a model of known shape" in line
    assert "Qwen/Qwen2.5-7B" in line and "set model.path to a local HF model directory" in line
    assert seconds < 20
