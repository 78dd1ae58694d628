"""Sampled-token log-probs: from logits in chunks, and from hidden states through the LM head in chunks."""

import math

import torch

import logra_rl.rl.logprobs as logprobs


def test_token_logprobs_in_chunks_equal_the_full_log_softmax(monkeypatch):
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK_BYTES", 6 * 4 * 11)  # 3 positions of each of the 2 rows
    logits = torch.randn(2, 8, 11)
    ids = torch.randint(0, 11, (2, 8))
    expected = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.token_logprobs(logits, ids, 0.7), expected)


def test_head_logprobs_in_chunks_equal_the_full_logits_values_and_gradients(monkeypatch):
    """Chunked and recomputed in backward, the LM-head path gives the full-logits log-probs and the same
    gradients for the hidden states and the head's weight and bias."""
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK_BYTES", 3 * 4 * 13)  # 3 positions of a 13-token vocabulary
    assert logprobs.logprob_chunk(13) == 3
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 13)
    hidden = torch.randn(10, 6)
    targets = torch.randint(0, 13, (10,))
    weights = torch.randn(10)  # a loss that weighs tokens differently, like advantages do
    bonus = torch.randn(10)  # and the entropies (an entropy bonus)
    results = []
    for chunked in (True, False):
        head.zero_grad()
        states = hidden.clone().requires_grad_(True)
        if chunked:
            values, entropy = logprobs.head_logprobs(states, head, targets, 0.7, 13, entropy_grad=True)
        else:
            log_softmax = torch.log_softmax(head(states) / 0.7, -1)
            values = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        (values * weights + entropy * bonus).sum().backward()
        results.append((values.detach(), entropy.detach(), states.grad, head.weight.grad.clone(), head.bias.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results[0][0].shape == (10,) and results[0][2].abs().sum() > 0
    assert (results[0][1] > 0).all() and (results[0][1] < math.log(13)).all()


def test_the_entropy_is_a_metric_without_a_graph_unless_asked():
    """Without `entropy_grad` the entropies carry no gradient (the loss has no entropy term: nothing is kept for a
    backward through them); the log-probs still do."""
    head = torch.nn.Linear(6, 13)
    states = torch.randn(5, 6, requires_grad=True)
    targets = torch.randint(0, 13, (5,))
    values, entropy = logprobs.head_logprobs(states, head, targets, 1.0, 13)
    assert values.requires_grad and not entropy.requires_grad
    alone, none = logprobs.head_logprobs(states, head, targets, 1.0, 13, with_entropy=False)  # log-probs only
    assert none is None and torch.equal(alone, values)


def test_head_logprobs_of_no_tokens_keep_the_graph():
    """A microbatch with no loss tokens still backpropagates (zeros) through the model: FSDP2 needs every rank
    to run the same backward collectives."""
    head = torch.nn.Linear(4, 5)
    states = torch.randn(0, 4, requires_grad=True)
    values, _ = logprobs.head_logprobs(states, head, torch.zeros(0, dtype=torch.long), 1.0, 5)
    values.sum().backward()
    assert values.shape == (0,) and states.grad.shape == (0, 4) and torch.equal(head.weight.grad, torch.zeros(5, 4))
