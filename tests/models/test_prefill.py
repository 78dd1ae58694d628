"""Prompts run once for the rows that share them: what the KL reads equals one padded forward of the rows."""

import torch

from logra_rl.logra import KLRows, features
from logra_rl.models.prefill import prompt_prefill
from tests.tiny_models import random_batch, tiny_qwen3


def test_rows_after_their_shared_prompts_read_what_one_padded_forward_gives():
    """Three prompts of different lengths, two or three rows each (one of which generated nothing): each prompt runs
    once, each row only its own tokens after it, at its own positions, attending to its prompt but not the prompt
    batch's padding; every position whose prediction a KL reads equals the padded forward's."""
    model = tiny_qwen3(seed=5)
    prompts = [random_batch(1, length, seed=length)[0] for length in (5, 9, 7)]
    shapes = [(0, 6), (0, 12), (1, 3), (1, 0), (2, 10), (1, 7), (2, 4)]  # (prompt, generated tokens)
    width = max(len(prompts[p]) + n for p, n in shapes)
    ids = random_batch(len(shapes), width, seed=1)
    mask = torch.zeros_like(ids)
    for row, (p, n) in enumerate(shapes):
        ids[row, : len(prompts[p])] = prompts[p]
        mask[row, len(prompts[p]) : len(prompts[p]) + n] = 1
    tokens = []

    def forward(input_ids, attention_mask=None, **cached):
        tokens.append(input_ids.numel())
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **cached).logits

    rows = KLRows(forward, ids, mask, prefill=prompt_prefill(forward, model.config))
    shared = features(rows, overhead=4)
    with torch.no_grad():
        padded = model(input_ids=ids).logits
    read = mask[:, 1:].bool()  # the logits at p predict token p + 1
    torch.testing.assert_close(shared[:, :-1][read], padded[:, :-1][read], rtol=1e-5, atol=1e-5)
    assert tokens[0] == 3 * 9  # the three prompts, once each
    assert sum(tokens[1:]) < sum(n for _, n in shapes) + 3 * 4 < len(shapes) * width  # the rows' own tokens
