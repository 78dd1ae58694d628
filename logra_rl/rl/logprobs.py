"""Per-token log-probabilities of the sampled tokens under the policy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

LOGPROB_CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits: bounds the (positions × vocab) temporaries


def logprob_chunk(vocab: int) -> int:
    """Positions per log-softmax chunk: 1365 at SmolLM2's 49k vocabulary, 441 at Qwen2.5's 152k."""
    return max(1, LOGPROB_CHUNK_BYTES // (4 * vocab))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token t | < t) for t ≥ 1, aligned with input_ids[:, 1:] (float32), in position chunks."""
    logits, targets = logits[:, :-1], input_ids[:, 1:, None]
    size = max(1, logprob_chunk(logits.shape[-1]) // max(1, logits.shape[0]))  # positions of every row
    chunks = []
    for start in range(0, targets.shape[1], size):
        chunk = logits[:, start : start + size].float() / temperature
        picked = chunk.gather(-1, targets[:, start : start + size]).squeeze(-1)
        chunks.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(chunks, dim=1)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    vocab: int,
    entropy_grad: bool = False,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(targets[i] | hidden[i]) and the entropy of π(· | hidden[i]) (float32) for final hidden states (N, H)
    through the LM head `head`, at the sampling temperature. The entropy is differentiable with `entropy_grad`
    only (an entropy bonus in the loss); else a metric, at no memory for the backward; None without
    `with_entropy` (a pass that only wants the log-probs skips its softmax).

    The head runs on `logprob_chunk(vocab)` positions at a time and, with gradients on, every chunk but the last
    recomputes its logits in the backward pass (activation checkpointing), so no (N × vocab) tensor ever
    exists: a microbatch costs one chunk's logits and their gradient instead of two or three full fp32
    copies. The last chunk's backward comes first, so keeping its logits costs no more than recomputing
    them: a microbatch of at most one chunk recomputes nothing.
    """

    def chunk_logprobs(states: torch.Tensor, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = head(states).float() / temperature
        normaliser = torch.logsumexp(logits, dim=-1)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = normaliser - torch.einsum("nv,nv->n", torch.softmax(logits, dim=-1), logits)  # no copy
        return logits.gather(-1, picked[:, None]).squeeze(-1) - normaliser, entropy

    chunks = []
    size = logprob_chunk(vocab)
    starts = range(0, max(len(targets), 1), size)  # one (empty) chunk keeps the graph whole
    for start in starts:
        states, picked = hidden[start : start + size], targets[start : start + size]
        if torch.is_grad_enabled() and start != starts[-1]:
            chunks.append(checkpoint(chunk_logprobs, states, picked, use_reentrant=False))
        else:
            chunks.append(chunk_logprobs(states, picked))
    values = torch.cat([logprobs for logprobs, _ in chunks])
    return values, torch.cat([entropy for _, entropy in chunks]) if with_entropy else None
