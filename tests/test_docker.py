"""The GPU image cannot be built here (no docker engine, no registry): check the Dockerfile for what it
must contain to build and run on a GPU node."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_image_has_a_cuda_13_runtime_the_gpu_extra_and_the_scripts():
    steps = instructions()
    base = [args for op, args in steps if op == "FROM"]
    assert len(base) == 1 and re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d\d\.\d\d", base[0])
    copied = [args.split()[0] for op, args in steps if op == "COPY"]
    assert {"pyproject.toml", "logra_rl", "scripts"} <= set(copied)
    installs = " ".join(args for op, args in steps if op == "RUN")
    assert 'pip install ".[gpu]"' in installs and "python3-venv" in installs
    assert ("ENTRYPOINT", '["logra-train"]') in steps


def test_the_gpu_extra_pins_the_vllm_the_image_is_built_for():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["gpu"] == ["vllm==0.33.0"]
    assert "driver ≥ 580" in (REPO / "docs" / "gpu.md").read_text()  # the floor vLLM 0.33's CUDA 13 needs
