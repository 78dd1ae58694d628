"""A model's footprint from its config alone: parameter counts, and the activations a layer saves, traced on the
meta device and compared with what a real layer saves on the CPU."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from logra_rl.logra import DEFAULT_TARGET_MODULES
from logra_rl.models.footprint import TRACE_TOKENS, model_footprint
from tests.tiny_models import tiny_qwen3_config


@pytest.mark.parametrize("tied", [False, True])
def test_counts_are_the_models_own(tmp_path, tied):
    config = tiny_qwen3_config(tie_word_embeddings=tied, num_hidden_layers=3)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    footprint = model_footprint(str(tmp_path), DEFAULT_TARGET_MODULES, "float32")

    assert footprint.params == sum(p.numel() for p in model.parameters())  # a tied head once
    assert footprint.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    embedding = config.vocab_size * config.hidden_size
    assert footprint.root_params == embedding * (1 if tied else 2) + config.hidden_size  # + the final norm
    assert len(footprint.targets) == 7 * 3 and footprint.target_params == 3 * sum(
        m.weight.numel()
        for name, m in model.model.layers[0].named_modules()
        if name.split(".")[-1] in DEFAULT_TARGET_MODULES
    )
    assert footprint.checkpoint_bytes == 2  # bf16 as stored
    # key + value of 2 KV heads x 32 channels x 3 layers, in bf16; on 2 TP ranks one KV head each
    assert footprint.kv_bytes_per_token(2) == 2 * 3 * 2 * 32 * 2
    assert footprint.kv_bytes_per_token(2, tensor_parallel=2) == 2 * 3 * 1 * 32 * 2
    assert footprint.kv_bytes_per_token(2, tensor_parallel=4) == 2 * 3 * 1 * 32 * 2  # KV heads replicate


def saved_by_a_real_layer(config, trainable: bool) -> int:
    """Bytes a CPU decoder layer saves for backward over TRACE_TOKENS tokens (SDPA's fused CPU kernel)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    model.requires_grad_(trainable)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hidden = torch.randn(1, TRACE_TOKENS, config.hidden_size, requires_grad=True)
    positions = torch.arange(TRACE_TOKENS)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    return sum(saved.values())


@pytest.mark.parametrize("trainable", [False, True])
def test_the_meta_trace_is_what_a_real_layer_saves(tmp_path, trainable):
    config = tiny_qwen3_config(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    footprint = model_footprint(str(tmp_path), DEFAULT_TARGET_MODULES, "float32")
    traced = footprint.saved_trainable if trainable else footprint.saved_frozen
    assert traced * TRACE_TOKENS == saved_by_a_real_layer(config, trainable)
    # frozen weights keep no inputs for their gradients: what LoGRA's activations save on dense's
    assert footprint.saved_frozen < footprint.saved_trainable
