"""Tiny models built in the test process (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

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


def tiny_gemma3_multimodal(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, seed: int = 0):
    """A randomly initialised float32 `Gemma3ForConditionalGeneration` sized for `tokenizer`: the official
    Gemma 3 checkpoints' class, its text decoder under `model.language_model` beside a (one-layer) vision tower."""
    specials = len(tokenizer)  # the image tokens follow the text vocabulary
    text = dict(
        vocab_size=specials + 3,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = Gemma3Config(
        text_config=text,
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=specials,
        eoi_token_index=specials + 1,
        image_token_index=specials + 2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
