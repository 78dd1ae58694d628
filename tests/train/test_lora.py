"""The LoRA baseline's merged weights, which are what the rollout engines receive."""

import pytest
import torch

from logra_rl.config import OptimizerConfig
from logra_rl.logra import merge_adapters
from logra_rl.train.lora import adapter_state, add_lora, lora_layers, merged_state
from tests.tiny_models import tiny_qwen3


def test_merged_state_equals_peft_merge_and_unload():
    config = OptimizerConfig(name="lora", lora_rank=4, lora_alpha=8.0)
    model = add_lora(tiny_qwen3(seed=2), config, ("q_proj", "down_proj", "lm_head"))
    torch.manual_seed(0)
    for layer in lora_layers(model).values():  # B starts at 0: give every adapter a real update
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    merged = merged_state(state, config.lora_alpha / config.lora_rank)
    expected = model.merge_and_unload().state_dict()

    assert sorted(merged) == sorted(expected)  # HF names, no adapter tensors
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)
    base = tiny_qwen3(seed=2).state_dict()
    assert not torch.equal(merged["lm_head.weight"], base["lm_head.weight"])  # the adapters changed them
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])


def test_an_adapter_on_a_tied_output_head_is_refused_with_the_fix():
    config = OptimizerConfig(name="lora", lora_rank=4, lora_alpha=8.0)
    with pytest.raises(ValueError, match=r"tied word embeddings: model.target_modules .* leave it out"):
        add_lora(tiny_qwen3(seed=2, tie_word_embeddings=True), config, ("q_proj", "lm_head"))
    add_lora(tiny_qwen3(seed=2, tie_word_embeddings=True), config, ("q_proj",))  # the layers alone are fine


def test_adapter_state_carries_bases_and_adapters_that_merge_to_merged_state():
    """What a LoRA run's full resync sends (`adapter_state`), merged as the engines merge it, is the trainer's
    merged weights bit for bit; the bases are the frozen weights."""
    config = OptimizerConfig(name="lora", lora_rank=4, lora_alpha=8.0)
    model = add_lora(tiny_qwen3(seed=2), config, ("q_proj", "down_proj"))
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sent = adapter_state(state)
    assert "model.layers.1.mlp.down_proj.lora_B" in sent and "model.layers.1.mlp.down_proj.weight" in sent
    merged, bases = merge_adapters(sent, config.lora_scaling)
    expected = merged_state(state, config.lora_scaling)
    assert sorted(merged) == sorted(expected)
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    base = tiny_qwen3(seed=2).state_dict()
    assert sorted(bases) == sorted(n for n, _ in lora_layers(model).items())
    assert all(torch.equal(bases[n], base[f"{n}.weight"]) for n in bases)
