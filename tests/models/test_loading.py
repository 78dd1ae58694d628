"""What the driver reads from a checkpoint before any actor starts."""

import shutil

import torch
from transformers import AutoModelForCausalLM

from logra_rl.models.loading import converts_exactly


def save_as(source: str, destination, dtype: torch.dtype) -> str:
    """The model at `source` (tokenizer and all) re-saved with its weights in `dtype`."""
    shutil.copytree(source, destination)
    AutoModelForCausalLM.from_pretrained(source, dtype=dtype).save_pretrained(destination)
    return str(destination)


def test_a_checkpoint_converts_exactly_to_its_own_dtype_and_to_float32(tmp_path, quickstart_model):
    bf16 = save_as(quickstart_model, tmp_path / "bf16", torch.bfloat16)
    assert converts_exactly(bf16, "bfloat16") and converts_exactly(bf16, "float32")
    assert not converts_exactly(bf16, "float16")  # bf16's range and float16's precision differ
    fp32 = save_as(quickstart_model, tmp_path / "fp32", torch.float32)
    assert converts_exactly(fp32, "float32") and not converts_exactly(fp32, "bfloat16")
    assert not converts_exactly(str(tmp_path), "float32")  # no safetensors: it cannot tell
