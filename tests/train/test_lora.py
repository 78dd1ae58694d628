"""The LoRA baseline's merged weights, which are what the rollout engines receive."""

import torch

from logra_rl.config import OptimizerConfig
from logra_rl.train.lora import add_lora, is_adapter, lora_layers, merged_state
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
    assert not any(is_adapter(k) for k in merged)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)
    base = tiny_qwen3(seed=2).state_dict()
    assert not torch.equal(merged["lm_head.weight"], base["lm_head.weight"])  # the adapters changed them
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
