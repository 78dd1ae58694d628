"""KL control: how far a proposed update moves the policy, measured where the policy acts.

Two measurements, with different jobs:

- the **proposal**: q, the KL per unit step², so KL(α) ≈ q·α² and α = min(α_max, √(δ_eff/q)) is the step the
  quadratic model allows. By default q is the guard's own measurements of the last committed steps
  (`KLController.curvature`); `jvp_kl` gives it by forward-mode AD on a few probe rows instead (the reference
  port's). Either is a guess: right in the median, wrong by orders of magnitude on single steps
  (`docs/logra.md`, "The trust region").
- the **guard**: the exact KL of the step as it will be committed, on rows drawn at random from the step's
  batch (`KLRows`): one unstepped forward (or the train step's own), then one forward per try with the weights
  the commit would leave (`LoGRAOptimizer.trial`, so under bf16 it is the rounded merge the engines will sample
  from). The rows give a mean per generated token and an upper confidence bound on the mean over the contexts
  the policy acts on, of which the batch is one draw (`KLEstimate`); the step is shrunk until that bound is
  within `max_overshoot`·δ_eff, or refused (`KLController.guard`).

Every forward returns logits, or the final hidden states when `KLRows.head` is set: the LM head is then applied to
POSITION_CHUNK generated positions at a time, so no (tokens × vocab) tensor exists beyond a chunk. The guard's
forwards run the model as it is (fused attention kernels); only the JVP needs plain ops, which `ChunkedAttention`
provides one block of queries at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from logra_rl.logra.config import KLConfig

# (linear module, projection A (rank × k_in), factor U (d_out × rank)): the step W ← W − U·A.
LowRankStep = Sequence[tuple[nn.Module, torch.Tensor, torch.Tensor]]
ForwardFn = Callable[[torch.Tensor], torch.Tensor]  # input ids (rows × tokens) -> logits or final hidden states
# After prompts: (the prompt each row continues, its tokens (rows × tokens), the attention mask over the prompt's
# padded tokens and these, their position ids) -> what ForwardFn returns for these tokens
ContinueFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Prompts (prompts × tokens, right-padded) and their attention mask -> (what ForwardFn returns for them, a
# ContinueFn that runs rows after them from their cached keys and values)
PrefillFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ContinueFn]]
HeadFn = Callable[[torch.Tensor], torch.Tensor]  # hidden states (..., H) -> logits (..., V)
POSITION_CHUNK = 64  # generated positions per float64 KL chunk: bounds the (chunk × vocab) temporaries
# The unstepped side's log-probs a guarded step keeps for its later tries (`KLReference`) at most: SmolLM2's guard
# rows whole on short answers (~330 positions of its 49k vocabulary); a few dozen positions of a 150k one
REFERENCE_BYTES = 2**28
# Elements of one block of attention scores in the JVP's attention (fp32): 64 MiB, whatever the row length
ATTENTION_BLOCK = 2**24
# Each line-search try shrinks α by at least this factor, whatever the measured overshoot says.
MAX_SHRINK = 0.7
# The growth a shrink assumes between measurements (KL ∝ α^p) at most; below p = 1 (a plateau) α shrinks tenfold
MAX_EXPONENT = 4.0
PLATEAU_SHRINK = 0.1
# A step whose KL bound is below this share of the budget is tried once more, closer to the budget (a third: on the
# quickstart the proposal lands below half the budget on 20-36% of steps, below a third on 8-23%; each try costs
# a forward of the guard's rows)
UNDERSHOOT = 1 / 3
# `estimator=previous` proposes from a geometric EMA of the committed steps' measured curvature (KL per unit α²):
# on the quickstart it predicts the next step's within a factor exp(0.54–0.70) on average, the last step alone
# within exp(0.63–0.82) (3 runs, 200 steps each)
CURVATURE_EMA_WEIGHT = 0.3
# Growing a step from one measurement assumes KL ∝ α^GROWTH_EXPONENT: steeper than the quadratic model, as the
# measured growth usually is (median exponent 2.8 on the quickstart), so a grown step rarely overshoots.
GROWTH_EXPONENT = 3.0


class ProbeError(RuntimeError):
    """The KL probe could not measure the proposal (no generated tokens, or the JVP was lost)."""


def predicted_kl(logits: torch.Tensor, tangent: torch.Tensor, temperature: float) -> torch.Tensor:
    """Second-order KL(π ‖ π + ε·dπ)/ε² per position (float64): ½·Var_{v∼p}(ż_v)/T²."""
    if logits.shape != tangent.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tangent {tuple(tangent.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    direction = tangent.double() / temperature
    centered = direction - (probs * direction).sum(dim=-1, keepdim=True)
    return 0.5 * (probs * centered.square()).sum(dim=-1)


def log_probs(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, p) (float64) of the tempered softmax of `logits`: the side of KL(p ‖ q) that `KLReference` keeps."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p, log_p.exp()


def kl_from_log_probs(log_p: torch.Tensor, p: torch.Tensor, logits_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(p ‖ q) per position (float64), p given by `log_probs`, q by its logits."""
    if log_p.shape != logits_q.shape:
        raise ValueError(f"log-probs {tuple(log_p.shape)} and logits {tuple(logits_q.shape)} differ in shape")
    log_q = torch.log_softmax(logits_q.double() / temperature, dim=-1)
    return torch.linalg.vecdot(p, log_p - log_q)


