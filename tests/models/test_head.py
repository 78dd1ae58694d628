"""The LM head on the last position of each row gets a contiguous (rows × hidden) input, the same logits."""

import torch

from logra_rl.models.head import fold_head_inputs
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
