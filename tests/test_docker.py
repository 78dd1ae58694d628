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


def test_the_image_has_cuda_13_with_nvcc_the_gpu_extra_and_the_scripts():
    steps = instructions()
    base = [args for op, args in steps if op == "FROM"]
    # devel: FlashInfer (from vLLM's PyPI wheel, without prebuilt kernels) compiles with nvcc at run time
    assert len(base) == 1 and re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-(cudnn-)?devel-ubuntu\d\d\.\d\d", base[0])
    assert "ninja-build" in " ".join(args for op, args in steps if op == "RUN")
    copied = [args.split()[0] for op, args in steps if op == "COPY"]
    assert {"pyproject.toml", "logra_rl", "scripts"} <= set(copied)
    installs = " ".join(args for op, args in steps if op == "RUN")
    assert 'pip install ".[gpu]"' in installs and "python3-venv" in installs
    assert ("ENTRYPOINT", '["logra-train"]') in steps


def test_the_gpu_extra_pins_the_vllm_the_image_is_built_for():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["gpu"] == ["vllm==0.33.0"]
    assert "driver ≥ 580" in (REPO / "docs" / "gpu.md").read_text()  # the floor vLLM 0.33's CUDA 13 needs


def test_the_image_states_the_host_driver_it_needs():
    """`docker inspect` shows it: CUDA 13 needs a host driver of 580 or newer (the run's start-up check names the
    driver found when it is older)."""
    labels = " ".join(args for op, args in instructions() if op == "LABEL")
    assert 'logra-rl.requires.nvidia-driver=">=580"' in labels and "NVIDIA driver >= 580" in labels
