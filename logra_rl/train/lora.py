"""The LoRA baseline (`optimizer=lora`) through peft: adapters trained with AdamW, merged for the engines.

The rollout engines receive merged weights W + scale·B·A by full resync after every update, so
they run the plain model; the trainer's drift check compares at the same merged values.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from logra_rl.config import OptimizerConfig
from logra_rl.logra import find_targets

PEFT_PREFIX = "base_model.model."


def add_lora(model: nn.Module, config: OptimizerConfig, target_modules: tuple[str, ...]) -> PeftModel:
    """Freeze `model` and wrap its `target_modules` linears with rank-`lora_rank` adapters (fp32, no dropout).

    The adapters go on the modules `find_targets` picks, named in full: peft's own matching by the last name
    component would also wrap a multimodal model's vision tower."""
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=[name for name, _ in find_targets(model, target_modules)],
        lora_dropout=0.0,
        bias="none",
    )
    return get_peft_model(model, lora)


def lora_layers(model: PeftModel) -> dict[str, nn.Module]:
    """HF module name → peft LoRA layer (holding base_layer, lora_A, lora_B, scaling)."""
    return {
        name.removeprefix(PEFT_PREFIX): module
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "lora_A")
    }


def is_adapter(key: str) -> bool:
    """A LoRA adapter's own tensor (merged away before weights reach the engines)."""
    return ".lora_A." in key or ".lora_B." in key


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft model's full state dict → HF names with every adapter merged: W + scaling·B·A."""
    merged = {}
    for key, value in state.items():
        name = key.removeprefix(PEFT_PREFIX)
        if is_adapter(name):
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            if name.endswith(".weight"):
                a = state[f"{PEFT_PREFIX}{module}.lora_A.default.weight"].float()
                b = state[f"{PEFT_PREFIX}{module}.lora_B.default.weight"].float()
                value = value + scaling * (b @ a)
            name = name.replace(".base_layer.", ".")
        merged[name] = value
    return merged
