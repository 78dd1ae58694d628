"""Tiny models built in the test process (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 101


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """Qwen3 shape used across tests: head_dim 32 and untied embeddings, as vLLM CPU needs."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    values.update(overrides)
    return Qwen3Config(**values)


def tiny_qwen3(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    """A float32 tiny Qwen3 with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).float()
    return model.eval()


def random_batch(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def token_sum_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over tokens (the sketches are later divided by the token count)."""
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum"
    )
