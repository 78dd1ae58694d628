import torch

from logra_rl.train.batch import TrainBatch


def batch_of(lengths, width=10):
    rows = len(lengths)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
    ids = torch.arange(rows * width).view(rows, width) * attention
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=attention.float(),
        rollout_logprobs=torch.zeros(rows, width),
        advantages=torch.arange(rows, dtype=torch.float32),
        finished=torch.ones(rows, dtype=torch.bool),
    )


def test_microbatches_respect_the_token_budget_and_keep_every_row_once():
    batch = batch_of([3, 4, 2, 8, 1, 3])
    micro = batch.microbatches(max_tokens=8)
    assert [len(m) for m in micro] == [2, 1, 1, 2]  # a row longer than the budget stands alone
    assert all(m.input_ids.numel() <= 8 or len(m) == 1 for m in micro)
    assert torch.cat([m.advantages for m in micro]).tolist() == batch.advantages.tolist()
    assert [m.input_ids.shape[1] for m in micro] == [4, 2, 8, 3]  # trailing padding trimmed
