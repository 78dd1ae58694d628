"""Turn a run checkpoint (sharded torch.distributed.checkpoint state) into an HF model directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.config import RunConfig
from logra_rl.train.lora import PEFT_PREFIX, merged_state


def export_checkpoint(checkpoint: str | Path, base_model: str | None, out: str | Path) -> Path:
    """Write `checkpoint`'s weights (LoRA adapters merged) as an HF model + tokenizer under `out`.

    `base_model` gives the architecture and tokenizer; by default the run's own base model
    (`<run>/base_model`, built by the quickstart) next to `<run>/checkpoints/step_N`.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / "model").is_dir():
        raise FileNotFoundError(f"{checkpoint} is not a logra-train checkpoint (expected a model/ directory inside)")
    run_dir = checkpoint.resolve().parents[1]
    base_model = base_model or str(run_dir / "base_model")
    with tempfile.TemporaryDirectory() as scratch:
        state_file = Path(scratch) / "state.pt"
        dcp_to_torch_save(checkpoint / "model", state_file)
        state = torch.load(state_file, weights_only=False)["model"]
    if any(key.startswith(PEFT_PREFIX) for key in state):  # a LoRA run: merge with the run's own scale
        run_config = RunConfig.from_mapping(OmegaConf.load(run_dir / "config.yaml"))
        state = merged_state(state, run_config.optimizer.lora_scaling)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out
