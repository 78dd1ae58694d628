"""Per-token log-probabilities of the sampled tokens under the policy's logits."""

from __future__ import annotations

import torch

LOGPROB_CHUNK = 1024  # positions per fp32 log-softmax: bounds the (positions × vocab) temporaries


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token t | < t) for t ≥ 1, aligned with input_ids[:, 1:] (float32), in position chunks."""
    logits, targets = logits[:, :-1], input_ids[:, 1:, None]
    chunks = []
    for start in range(0, targets.shape[1], LOGPROB_CHUNK):
        chunk = logits[:, start : start + LOGPROB_CHUNK].float() / temperature
        picked = chunk.gather(-1, targets[:, start : start + LOGPROB_CHUNK]).squeeze(-1)
        chunks.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(chunks, dim=1)
