"""The worker extension's start-up choice when in-place merges cannot work (no vLLM needed)."""

import numpy as np
import torch
from transformers import Qwen2Config

from logra_rl.rollout.vllm_worker import LograWorkerExtension


class _Linear(torch.nn.Module):
    def __init__(self, rows, cols, dtype, **attributes):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)
        self.__dict__.update(attributes)


def quantized_model(hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8):
    """A vLLM-shaped one-layer model whose fused QKV weight is int8, like a quantized checkpoint."""
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = _Linear(
        (heads + 2 * kv_heads) * head_dim,
        hidden,
        torch.int8,
        input_size=hidden,
        total_num_heads=heads,
        total_num_kv_heads=kv_heads,
        head_size=head_dim,
        tp_size=1,
        tp_rank=0,
    )
    layer.self_attn.o_proj = _Linear(hidden, heads * head_dim, torch.bfloat16)
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj = _Linear(2 * intermediate, hidden, torch.bfloat16, output_sizes=[intermediate] * 2)
    layer.mlp.down_proj = _Linear(hidden, intermediate, torch.bfloat16)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return model, config


class _FakeWorker(LograWorkerExtension):
    def __init__(self, model, config):
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model})()
        self.model_config = type("ModelConfig", (), {"hf_config": config, "dtype": torch.bfloat16})()


def test_quantized_weights_turn_in_place_merges_off_with_a_reason():
    worker = _FakeWorker(*quantized_model())
    state = worker.logra_init(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "float32", 256
    )
    assert state.mode == "resync" and "model.layers.0.self_attn.qkv_proj.weight" in state.reason
    result = worker.logra_apply(np.frombuffer(b"any payload", dtype=np.uint8))
    assert not result.applied and "packed or quantized" in result.reason
    assert worker.logra_weights_at({"model.layers.0.self_attn.q_proj": (torch.tensor([0]), torch.tensor([0]))}) == {}


def test_an_unknown_layer_layout_fails_closed_to_full_resyncs():
    """A decoder whose layers are not the fused qkv / gate_up layout (here separate q/k/v projections)
    takes no payload: every update becomes a full resync, and the reason names what is missing."""
    model, config = quantized_model()
    layer = model.model.layers[0]
    del layer.self_attn.qkv_proj
    layer.self_attn.q_proj = _Linear(32, 32, torch.bfloat16)
    worker = _FakeWorker(model, config)
    state = worker.logra_init(["q_proj", "o_proj"], "float32", 256)
    assert state.mode == "resync" and "self_attn.qkv_proj" in state.reason
    assert not worker.logra_apply(np.frombuffer(b"any payload", dtype=np.uint8)).applied
    empty = torch.nn.Module()
    refusal = _FakeWorker(empty, config).logra_init(["q_proj"], "float32", 256).reason
    assert "no decoder layers (model.layers)" in refusal