def exact_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(p ‖ q) per position (float64) between the two tempered softmax distributions."""
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits {tuple(logits_p.shape)} and {tuple(logits_q.shape)} differ in shape")
    return kl_from_log_probs(*log_probs(logits_p, temperature), logits_q, temperature)


@dataclass(frozen=True)
class KLRows:
    """Rows a KL is measured on: `forward(input_ids)` runs the policy to its logits, or to its final hidden states
    when `head` (the LM head, applied in chunks of positions) is set; `loss_mask` marks the generated tokens.
    `weights`: how many responses each row stands for (`distinct`: identical rows are measured once; None: one
    each)."""

    forward: ForwardFn
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    head: HeadFn | None = None
    weights: torch.Tensor | None = None
    forward_tokens: int = 0  # tokens per forward (`features` runs the rows in chunks); 0: all rows at once
    # `forward` on these rows as the policy is now, when the caller already has it (the train step's own forward,
    # where its numbers are the measurement's: fp32 compute): the guard then skips its unstepped forward
    features: torch.Tensor | None = None
    # Runs each distinct prompt once and the rows after it from its keys and values (`features`), where the model
    # can: the rows of a group share their prompt, which on short answers is most of each row (the guard's tries use
    # it on the per-try path only, `KLConfig.merges_per_try`: it costs one more forward)
    prefill: PrefillFn | None = None

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape or self.input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} and loss_mask {tuple(self.loss_mask.shape)} "
                "must both be (rows, tokens)"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def first(self, rows: int, max_tokens: int | None = None) -> KLRows:
        """The first `rows` rows, cut to `max_tokens` (and after their last generated token)."""
        ids, mask = self.input_ids[:rows], self.loss_mask[:rows]
        generated = mask.any(dim=0).nonzero()
        length = int(generated[-1]) + 1 if len(generated) else mask.shape[1]
        length = min(length, max_tokens or length)
        weights = None if self.weights is None else self.weights[:rows]
        features = None if self.features is None else self.features[:rows, :length]
        ids, mask = ids[:, :length], mask[:, :length]
        return replace(self, input_ids=ids, loss_mask=mask, weights=weights, features=features)

    def distinct(self) -> KLRows:
        """Each distinct row (tokens and mask) once, in the order they first come, weighted by how often it occurs:
        identical rows have identical KLs, so a batch of short answers is measured at the cost of its distinct ones."""
        key = torch.cat([self.input_ids, self.loss_mask.to(self.input_ids.dtype)], dim=1)
        unique, inverse = torch.unique(key, dim=0, return_inverse=True)
        each = torch.ones(len(self), dtype=torch.float64) if self.weights is None else self.weights.double().cpu()
        counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse.cpu(), each)
        first: dict[int, int] = {}
        for row, group in enumerate(inverse.tolist()):
            first.setdefault(group, row)
        order = torch.tensor(list(first.values()), device=key.device)
        weights = counts[list(first)].to(key.device)
        features = None if self.features is None else self.features[order]
        ids, mask = self.input_ids[order], self.loss_mask[order]
        return replace(self, input_ids=ids, loss_mask=mask, weights=weights, features=features)


def length_chunks(lengths: Sequence[int], forward_tokens: int = 0, overhead: int | None = None) -> list[list[int]]:
    """The rows (indices into `lengths`) of each forward: rows of similar length together, each forward cut to its
    longest row and holding at most `forward_tokens` tokens (0: no cap; a longer row runs alone), chosen to run the
    fewest tokens when every forward costs `overhead` tokens more (None: the fewest forwards, then the fewest
    tokens). Rows of length 0 run in none. Exact (dynamic programming over the rows sorted by length)."""
    order = sorted((index for index, length in enumerate(lengths) if length > 0), key=lambda index: lengths[index])
    sorted_lengths = [lengths[index] for index in order]
    count = len(order)
    if overhead is None:  # a forward costs more than all the padding it could save
        overhead = count * (sorted_lengths[-1] if count else 0) + 1
    best, start = [0] + [math.inf] * count, [0] * (count + 1)
    for end in range(1, count + 1):
        width = sorted_lengths[end - 1]
        for first in range(end - 1, -1, -1):
            if forward_tokens and first < end - 1 and (end - first) * width > forward_tokens:
                break
            cost = best[first] + (end - first) * width + overhead
            if cost < best[end]:
                best[end], start[end] = cost, first
    chunks, end = [], count
    while end:
        chunks.append(order[start[end] : end])
        end = start[end]
    return chunks[::-1]


def row_lengths(loss_mask: torch.Tensor) -> list[int]:
    """Tokens each row needs run for the predictions of its generated tokens: through its last one (0: none)."""
    positions = torch.arange(1, loss_mask.shape[1] + 1, device=loss_mask.device)
    return (loss_mask.bool() * positions).amax(dim=1).tolist()


def features(rows: KLRows, overhead: int | None = None) -> torch.Tensor:
    """`rows.forward` over the rows without gradients, padded to the rows' width: rows of similar length run
    together, each forward cut to its longest row (`length_chunks`: at most `rows.forward_tokens` tokens a forward,
    `overhead` the cost of one more forward, in tokens; None: as few forwards as the cap allows), as many forwards on
    every rank (each forward of an FSDP2 model is a collective: a rank with fewer runs spare ones). With
    `rows.prefill`, each distinct prompt (the tokens before a row's first generated one) runs once and only the
    rows' own tokens after it. Positions before a row's last prompt token and past its last generated one are zeros.
    Use `rows.features` instead where the caller has it for the unstepped policy."""
    lengths, device = row_lengths(rows.loss_mask), rows.input_ids.device
    starts = [0] * len(rows)  # where each row's forward begins: its prompt's end with `prefill`
    if rows.prefill is not None:
        starts, prompt, prompts, prompt_mask = _prompts(rows, lengths)
    chunks = length_chunks(
        [length - start for length, start in zip(lengths, starts, strict=True)], rows.forward_tokens, overhead
    )
    count = torch.tensor(max(len(chunks), 1), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    out = None
    with torch.no_grad():
        if rows.prefill is not None:  # one forward on every rank, whatever its rows
            prefilled, after = rows.prefill(prompts, prompt_mask)
            out = prefilled.new_zeros((len(rows), rows.input_ids.shape[1], *prefilled.shape[2:]))
            ends = prompt_mask.sum(dim=1) - 1
            for row, start in enumerate(starts):
                if lengths[row]:  # the prompt's last position predicts the row's first generated token
                    out[row, start - 1] = prefilled[prompt[row], ends[prompt[row]]]
        for number in range(int(count)):
            if number >= len(chunks):  # a spare forward: it shapes `out` where no row has a generated token
                output = rows.forward(rows.input_ids[:1, :1])
                index, width = None, 0
            else:
                index = torch.tensor(chunks[number], device=device)
                width = max(lengths[row] - starts[row] for row in chunks[number])
                if rows.prefill is None:
                    output = rows.forward(rows.input_ids[index, :width])
                else:
                    output = _continue(rows, after, chunks[number], starts, width, prompt, prompt_mask)
            if out is None:
                out = output.new_zeros((len(rows), rows.input_ids.shape[1], *output.shape[2:]))
            if index is None:
                continue
            for position, row in enumerate(chunks[number]):
                out[row, starts[row] : lengths[row]] = output[position, : lengths[row] - starts[row]]
    return out


def _prompts(rows: KLRows, lengths: list[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Each row's prompt length (its first generated token's position) and prompt (an index into the distinct
    prompts), and the distinct prompts right-padded with their attention mask. Rows with nothing generated take the
    first prompt and run in no forward; where no row generated anything, one row's first token is the prompt, so
    every rank runs its prefill."""
    generated = rows.loss_mask.bool()
    starts = [max(int(generated[row].nonzero()[0]), 1) if lengths[row] else 0 for row in range(len(rows))]
    index: dict[tuple[int, ...], int] = {}
    prompt = [
        index.setdefault(tuple(rows.input_ids[row, :start].tolist()), len(index)) if start else 0
        for row, start in enumerate(starts)
    ]
    if not index:
        index[tuple(rows.input_ids[0, :1].tolist())] = 0
    width = max(len(tokens) for tokens in index)
    prompts = rows.input_ids.new_zeros((len(index), width))
    mask = torch.zeros_like(prompts)
    for tokens, number in index.items():
        prompts[number, : len(tokens)] = torch.tensor(tokens, device=prompts.device)
        mask[number, : len(tokens)] = 1
    return starts, prompt, prompts, mask


def _continue(
    rows: KLRows,
    after: ContinueFn,
    chunk: list[int],
    starts: list[int],
    width: int,
    prompt: list[int],
    prompt_mask: torch.Tensor,
) -> torch.Tensor:
    """One forward of `chunk`'s rows from their prompts' end: their tokens right-padded to `width`, at their own
    positions, each attending to its prompt's tokens (not the prompt batch's padding) and causally to its own."""
    ids = rows.input_ids.new_zeros((len(chunk), width))
    for position, row in enumerate(chunk):
        own = rows.input_ids[row, starts[row] : starts[row] + width]
        ids[position, : len(own)] = own
    which = torch.tensor([prompt[row] for row in chunk], device=ids.device)
    mask = torch.cat([prompt_mask[which], torch.ones_like(ids)], dim=1)
    positions = torch.tensor([starts[row] for row in chunk], device=ids.device)[:, None] + torch.arange(
        width, device=ids.device
    )
    return after(which, ids, mask, positions)


def generated_positions(loss_mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, positions) of the predictions of generated tokens, POSITION_CHUNK of them per chunk. Logits at
    position p predict token p+1: p counts iff token p+1 is generated."""
    where = loss_mask[:, 1:].bool().nonzero()
    return [tuple(where[start : start + POSITION_CHUNK].unbind(1)) for start in range(0, len(where), POSITION_CHUNK)]


@torch.no_grad()
def masked_logits(
    features: torch.Tensor, loss_mask: torch.Tensor, head: HeadFn | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(row index, logits) of the predictions of generated tokens, one chunk of `generated_positions` at a time:
    from logits, or from hidden states through `head`. No (tokens × vocab) tensor exists beyond a chunk, however
    many rows there are."""
    for rows, positions in generated_positions(loss_mask):
        part = features[rows, positions]
        yield rows, part if head is None else head(part)


LogitChunks = Iterable[tuple[torch.Tensor, torch.Tensor]]  # (row index, logits) chunks, as `masked_logits` yields


class KLReference:
    """The policy before an update at the generated positions of some rows: the p side of KL(p ‖ q), as float64
    (log p, p) (`log_probs`), one chunk of `generated_positions` at a time, from `features` (logits, or final hidden
    states through `head`). Iterate it once per comparison (`row_kl`).

    The first chunks, up to `keep_bytes`, are kept after the first pass: every try of the guard compares its stepped
    policy with the same unstepped one, and a kept chunk skips its LM head and softmax on the later tries (on
    SmolLM2-135M on a CPU, a tenth of a try). The rest are computed again on every pass, so what is held of the
    (tokens × vocab) tensors is at most `keep_bytes`."""

    def __init__(
        self,
        features: torch.Tensor,
        loss_mask: torch.Tensor,
        head: HeadFn | None,
        temperature: float,
        keep_bytes: int = 0,
    ) -> None:
        self.features, self.head, self.temperature = features, head, temperature
        self.chunks = generated_positions(loss_mask)
        self.keep_bytes = keep_bytes
        self.kept: torch.Tensor | None = None  # (2, positions, vocab): log p and p of the first chunks, in one block
        self.kept_chunks = 0

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        start = 0
        for k, (rows, positions) in enumerate(self.chunks):
            end = start + len(rows)
            if k < self.kept_chunks:
                yield rows, self.kept[0, start:end], self.kept[1, start:end]
            else:
                part = self.features[rows, positions]
                log_p, p = log_probs(part if self.head is None else self.head(part), self.temperature)
                if k == self.kept_chunks and self._keep(log_p, p, start, end):
                    self.kept_chunks += 1
                yield rows, log_p, p
            start = end

    def _keep(self, log_p: torch.Tensor, p: torch.Tensor, start: int, end: int) -> bool:
        """Copy a chunk into the block (allocated once, at the first chunk: one block leaves no holes between the
        kept chunks and the tries' temporaries), if it fits."""
        if self.kept is None:
            positions = sum(len(rows) for rows, _ in self.chunks)
            fits = min(positions, self.keep_bytes // (2 * log_p.element_size() * log_p.shape[-1]))
            self.kept = log_p.new_empty((2, fits if fits >= end else 0, log_p.shape[-1]))
        if end > self.kept.shape[1]:
            return False
        self.kept[0, start:end], self.kept[1, start:end] = log_p, p
        return True


def row_kl(
    before: KLReference, after: LogitChunks, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ KL(π_before ‖ π_after), generated positions) per row (float64, on `device`) over matching chunks of the
    same positions, at `before`'s temperature: how far an update moved the policy on each row, whatever moved it (a
    LoGRA step, AdamW, LoRA)."""
    sums = torch.zeros(rows, dtype=torch.float64, device=device)
    counts = torch.zeros(rows, dtype=torch.float64, device=device)
    for (index, log_p, p), (_, logits_q) in zip(before, after, strict=True):
        index = index.to(device)
        sums.index_add_(
            0, index, kl_from_log_probs(log_p.to(device), p.to(device), logits_q.to(device), before.temperature)
        )
        counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
    return sums, counts


def _all_reduce(values: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    return values


@dataclass(frozen=True)
class KLEstimate:
    """KL(π_before ‖ π_after) per generated token over measured rows (all ranks): `mean`, and `upper`, a one-sided
    confidence bound on the mean over the contexts the policy acts on, which the rows sample."""

    mean: float
    upper: float
    rows: int
    tokens: int
    row_cv: float = 0.0  # how much the rows differ: the sd of Σ_row KL − mean·tokens_row over mean·tokens per row


def kl_estimate(
    sums: torch.Tensor, counts: torch.Tensor, confidence: float, weights: torch.Tensor | None = None
) -> KLEstimate:
    """The ratio estimator Σ KL / Σ tokens over the rows of every rank and its upper confidence bound.

    The rows (each standing for `weights` responses) are a sample of the contexts the policy acts on: the batch is
    one draw of them, the guard's rows a random part of it, and the next batch another draw. The bound is therefore
    on the mean over those contexts, not over this batch: mean + z·se with the ratio estimator's standard error
    (from the rows' residuals s_i − R·c_i) and z the normal quantile of `confidence`; the more unevenly the KL
    spreads over the rows, the further the bound sits above the mean, even when the whole batch is measured. Every
    rank gets the same estimate, so every rank takes the same decision on it."""
    weights = torch.ones_like(sums) if weights is None else weights.to(sums)
    stats = torch.stack(
        [
            (weights * sums).sum(),
            (weights * counts).sum(),
            (weights * sums.square()).sum(),
            (weights * counts.square()).sum(),
            (weights * sums * counts).sum(),
            weights.sum(),
        ]
    )
    total, tokens, sums_sq, counts_sq, cross, rows = _all_reduce(stats.double()).tolist()
    if tokens == 0:
        raise ProbeError("the KL measurement saw no generated tokens; check loss_mask and logra.kl.probe_max_tokens")
    mean = total / tokens
    if not (math.isfinite(mean) and mean >= 0):
        raise FloatingPointError(f"a KL measurement returned {mean}")
    upper, row_cv = mean, 0.0
    if rows >= 2:
        residuals = max(sums_sq - 2 * mean * cross + mean**2 * counts_sq, 0.0)  # Σ (s_i − R·c_i)²
        spread = math.sqrt(residuals / (rows - 1)) / (tokens / rows)  # the sd of a row's KL per token, roughly
        row_cv = spread / mean if mean > 0 else 0.0
        upper = mean + NormalDist().inv_cdf(confidence) * spread / math.sqrt(rows)
    return KLEstimate(mean, upper, int(rows), int(tokens), row_cv)


def reduced_mean_kl(total: torch.Tensor, count: torch.Tensor) -> float:
    """Σ KL / positions summed over the ranks (when torch.distributed is initialised): every rank gets the
    same mean, so every rank takes the same decision on it."""
    total, count = _all_reduce(torch.stack([total, count]).double()).tolist()
    if count == 0:
        raise ProbeError("the KL probe saw no generated tokens; check loss_mask and logra.kl.probe_max_tokens")
    kl = total / count
    if not (math.isfinite(kl) and kl >= 0):
        raise FloatingPointError(f"a KL measurement returned {kl}")
    return kl


# ---- the proposal: forward-mode AD along the step ---------------------------------------------------------


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` in plain fp32 ops (so forward-mode AD runs through it), a block of queries
    at a time: scores for at most ATTENTION_BLOCK (query, key) pairs exist at once, instead of the math kernel's
    rows × heads × L² (~50 GiB a layer at 32 heads and 8k tokens)."""
    if dropout_p:
        raise ValueError("the KL probe runs the policy without dropout")
    heads, queries, keys = query.shape[-3], query.shape[-2], key.shape[-2]
    if key.shape[-3] != heads:  # grouped-query attention: each KV head serves a group of query heads
        key = key.repeat_interleave(heads // key.shape[-3], dim=-3)
        value = value.repeat_interleave(heads // value.shape[-3], dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    key_t, value = key.float().transpose(-2, -1), value.float()
    block = max(1, ATTENTION_BLOCK // (math.prod(query.shape[:-2]) * keys))
    outputs = []
    for start in range(0, queries, block):
        scores = (query[..., start : start + block, :].float() @ key_t) * scale
        if is_causal:  # query i sees keys up to i + (keys − queries)
            seen = torch.arange(start, start + scores.shape[-2], device=query.device)[:, None] + (keys - queries)
            scores = scores.masked_fill(torch.arange(keys, device=query.device) > seen, -math.inf)
        if attn_mask is not None:
            mask = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., start : start + block, :]
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        outputs.append((scores.softmax(dim=-1) @ value).to(query.dtype))
    return torch.cat(outputs, dim=-2)


class ChunkedAttention(TorchFunctionMode):
    """Routes every `F.scaled_dot_product_attention` call to `chunked_attention` (the fused kernels have no
    forward-AD rule, and the math kernel holds all the scores of a layer at once)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return chunked_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _output_change(x: torch.Tensor, projection: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """−(x·Aᵀ)·Uᵀ in fp32 (autocast off), shaped like the layer output."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        flat = x.reshape(-1, projection.shape[1]).float()
        change = -(flat @ projection.t().float()) @ factor.t().float()
    return change.reshape(*x.shape[:-1], factor.shape[0])


@contextmanager
def _tangent(step: LowRankStep) -> Iterator[None]:
    """Hooks that add the step's output change to each targeted linear's forward-AD tangent."""

    def make_hook(projection: torch.Tensor, factor: torch.Tensor) -> Callable:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            x = fwAD.unpack_dual(args[0]).primal
            primal, tangent = fwAD.unpack_dual(output)
            change = _output_change(x, projection, factor).to(primal.dtype)
            return fwAD.make_dual(primal, change if tangent is None else tangent + change)

        return hook

    handles = [module.register_forward_hook(make_hook(a, u)) for module, a, u in step]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def jvp_kl(rows: KLRows, step: LowRankStep, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ predicted KL per unit step², generated positions) over `rows` (weighted), by forward-mode AD, one row at a
    time (every rank must run as many forwards: give each the same row count)."""
    total = torch.zeros((), dtype=torch.float64, device=rows.input_ids.device)
    count = torch.zeros((), dtype=torch.float64, device=rows.input_ids.device)
    with torch.no_grad(), ChunkedAttention(), _tangent(step):
        for row in range(len(rows)):
            one = replace(rows, input_ids=rows.input_ids[row : row + 1], loss_mask=rows.loss_mask[row : row + 1])
            with fwAD.dual_level():
                features = one.forward(one.input_ids)
                if fwAD.unpack_dual(features).tangent is None:
                    raise ProbeError(
                        "the JVP was lost between the targeted layers and the logits; does `forward` detach "
                        "activations or run the targets under a different module instance?"
                    )
                weight = 1.0 if rows.weights is None else float(rows.weights[row])
                for _, logits in masked_logits(features, one.loss_mask, one.head):  # dual: logits and tangent
                    total += weight * predicted_kl(*fwAD.unpack_dual(logits)[:2], temperature).sum()
                    count += weight * logits.shape[0]
    return total, count


# ---- the budget and the guard -----------------------------------------------------------------------------


def _growth(tried: list[tuple[float, KLEstimate]]) -> float:
    """The exponent p of KL ∝ α^p through the last two measurements (2 after one, or where they cannot tell)."""
    if len(tried) < 2:
        return 2.0
    (before, kl_before), (after, kl_after) = tried[-2], tried[-1]
    if before == after or kl_before.upper <= 0 or kl_after.upper <= 0:
        return 2.0
    return min(MAX_EXPONENT, math.log(kl_before.upper / kl_after.upper) / math.log(before / after))


def scheduled_budget(config: KLConfig, update: int) -> float:
    """δ for the update after `update` completed ones: cosine from budget to final_budget, or constant; the first
    `warmup_steps` updates a linearly growing share of it."""
    warmup = min((update + 1) / config.warmup_steps, 1.0) if config.warmup_steps else 1.0
    if config.schedule == "constant":
        return warmup * config.budget
    progress = min(update / max(config.schedule_steps - 1, 1), 1.0)
    cosine = config.final_budget + 0.5 * (config.budget - config.final_budget) * (1 + math.cos(math.pi * progress))
    return warmup * cosine


def step_scale(q: float, budget: float, alpha_max: float) -> float:
    """α = min(α_max, √(budget/q)); q = 0 gives 1 (a zero direction); a non-finite q refuses the step."""
    if not math.isfinite(q) or q < 0:
        raise FloatingPointError(f"predicted KL q={q} is not a finite non-negative number; the step is refused")
    if not (budget > 0 and alpha_max > 0 and math.isfinite(budget + alpha_max)):
        raise ValueError(f"need budget > 0 and alpha_max > 0, got budget={budget}, alpha_max={alpha_max}")
    if q == 0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / q))


@dataclass(frozen=True)
class GuardedStep:
    """The controller's decision for one update: what was predicted, every measurement, and the α to commit
    (when `accepted`; else the last one tried)."""

    q: float | None  # the proposal's KL per unit α² (None: nothing to propose from; the first try is α = 1)
    budget: float  # δ_eff
    tried: tuple[tuple[float, KLEstimate], ...]  # (α, its measured KL) of every try, the proposed α first
    alpha: float
    measured: KLEstimate  # the KL of `alpha`
    accepted: bool
    seconds: float = 0.0  # spent measuring (the guard's share of the step)

    @property
    def tries(self) -> int:
        return len(self.tried)

    @property
    def kl(self) -> float:
        """The measured mean KL per token of `alpha` on the guard rows."""
        return self.measured.mean

    @property
    def proposed_alpha(self) -> float:
        """min(α_max, √(budget/q)): what the quadratic model alone would have committed."""
        return self.tried[0][0]

    @property
    def predicted(self) -> float:
        """q·α² at the committed α (nan without a q)."""
        return math.nan if self.q is None else self.q * self.alpha**2

    @property
    def calibration(self) -> float:
        """Measured over predicted KL at the proposed α: how far the proposal was off (nan without a q, or at 0)."""
        alpha, measured = self.tried[0]
        predicted = math.nan if self.q is None else self.q * alpha**2
        return measured.mean / predicted if predicted > 0 else math.nan

    def refusal(self) -> str:
        message = (
            f"KL guard: after {self.tries} tries the KL bound was still {self.measured.upper / self.budget:.3g}x "
            f"the budget {self.budget:.3g} (alpha {self.proposed_alpha:.3g} proposed, {self.alpha:.3g} last tried); "
            "the update is skipped"
        )
        (first_alpha, first), last = self.tried[0], self.measured
        if self.tries >= 2 and last.upper > 0 and first.upper / last.upper < first_alpha / self.alpha:
            message += (
                f". The KL fell less than linearly as alpha shrank ({first.upper:.3g} to {last.upper:.3g}): a floor "
                "that smaller steps do not go below, such as the rounding of a bf16 merge (docs/logra.md, 'The trust "
                f"region under bf16'), or contexts that flip at any step; if it persists, raise logra.kl.budget above "
                f"{last.upper:.3g} or logra.kl.max_tries, or compute in float32 (model.compute_dtype)"
            )
        return message


class KLController:
    """The KL budget for each update (schedule, minus the EMA of the rollout-vs-trainer mismatch and what stale
    batches showed earlier updates overshot by, floored), and the guard that holds each step to it. Remembers the
    budgets it granted to the last updates (checkpointed), against which a stale batch's behaviour KL is read."""

    REMEMBERED = 8  # granted budgets kept (a stale batch is max_staleness × epochs updates behind; past this, unknown)
    NUMERICS_MARGIN = 4  # the staleness bound's room for the engines' numerics: this many times their measured KL

    def __init__(self, config: KLConfig) -> None:
        self.config = config
        self.mismatch = 0.0  # EMA of max(0, mean(log π_rollout − log π_trainer)) over finished responses
        self.granted: dict[int, float] = {}  # policy version after an update -> the budget it was held to
        # the committed steps' measured KL bound per unit α², a geometric EMA (weight CURVATURE_EMA_WEIGHT)
        self.curvature: float | None = None
        # KL(π_rollout ‖ π_train) per token of batches sampled by the policy trained on: the engines' numerics
        self.numerics: float | None = None
        self.debt = 0.0  # KL per token that stale batches showed earlier updates moved past their budgets
        # step -> what the batch refused at that step owes, a debt at the next update (`carry_refused`); by step,
        # so a step stopped after its refusal and run again on resume owes it once
        self.refused: dict[int, float] = {}
        self._paying = 0.0  # the part of the debt the budget just given takes off, paid once its update commits

    def step_budget(self, update: int, mismatch_sum: float = 0.0, mismatch_tokens: int = 0) -> float:
        """δ_eff for the next update: the schedule's, minus the mismatch EMA (folding this batch's mismatch in) and
        minus the debt, down to `mismatch_budget_floor` of it.

        With no measured tokens this step (a PPO epoch after the first, a stale batch, whose mismatch holds its
        staleness too) the mismatch EMA is neither changed nor subtracted (as in the reference port).
        """
        budget = scheduled_budget(self.config, update)
        cut, room = 0.0, (1 - self.config.mismatch_budget_floor) * budget
        if self.config.mismatch_subtraction and mismatch_tokens > 0:
            observed = mismatch_sum / mismatch_tokens
            if not math.isfinite(observed):
                raise FloatingPointError(f"rollout-vs-trainer mismatch {observed} is not finite")
            weight = self.config.mismatch_ema_weight
            self.mismatch = (1 - weight) * self.mismatch + weight * max(0.0, observed)
            cut = min(self.mismatch, room)
        self._paying = min(self.debt, room - cut)
        return budget - cut - self._paying

    def observe_numerics(self, behaviour_kl: float) -> None:
        """Fold the behaviour KL of a batch sampled by the policy being trained (the engines' numerics alone) into
        `numerics`, an EMA (weight `mismatch_ema_weight`) started at the first."""
        if not math.isfinite(behaviour_kl):
            raise FloatingPointError(f"behaviour KL {behaviour_kl} is not finite")
        weight = self.config.mismatch_ema_weight
        self.numerics = behaviour_kl if self.numerics is None else (1 - weight) * self.numerics + weight * behaviour_kl

    def carry_refused(self) -> None:
        """An update is made: what the batches refused before it owe joins the debt."""
        self.debt += sum(self.refused.values())
        self.refused.clear()

    def owe(self, update: int, behaviour_kl: float, staleness: int, refused_at: int | None = None) -> None:
        """A batch sampled `staleness` updates before `update` (`algorithm.max_staleness`), trained on or refused,
        has KL(π_behaviour ‖ π_train) per token `behaviour_kl`: what that exceeds the budgets those updates were
        granted plus the engines' numerics by, they moved the policy past their budgets on the engines' own
        samples. It is added to the debt (a refused batch's at the next update, `carry_refused`), which the next
        updates' budgets pay off (`step_budget`), down to the floor: nothing is forgiven. (A balance that batches
        under their budgets pay back was tried: the same learning on average over 3 quickstart seeds, one seed
        under the +0.4 gain the one-sided debt gives every seed; docs/benchmarks.md §17.)"""
        if not math.isfinite(behaviour_kl):
            raise FloatingPointError(f"behaviour KL {behaviour_kl} is not finite")
        excess = max(0.0, behaviour_kl - self.granted_since(update, staleness) - (self.numerics or 0.0))
        if refused_at is not None:
            self.refused[refused_at] = excess
        else:
            self.debt += excess

    def staleness_bound(self, update: int, updates: int) -> float:
        """The default `algorithm.staleness_kl` for a batch `updates` updates behind `update`: twice what the guard
        lets those updates move the policy (max_overshoot × their budgets), plus NUMERICS_MARGIN × the engines'
        measured numerics; it follows the budget schedule."""
        moved = self.config.max_overshoot * self.granted_since(update, updates)
        return 2 * moved + self.NUMERICS_MARGIN * (self.numerics or 0.0)

    def granted_since(self, update: int, updates: int) -> float:
        """Σ of the budgets of the `updates` updates before `update`: as granted where remembered, else as scheduled."""
        granted = self.budget_since(update - updates, update)
        if granted is None:
            granted = sum(scheduled_budget(self.config, max(update - back, 0)) for back in range(1, updates + 1))
        return granted

    def budget_since(self, version: int, current: int) -> float | None:
        """Σ of the budgets granted to the updates from `version` to `current` (None where one is not known: one
        from before a restart, or older than the controller remembers)."""
        budgets = [self.granted.get(v) for v in range(version + 1, current + 1)]
        return sum(budgets) if budgets and None not in budgets else None

    def alpha(self, q: float | None, budget: float) -> float:
        """The proposed α: from q when there is one, else 1 (the step `update_ratio` sets), at most α_max."""
        return min(1.0, self.config.alpha_max) if q is None else step_scale(q, budget, self.config.alpha_max)

    def guard(self, q: float | None, budget: float, measure: Callable[[float], KLEstimate]) -> GuardedStep:
        """α from the proposal, then checked against the measured KL before anything is committed.

        `measure(α)` gives the KL of the step at α on the guard rows; the decisions read its upper bound. While
        the bound exceeds `max_overshoot`·budget, α shrinks to where KL ∝ α^p meets the budget, by at least
        MAX_SHRINK, and is measured again: p = 2 after one measurement, then the power law through the last two (at
        most MAX_EXPONENT): a KL that grows faster than α² (the usual way the quadratic model fails) is shrunk no
        further than needed. A KL that grew slower than α (a plateau: contexts near a tie that any step this size
        flips) is shrunk by PLATEAU_SHRINK, past the plateau, where the KL is quadratic again. A step within the
        bound but below UNDERSHOOT·budget gets one more try closer to the budget (on the power law through the last
        two measurements, or, after one, KL ∝ α^GROWTH_EXPONENT up to α_max), kept only if it is within the bound.
        After `max_tries` measurements without a step within the bound the update is refused.
        """
        config = self.config
        limit = config.max_overshoot * budget
        tried: list[tuple[float, KLEstimate]] = []
        start = time.perf_counter()

        def measured(alpha: float) -> KLEstimate:
            estimate = measure(alpha)
            if not (math.isfinite(estimate.upper) and estimate.mean >= 0):
                raise FloatingPointError(
                    f"measured KL {estimate.mean} at alpha={alpha:.3g} is not a finite non-negative number; "
                    "the step is refused"
                )
            tried.append((alpha, estimate))
            return estimate

        alpha = self.alpha(q, budget)
        estimate = measured(alpha)
        while estimate.upper > limit and len(tried) < config.max_tries:
            growth = _growth(tried)
            alpha *= PLATEAU_SHRINK if growth < 1 else min(MAX_SHRINK, (budget / estimate.upper) ** (1 / growth))
            estimate = measured(alpha)
        accepted = estimate.upper <= limit
        if accepted and estimate.upper < UNDERSHOOT * budget and len(tried) < config.max_tries:
            candidate = self._closer(tried, budget)
            if candidate is not None and (closer := measured(candidate)).upper <= limit:
                alpha, estimate = candidate, closer
        return GuardedStep(q, budget, tuple(tried), alpha, estimate, accepted, time.perf_counter() - start)

    def _closer(self, tried: list[tuple[float, KLEstimate]], budget: float) -> float | None:
        """An α whose KL bound should meet `budget`, from the last measurements (None: no better guess): on the
        power law through the last two when the step was shrunk, else KL ∝ α^GROWTH_EXPONENT up to α_max."""
        alpha, last = tried[-1]
        if last.upper <= 0 or not math.isfinite(self.config.max_overshoot):  # inf: the guard is off
            return None
        if len(tried) == 1:
            if alpha >= self.config.alpha_max:
                return None
            return min(self.config.alpha_max, alpha * (budget / last.upper) ** (1 / GROWTH_EXPONENT))
        above, over = tried[-2]
        if not (above > alpha and over.upper > last.upper):
            return None
        exponent = math.log(over.upper / last.upper) / math.log(above / alpha)
        return alpha * (budget / last.upper) ** (1 / exponent)  # below `above`: its bound was past the budget

    def record(self, version: int, step: GuardedStep) -> None:
        """The update that made policy `version` was `step`: its budget is kept for `budget_since`, its measured
        curvature folded into the next proposal's (`kl.estimator=previous`); the debt its budget took off is paid."""
        self.granted[version] = step.budget
        self.debt, self._paying = max(0.0, self.debt - self._paying), 0.0
        if step.alpha > 0 and step.measured.upper > 0:
            measured = math.log(step.measured.upper / step.alpha**2)
            if self.curvature is not None:
                measured += (1 - CURVATURE_EMA_WEIGHT) * (math.log(self.curvature) - measured)
            self.curvature = math.exp(measured)
        for old in [v for v in self.granted if v <= version - self.REMEMBERED]:
            del self.granted[old]

    def state_dict(self) -> dict[str, Any]:
        return {
            "mismatch": self.mismatch,
            "granted": dict(self.granted),
            "curvature": self.curvature,
            "numerics": self.numerics,
            "debt": self.debt,
            "refused": dict(self.refused),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mismatch = float(state["mismatch"])
        # absent in older checkpoints
        self.granted = {int(v): float(b) for v, b in state.get("granted", {}).items()}
        self.curvature = state.get("curvature")
        self.numerics, self.debt = state.get("numerics"), float(state.get("debt", 0.0))
        self.refused = {int(step): float(owed) for step, owed in state.get("refused", {}).items()}
