"""The GPU image cannot be built here (no docker engine, no registry): check the Dockerfile for what it
must contain to build and run on a GPU node."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

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
    assert ("ENTRYPOINT", '["logra-entrypoint", "logra-train"]') in steps
    assert ("COPY", "docker/entrypoint.sh /usr/local/bin/logra-entrypoint") in steps
    assert "cuda-compat-13-0" in installs  # forward compatibility for 535 / 570 hosts


def test_the_gpu_extra_pins_the_vllm_the_image_is_built_for():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["gpu"] == ["vllm==0.33.0"]
    assert "driver ≥ 580" in (REPO / "docs" / "gpu.md").read_text()  # the floor vLLM 0.33's CUDA 13 needs


def test_the_image_states_the_host_driver_it_needs():
    """`docker inspect` shows it: CUDA 13 needs a host driver of 580 or newer (the run's start-up check names the
    driver found when it is older)."""
    labels = " ".join(args for op, args in instructions() if op == "LABEL")
    assert 'logra-rl.requires.nvidia-driver=">=580, or 535 / 570 on data-centre GPUs' in labels
    assert "NVIDIA driver >= 580" in labels


@pytest.mark.parametrize(
    ("driver", "compat"),
    [("535.104.05", True), ("550.54.15", False), ("570.86.10", True), ("580.65.06", False), (None, False)],
)
def test_the_entrypoint_uses_the_forward_compatibility_libraries_only_on_the_driver_branches_they_serve(
    tmp_path, driver, compat
):
    """NVIDIA's matrix: cuda-compat-13-0 runs on the 535 and 570 branches, is not needed on 580 and newer, and
    does not serve 550 (end of life). No NVIDIA driver (no /proc file): nothing changes."""
    version = tmp_path / "version"
    if driver:
        version.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Release Build  (dvs-builder)\n")
    (tmp_path / "compat").mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "LD_LIBRARY_PATH": "/opt/lib",
        "LOGRA_NVIDIA_VERSION_FILE": str(version),
        "LOGRA_CUDA_COMPAT": str(tmp_path / "compat"),
    }
    entrypoint = REPO / "docker" / "entrypoint.sh"
    shown = ["sh", str(entrypoint), "sh", "-c", "echo $LD_LIBRARY_PATH"]
    result = subprocess.run(shown, env=env, capture_output=True, text=True, check=True)
    expected = f"{tmp_path / 'compat'}:/opt/lib" if compat else "/opt/lib"
    assert result.stdout.strip() == expected
    assert ("forward-compatibility libraries" in result.stderr) == compat
