"""A tiny Qwen3 and a character-level tokenizer with a chat template, built offline.

The CPU quickstart and the tests need a real HF model directory (loadable by AutoModel /
AutoTokenizer and by vLLM CPU) without downloading anything. Qwen3, not Qwen2: transformers
swaps a Qwen2 config's tokenizer for Qwen2Tokenizer. head_dim ≥ 32 and untied embeddings keep
the directory usable by vLLM's CPU backend.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

from logra_rl.data import quickstart

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
ROLE_TOKENS = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(alphabet: str = string.digits + string.ascii_letters + string.punctuation + " \n"):
    """One token per character of `alphabet`, plus chat specials and whole-word role names."""
    tokens = SPECIAL_TOKENS + ROLE_TOKENS + [c for c in dict.fromkeys(alphabet)]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS + ROLE_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """A randomly initialised float32 Qwen3 sized for `tokenizer`."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_quickstart_model(
    directory: str | Path, hidden_size: int = 256, seed: int = 0, format_steps: int = 100, copy_share: float = 0.0
) -> Path:
    """Write the quickstart's base model: a tiny Qwen3 pre-trained on the answer format only.

    Pre-training teaches "one digit, then end of turn" with *random* digits, so the model
    starts at chance on the task (1 in 10) and RL has to learn the answers themselves. With
    `copy_share`, that share of the rows is `"{a}+0=?"` answered `a` instead: the model then reads the
    prompt's digit, as a pre-trained LLM reads its prompt, and is still at chance on `"{a}+1=?"` (it needs
    ~600 steps to learn the copy).
    """
    if not 0 <= copy_share <= 1:
        raise ValueError(f"copy_share must be in [0, 1], got {copy_share}")
    directory = Path(directory)
    tokenizer = char_tokenizer(quickstart.ALPHABET)
    model = tiny_model(tokenizer, hidden_size=hidden_size, seed=seed)
    rng = random.Random(seed)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(format_steps):
        rows = []
        for _ in range(32):
            a = rng.randrange(10)
            copy = copy_share > 0 and rng.random() < copy_share  # no draw without copies: the same model as before
            messages = [{"role": "user", "content": f"{a}+0=?" if copy else quickstart.prompt_text(a)}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            rows.append([*prompt, digits[a] if copy else rng.choice(digits), tokenizer.eos_token_id])
        input_ids = torch.tensor(rows)
        logits = model(input_ids=input_ids).logits[:, -3:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, -2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
