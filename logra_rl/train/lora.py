"""The LoRA baseline (`optimizer=lora`) through peft: adapters trained with AdamW, merged for the engines.

The rollout engines run the plain model with merged weights W + scale·B·A (`adapter_change`: one fp32
rounding of a float64 product, the same bits wherever it is computed). They hold each target's base W;
after an update they get the adapters (`AdapterPayload`, r·(d_out + k_in) values per module) and set the
target from its base, so a LoRA run sends no full resync in steady state. A full resync sends the base
weights with their adapters (`adapter_state`); the trainer's drift check compares at the merged values.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from logra_rl.config import OptimizerConfig
from logra_rl.logra import AdapterEntry, AdapterPayload, find_targets, merge_adapters
from logra_rl.utils.shards import full_tensor

PEFT_PREFIX = "base_model.model."


def add_lora(model: nn.Module, config: OptimizerConfig, target_modules: tuple[str, ...]) -> PeftModel:
    """Freeze `model` and wrap its `target_modules` linears with rank-`lora_rank` adapters (fp32, no dropout).

    The adapters go on the modules `find_targets` picks, named in full: peft's own matching by the last name
    component would also wrap a multimodal model's vision tower. An output head tied to the input embeddings
    cannot take one: the merged head would no longer be the embedding the engines share it with."""
    targets = find_targets(model, target_modules)
    head = model.get_output_embeddings()
    if model.config.get_text_config().tie_word_embeddings and any(module is head for _, module in targets):
        raise ValueError(
            f"LoRA adapters on the output head of a model with tied word embeddings: model.target_modules "
            f"{list(target_modules)} names it; leave it out (LoGRA may train it: its updates move both)"
        )
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=[name for name, _ in targets],
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


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft model's state dict (or part of it) → HF names, each adapted module's base weight under its own name
    and its adapters as `{module}.lora_A` / `{module}.lora_B` (what a full resync sends a LoRA run's engines)."""
    renamed = {}
    for key, value in state.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.default.weight", f".{part}")
        renamed[name.replace(".base_layer.", ".")] = value
    return renamed


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft model's full state dict → HF names with every adapter merged: W + scaling·B·A."""
    return merge_adapters(adapter_state(state), scaling)[0]


def adapter_payload(layers: dict[str, nn.Module], base_version: int, scaling: float, rank: int) -> AdapterPayload:
    """The adapters after an update, as the engines get them (a collective over FSDP2's shards: every rank calls
    it; every rank gets the full payload)."""
    entries = []
    for name, layer in layers.items():
        b = full_tensor(layer.lora_B["default"].weight).detach().float().cpu()
        a = full_tensor(layer.lora_A["default"].weight).detach().float().cpu()
        entries.append(AdapterEntry(name, b.shape[0], a.shape[1], b, a))
    return AdapterPayload(base_version, base_version + 1, rank, scaling, tuple(entries))
