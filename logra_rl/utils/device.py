"""The one place a process picks its torch device (called inside each Ray actor, never on the driver:
a CPU-only head node must not decide for the GPU workers)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`cluster.device` → the device of this process: auto is cuda when this process sees a GPU, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cluster.device=cuda but CUDA is not available in this worker; use cluster.device=auto")
    return torch.device(name, 0) if name == "cuda" else torch.device(name)


def compute_dtype(configured: str, cuda: bool) -> str:
    """`model.compute_dtype` with auto resolved: bf16 on a GPU, fp32 on a CPU (the master weights are fp32)."""
    return ("bfloat16" if cuda else "float32") if configured == "auto" else configured
