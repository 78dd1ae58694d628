"""The LM head: on the last position of each row it gets a contiguous (rows × hidden) input; a frozen copy keeps
the logits of the policy before a step."""

import torch

from logra_rl.models.head import LMHead, fold_head_inputs
from tests.tiny_models import random_batch, tiny_qwen3


def test_the_head_of_the_last_positions_gets_a_contiguous_input_and_the_same_logits():
    model = tiny_qwen3(hidden_size=128).to(torch.bfloat16)  # as the engines hold it
    ids = random_batch(16, 40)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        expected = model(input_ids=ids, logits_to_keep=1).logits
        fold_head_inputs(model)
        logits = model(input_ids=ids, logits_to_keep=1).logits
    # HF slices hidden[:, -1:, :] out of the batch: strided, which at Qwen2.5-1.5B's size made torch's matmul
    # copy the (vocab x hidden) weight once per row (1.9 GB for 4 rows; docs/benchmarks.md §12)
    assert seen == [False, True]
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_a_frozen_head_keeps_the_logits_of_the_head_before_a_step():
    """`LMHead.frozen()` copies the head (soft-cap included): after the head moves (a dense step), the copy still
    gives the logits of the policy before it, which the KL of that step is measured against."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 11)
    head = LMHead(linear, softcap=5.0)
    states = torch.randn(3, 8)
    before = head(states)
    assert before.abs().max() < 5.0  # capped
    frozen = head.frozen()
    with torch.no_grad():
        linear.weight.add_(1.0)
        linear.bias.add_(1.0)
    torch.testing.assert_close(frozen(states), before, rtol=0, atol=0)
    assert not torch.allclose(head(states), before)
    assert frozen(states.to(torch.bfloat16)).dtype == torch.bfloat16  # applied in the dtype of the states
