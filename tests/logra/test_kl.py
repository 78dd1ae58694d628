"""KL control: the proposal against the exact KL of the committed step, the guard's measurement against rows it
never saw, its confidence bound, and the controller."""

import math
from dataclasses import replace

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import logra_rl.logra.kl as kl
from logra_rl.logra import (
    KLConfig,
    KLController,
    KLEstimate,
    KLRows,
    LoGRAConfig,
    LoGRAOptimizer,
    exact_kl,
    kl_estimate,
    predicted_kl,
    scheduled_budget,
    step_scale,
)
from logra_rl.logra.kl import POSITION_CHUNK, GuardedStep, chunked_attention
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss

TEMPERATURE = 0.7


def logits_fn(model):
    return lambda input_ids: model(input_ids=input_ids).logits


def prepared_optimizer(config, seed=4):
    model = tiny_qwen3(seed=seed)
    assert model.config._attn_implementation == "sdpa"  # the JVP must cope with fused attention kernels
    opt = LoGRAOptimizer(model, config)
    batch = random_batch(4, 24, seed=seed)
    token_sum_loss(model, batch).backward()
    opt.prepare(num_tokens=batch[:, 1:].numel())
    loss_mask = torch.zeros_like(batch)
    loss_mask[:, 6:] = 1  # the first tokens play the prompt
    return model, opt, KLRows(logits_fn(model), batch, loss_mask)


def commit_and_measure(model, opt, rows, alpha):
    """Mean exact KL(π_before ‖ π_after) over generated-token predictions of `rows`, by committing the step."""
    with torch.no_grad():
        before = model(input_ids=rows.input_ids).logits
        opt.commit(alpha)
        after = model(input_ids=rows.input_ids).logits
    mask = rows.loss_mask[:, 1:].bool()
    return float(exact_kl(before[:, :-1], after[:, :-1], TEMPERATURE)[mask].mean())


def test_prediction_matches_exact_kl_of_committed_step():
    model, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1, wire_dtype="float32"))
    q = opt.probe_kl(rows, TEMPERATURE)  # the first 2 rows
    alpha = 0.5
    actual = commit_and_measure(model, opt, rows.first(2), alpha)
    assert actual > 0
    assert q * alpha**2 == pytest.approx(actual, rel=0.03)


def test_measured_kl_is_the_kl_of_the_committed_wire_rounded_step():
    model, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1, update_ratio=1e-3))
    alpha = 2.0
    before = [p.clone() for p in model.parameters()]
    measured = opt.realized_kl(rows, TEMPERATURE, alpha)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # measured, not moved
    assert measured.rows == 4 and measured.upper == measured.mean  # at confidence 0.5 the bound is the mean
    assert measured.mean == pytest.approx(commit_and_measure(model, opt, rows, alpha), rel=1e-6)


def test_identical_rows_are_measured_once_and_weighted_by_their_count():
    """A batch of short answers repeats rows: `distinct` keeps each once with its count, and the KL, its bound and
    the JVP's q over the weighted rows are those over every row."""
    _, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1, kl=KLConfig(probe_responses=6)))
    repeated = torch.tensor([0, 1, 0, 2, 1, 0])
    every = KLRows(rows.forward, rows.input_ids[repeated], rows.loss_mask[repeated])
    distinct = every.distinct()
    assert torch.equal(distinct.input_ids, rows.input_ids[:3]) and distinct.weights.tolist() == [3.0, 2.0, 1.0]
    full, weighted = opt.realized_kl(every, TEMPERATURE, 1.0, 0.9), opt.realized_kl(distinct, TEMPERATURE, 1.0, 0.9)
    assert weighted.rows == full.rows == 6 and weighted.mean == pytest.approx(full.mean, rel=1e-9)
    assert weighted.upper == pytest.approx(full.upper, rel=1e-9) and full.upper > full.mean
    assert opt.probe_kl(distinct, TEMPERATURE) == pytest.approx(opt.probe_kl(every, TEMPERATURE), rel=1e-9)


def test_a_forward_inside_the_trial_is_the_forward_after_the_commit_bit_for_bit():
    """`trial(α)` merges the step into the fp32 masters with the commit's own factors and merge, one unit at a time,
    and puts the rows back bit for bit: under bf16 autocast (the rounded merge the engines hold) the stepped logits
    equal the committed model's exactly."""
    model, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1, update_ratio=1e-3))
    weights = {name: p.clone() for name, p in model.named_parameters()}

    def bf16(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids).logits

    with torch.no_grad():
        before = bf16(rows.input_ids)
        with opt.trial(1.5):
            stepped = bf16(rows.input_ids)
    assert all(torch.equal(weights[name], p) for name, p in model.named_parameters())
    measured = opt.realized_kl(KLRows(bf16, rows.input_ids, rows.loss_mask), TEMPERATURE, 1.5)
    opt.commit(1.5)
    with torch.no_grad():
        committed = bf16(rows.input_ids)
    assert torch.equal(stepped, committed) and not torch.equal(stepped, before)
    mask = rows.loss_mask[:, 1:].bool()
    expected = float(exact_kl(before[:, :-1], committed[:, :-1], TEMPERATURE)[mask].mean())
    assert measured.mean == pytest.approx(expected, rel=1e-9)  # the rounded merge's KL, not an extrapolation


@pytest.mark.parametrize("per_try", [False, True])
def test_a_trial_merged_once_serves_every_forward_inside_it_and_restores_the_weights(per_try):
    """`trial(α, per_try=True)` merges the step into every target on entry (one merge for all the forwards of a
    try) and restores them on exit; per unit, each forward merges and restores around itself. Every forward inside
    either is the committed model's, bit for bit."""
    model, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1, update_ratio=1e-3))
    weights = {name: p.clone() for name, p in model.named_parameters()}
    with torch.no_grad(), opt.trial(1.5, per_try):
        stepped = [model(input_ids=rows.input_ids[part]).logits for part in (slice(0, 1), slice(1, 4))]
        merged_inside = not torch.equal(
            weights["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight
        )
    assert merged_inside == per_try  # per unit, nothing stays merged between forwards
    assert all(torch.equal(weights[name], p) for name, p in model.named_parameters())
    opt.commit(1.5)
    with torch.no_grad():
        committed = [model(input_ids=rows.input_ids[part]).logits for part in (slice(0, 1), slice(1, 4))]
    assert all(torch.equal(a, b) for a, b in zip(stepped, committed, strict=True))


@pytest.mark.parametrize("trial_merge", ["auto", "per_try"])
def test_prompts_run_once_only_on_the_per_try_path_and_the_kl_is_the_same(trial_merge):
    """A try on rows with little work (a tiny model's: what `auto` leaves per unit) runs the rows whole, its
    unstepped side too, and never the prefill, which costs a forward more; `per_try` runs each prompt once. Both
    measure the same KL."""
    from logra_rl.models.prefill import prompt_prefill

    config = LoGRAConfig(rank=8, seed=1, update_ratio=1e-3, kl=KLConfig(trial_merge=trial_merge))
    model, opt, rows = prepared_optimizer(config)
    prefills = []

    def forward(input_ids, attention_mask=None, **cached):
        prefills.append("past_key_values" in cached and "position_ids" not in cached)
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **cached).logits

    rows = replace(rows, input_ids=rows.input_ids.clone(), prefill=prompt_prefill(forward, model.config))
    rows.input_ids[2:, :6] = rows.input_ids[:2, :6]  # two prompts, two responses each
    measured = opt.realized_kl(rows, TEMPERATURE, 1.5)
    assert sum(prefills) == (2 if trial_merge == "per_try" else 0)  # the unstepped side's and the try's
    plain = opt.realized_kl(replace(rows, prefill=None), TEMPERATURE, 1.5)
    assert measured.mean > 0
    assert math.isclose(measured.mean, plain.mean, rel_tol=1e-4)


def test_length_chunks_are_the_cheapest_partition_of_rows_sorted_by_length():
    """Each forward runs its rows cut to its longest: the chunks (rows of similar length together) minimise the
    tokens run plus `overhead` per forward, never pass `forward_tokens` (a row longer than it runs alone), and skip
    rows with nothing to measure; without an overhead, as few forwards as the cap allows."""
    import itertools

    def cost(chunks, lengths, overhead):
        return sum(len(chunk) * max(lengths[row] for row in chunk) + overhead for chunk in chunks)

    generator = torch.Generator().manual_seed(0)
    for case in range(30):
        lengths = torch.randint(0, 40, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
        lengths, cap, overhead = lengths.tolist(), [0, 60][case % 2], [5, 30][case // 2 % 2]
        chunks = kl.length_chunks(lengths, cap, overhead)
        assert sorted(row for chunk in chunks for row in chunk) == [row for row, n in enumerate(lengths) if n]
        assert all(
            len(chunk) == 1 or len(chunk) * max(lengths[row] for row in chunk) <= cap or not cap for chunk in chunks
        )
        ranked = sorted((row for row, n in enumerate(lengths) if n), key=lambda row: lengths[row])
        best = math.inf
        for cuts in itertools.product([False, True], repeat=max(len(ranked) - 1, 0)):  # every contiguous partition
            parts, start = [], 0
            for end, cut in enumerate([*cuts, True], start=1):
                if cut:
                    parts.append(ranked[start:end])
                    start = end
            if parts and all(len(p) == 1 or not cap or len(p) * max(lengths[r] for r in p) <= cap for p in parts):
                best = min(best, cost(parts, lengths, overhead))
        assert cost(chunks, lengths, overhead) == (best if ranked else 0)
    assert kl.length_chunks([5, 90, 6, 7], forward_tokens=0) == [[0, 2, 3, 1]]  # one forward, padded to 90
    assert kl.length_chunks([5, 90, 6, 7], forward_tokens=0, overhead=10) == [[0, 2, 3], [1]]
    assert kl.length_chunks([5, 90, 6, 7, 0], forward_tokens=100) == [[0, 2, 3], [1]]  # 4 × 90 passes the cap


def test_features_run_rows_of_similar_length_together_and_equal_one_padded_forward():
    """The guard's rows are right-padded to the longest; `features` runs them in forwards of similar length cut to
    each forward's longest row, and returns what one padded forward gives at every position a KL reads."""
    model = tiny_qwen3(seed=3)
    ids = random_batch(6, 40, seed=3)
    mask = torch.zeros_like(ids)
    for row, (start, end) in enumerate([(4, 8), (4, 40), (6, 9), (5, 10), (4, 36), (4, 4)]):
        mask[row, start:end] = 1  # the last row generated nothing
    shapes = []

    def forward(input_ids):
        shapes.append(tuple(input_ids.shape))
        return model(input_ids=input_ids).logits

    rows = KLRows(forward, ids, mask)
    chunked = kl.features(rows, overhead=8)
    assert sorted(shapes) == [(2, 40), (3, 10)] and sum(r * n for r, n in shapes) < 6 * 40
    with torch.no_grad():
        padded = model(input_ids=ids).logits
    where = mask.bool()
    torch.testing.assert_close(chunked[where], padded[where], rtol=1e-5, atol=1e-5)
    assert chunked.shape == padded.shape and not chunked[3, 10:].any()
    shapes.clear()
    kl.features(rows)  # no overhead given: as few forwards as `forward_tokens` allows (none set: one)
    assert shapes == [(5, 40)]


def test_finite_difference_estimate_agrees_with_jvp():
    config = LoGRAConfig(rank=8, seed=1)
    model, opt, rows = prepared_optimizer(config)
    jvp = opt.probe_kl(rows, TEMPERATURE)
    opt.config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator="finite_difference", fd_step=3.0))
    finite_difference = opt.probe_kl(rows, TEMPERATURE)
    assert finite_difference == pytest.approx(jvp, rel=0.05)
    assert all(not p.requires_grad for p in model.parameters())


def test_probe_uses_first_rows_truncated_and_leaves_weights_untouched():
    config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(probe_responses=2, probe_max_tokens=16))
    model, opt, rows = prepared_optimizer(config)
    before = [p.clone() for p in model.parameters()]
    q_full = opt.probe_kl(rows, TEMPERATURE)
    q_rows = opt.probe_kl(KLRows(rows.forward, rows.input_ids[:2, :16], rows.loss_mask[:2, :16]), TEMPERATURE)
    assert q_full == q_rows
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="no generated tokens"):
        opt.probe_kl(KLRows(rows.forward, rows.input_ids, torch.zeros_like(rows.loss_mask)), TEMPERATURE)


@pytest.mark.parametrize("estimator", ["jvp", "finite_difference"])
def test_probes_through_the_lm_head_in_chunks_equal_the_full_logits(estimator):
    """forward → hidden states, head → logits of at most POSITION_CHUNK positions at a time: the predicted
    and the measured KL equal the full-logits probes' within fp32 rounding."""
    config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator=estimator, fd_step=3.0, probe_responses=3))
    model, opt, rows = prepared_optimizer(config)
    batch, loss_mask = rows.input_ids.repeat(1, 4), rows.loss_mask.repeat(1, 4)  # 3 × 90 positions: many chunks
    widths = []

    def head(hidden):
        widths.append(hidden.shape[0])
        return model.lm_head(hidden)

    def hidden_states(input_ids):
        return model.model(input_ids=input_ids).last_hidden_state

    full, chunked = KLRows(logits_fn(model), batch, loss_mask), KLRows(hidden_states, batch, loss_mask, head)
    q_full = opt.probe_kl(full, TEMPERATURE)
    q_chunked = opt.probe_kl(chunked, TEMPERATURE)
    if estimator == "finite_difference":  # the unstepped side once, kept for both steps (±fd_step): 3 passes, not 4
        chunks = len(kl.generated_positions(chunked.first(3).loss_mask))
        assert len(widths) == 3 * chunks
    assert q_chunked == pytest.approx(q_full, rel=1e-5) and q_full > 0
    measured_full = opt.realized_kl(full, TEMPERATURE, 0.5)
    measured_chunked = opt.realized_kl(chunked, TEMPERATURE, 0.5)
    assert measured_chunked.mean == pytest.approx(measured_full.mean, rel=1e-5) and measured_full.mean > 0
    assert max(widths) <= POSITION_CHUNK and len(widths) >= 4  # never all 4 × 90 positions at once


def test_a_kept_reference_gives_every_pass_the_same_kl_and_holds_at_most_its_bytes():
    """The unstepped side is computed once per comparison source: its first chunks, up to `keep_bytes`, are kept
    for the later passes (the guard's tries), the rest run through the head again; every pass gives the KL of
    `exact_kl` on the full logits."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    before, after = torch.randn(3, 150, 8), torch.randn(3, 150, 8)
    mask = torch.ones(3, 150, dtype=torch.long)
    mask[:, :10] = 0  # 3 × 140 predictions: 7 chunks
    calls = []

    def counted(hidden):
        calls.append(hidden.shape[0])
        return head(hidden)

    chunk = 2 * 8 * POSITION_CHUNK * 32  # float64 log p and p of one full chunk
    reference = kl.KLReference(before, mask, counted, TEMPERATURE, keep_bytes=2 * chunk + 1)
    with torch.no_grad():
        full = exact_kl(head(before[:, :-1]), head(after[:, :-1]), TEMPERATURE) * mask[:, 1:]
        want = full.sum(dim=1)
        passes = [kl.row_kl(reference, kl.masked_logits(after, mask, head), 3, torch.device("cpu")) for _ in range(3)]
    for sums, counts in passes:
        assert torch.allclose(sums, want, rtol=1e-12) and counts.tolist() == [140.0] * 3
    assert len(calls) == 7 + 5 + 5  # the first pass runs every chunk, the later ones all but the two kept
    assert reference.kept_chunks == 2
    # outside no_grad too, neither side records a graph through the head (a try's memory and time)
    assert not any(log_p.requires_grad for _, log_p, _ in reference)
    assert not any(logits.requires_grad for _, logits in kl.masked_logits(after, mask, head))


def test_lost_jvp_is_an_error():
    model, opt, rows = prepared_optimizer(LoGRAConfig(rank=8, seed=1))
    detached = lambda ids: model(input_ids=ids).logits.detach().clone()  # noqa: E731 - a forward that drops tangents
    with pytest.raises(RuntimeError, match="JVP was lost"):
        opt.probe_kl(KLRows(detached, rows.input_ids, rows.loss_mask), TEMPERATURE)


@pytest.mark.parametrize("case", ["causal", "gqa", "mask"])
def test_attention_in_blocks_is_the_math_kernel_with_its_tangent(case, monkeypatch):
    """The JVP's attention holds at most ATTENTION_BLOCK scores at once (here 3 query rows of 16 keys) and gives the
    math kernel's output and forward-mode tangent."""
    monkeypatch.setattr(kl, "ATTENTION_BLOCK", 2 * 4 * 3 * 16)  # batch 2 × heads 4 × 3 queries × 16 keys
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 16, 8, generator=generator)
    heads = 2 if case == "gqa" else 4
    key, value = torch.randn(2, heads, 16, 8, generator=generator), torch.randn(2, heads, 16, 8, generator=generator)
    kwargs = {"is_causal": case != "mask", "enable_gqa": case == "gqa"}
    if case == "mask":
        kwargs["attn_mask"] = torch.rand(2, 1, 16, 16, generator=generator) > 0.3
        kwargs["attn_mask"][..., 0] = True  # every query sees a key
    tangent = torch.randn(query.shape, generator=generator)
    outputs = []
    for attention in (chunked_attention, F.scaled_dot_product_attention):
        with fwAD.dual_level(), sdpa_kernel([SDPBackend.MATH]):
            out = attention(fwAD.make_dual(query, tangent), key, value, **kwargs)
            outputs.append(tuple(t.clone() for t in fwAD.unpack_dual(out)[:2]))
    (chunked, chunked_tangent), (math_out, math_tangent) = outputs
    torch.testing.assert_close(chunked, math_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked_tangent, math_tangent, rtol=1e-5, atol=1e-6)


def test_predicted_kl_is_the_second_order_term():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, dtype=torch.float64, generator=generator) * 3
    tangent = torch.randn(5, 11, dtype=torch.float64, generator=generator)
    epsilon = 1e-4
    exact = exact_kl(logits, logits + epsilon * tangent, TEMPERATURE)
    predicted = predicted_kl(logits, tangent, TEMPERATURE)
    assert predicted.dtype == torch.float64 and predicted.shape == (5,)
    torch.testing.assert_close(predicted * epsilon**2, exact, rtol=2e-4, atol=0)
    with pytest.raises(ValueError, match="temperature"):
        predicted_kl(logits, tangent, 0.0)
    with pytest.raises(ValueError, match="shape"):
        predicted_kl(logits, tangent[:, :3], 1.0)


def test_the_bound_covers_the_mean_over_the_contexts_about_as_often_as_its_confidence_where_rows_vary_mildly():
    """kl_estimate's upper bound from a sample of rows against the mean over every context they are drawn from (a
    population of 100,000): over 2,000 samples of 64 rows it covers the mean about as often as asked where the
    rows' KLs spread like a log-normal with σ 0.5, and less often where they are heavy-tailed (σ 1.5: a few rows hold
    most of the KL), which is why the guard's defaults measure many rows (docs/logra.md); the bound sits above the
    mean by more the more the rows differ."""
    generator = torch.Generator().manual_seed(0)
    population = 100_000
    counts = torch.randint(1, 6, (population,), generator=generator).double()
    noise = torch.randn(population, generator=generator, dtype=torch.float64)
    coverage = {}
    for sigma in (0.5, 1.5):
        sums = counts * torch.exp(sigma * noise)
        mean = float(sums.sum() / counts.sum())
        covered, margins = 0, []
        for _ in range(2000):
            drawn = torch.randint(population, (64,), generator=generator)
            estimate = kl_estimate(sums[drawn], counts[drawn], 0.9)
            covered += mean <= estimate.upper
            margins.append(estimate.upper / estimate.mean)
        coverage[sigma] = (covered / 2000, sum(margins) / len(margins))
    assert 0.85 <= coverage[0.5][0] <= 0.95
    assert 0.6 <= coverage[1.5][0] < coverage[0.5][0]
    assert 1 < coverage[0.5][1] < coverage[1.5][1]
    one = kl_estimate(torch.tensor([0.3], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64), 0.9)
    assert one.mean == one.upper == pytest.approx(0.1)  # a single row: no spread to bound
    with pytest.raises(RuntimeError, match="no generated tokens"):
        kl_estimate(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0.9)


class HotRows(torch.nn.Module):
    """logits = head(gain · q_proj(embed(ids))) with gain 8 on the rows whose first token is below HOT (a quarter of
    random rows): a step of q_proj moves those rows' logits 8× as far as the others', about 64× the KL. A guard
    that sees only cool rows lets through a step that moves the policy's typical context far past its budget."""

    HOT = 4

    def __init__(self, vocab: int = 16, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        gain = torch.where(input_ids[:, :1] < self.HOT, 8.0, 1.0)[..., None]
        return self.head(self.q_proj(self.embed(input_ids)) * gain)


def hot_rows_batch(rows: int, seed: int) -> KLRows:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (rows, 6), generator=generator)
    mask = torch.zeros_like(ids)
    mask[:, 2:] = 1
    return ids, mask


@pytest.mark.parametrize("guard_rows", ["probe rows only", "every row", "a random quarter"])
def test_the_committed_step_holds_its_budget_on_rows_the_guard_never_saw(guard_rows):
    """The referee: 2,048 fresh rows from the same distribution as the batch. The guard on the batch (all of it, or
    a random quarter with its upper bound) commits a step within 2× its budget there; the guard on the 2 probe rows
    (both cool: the old guard) commits one that moves fresh rows several times past it."""
    budget = 2e-2
    config = LoGRAConfig(rank=4, seed=1, update_ratio=1.0, target_modules=("q_proj",), wire_dtype="float32")
    model = HotRows()
    opt = LoGRAOptimizer(model, config)
    ids, mask = hot_rows_batch(64, seed=1)
    ids[:2, 0] = HotRows.HOT  # the probe's first rows are cool
    loss = F.cross_entropy(model(ids)[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1), reduction="sum")
    loss.backward()
    opt.prepare(num_tokens=ids[:, 1:].numel())
    rows = KLRows(model, ids, mask)
    if guard_rows == "probe rows only":  # the old guard: its 2 probe rows, accepted on their mean
        rows = rows.first(2)
        opt.config = LoGRAConfig(**{**config.to_dict(), "kl": KLConfig(guard_confidence=0.5)})
    elif guard_rows == "a random quarter":
        drawn = torch.randperm(64, generator=torch.Generator().manual_seed(5))[:16]
        rows = KLRows(model, ids[drawn], mask[drawn])

    step = opt.guarded_step(rows, TEMPERATURE, budget)
    assert step.accepted and step.measured.upper <= config.kl.max_overshoot * budget

    fresh = KLRows(model, *hot_rows_batch(2048, seed=2))
    held_out = opt.realized_kl(fresh, TEMPERATURE, step.alpha).mean
    if guard_rows == "probe rows only":
        assert held_out > 4 * budget
    else:
        assert 0.3 * budget <= held_out <= 2 * budget


class CosineHead(torch.nn.Module):
    """logits = head(cos(q_proj(embed(ids)))) around q_proj ≈ 0: cos is flat at 0, so a step of q_proj moves
    the logits at second order only. The JVP sees almost nothing (q ≈ 0, α pinned at α_max) while the true KL
    of that α is large: the quadratic model is wrong by orders of magnitude, by construction."""

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab)
        with torch.no_grad():
            self.q_proj.weight.mul_(1e-4)  # cos'(h) = −sin(h) ≈ −h: the first-order change is ~1e-4 of the second's
            self.head.weight.mul_(20.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cos(self.q_proj(self.embed(input_ids))))

    def linear_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same network without the cosine: a loss whose gradient reaches q_proj at q_proj ≈ 0."""
        return self.head(self.q_proj(self.embed(input_ids)))


def test_guard_lands_within_the_bound_where_the_quadratic_model_is_badly_wrong():
    budget = 1e-3
    jvp = KLConfig(estimator="jvp")  # the quadratic model's proposal, which the guard must correct
    config = LoGRAConfig(rank=4, seed=1, update_ratio=3e3, target_modules=("q_proj",), wire_dtype="float32", kl=jvp)
    model = CosineHead()
    opt = LoGRAOptimizer(model, config)
    batch = torch.arange(16).reshape(2, 8)
    rows = KLRows(model, batch, torch.ones_like(batch))
    model.linear_logits(batch)[..., 0].sum().backward()
    opt.prepare(num_tokens=batch.numel())

    step = opt.guarded_step(rows, TEMPERATURE, budget)

    assert step.q * config.kl.alpha_max**2 < 1e-2 * budget  # the prediction sees almost nothing ...
    assert step.proposed_alpha == config.kl.alpha_max
    assert step.tried[0][1].mean > 10 * budget and step.calibration > 1e5  # ... the true KL is far past the budget
    assert step.accepted and step.tries >= 2 and step.alpha < step.proposed_alpha
    assert budget / 3 <= step.measured.upper <= config.kl.max_overshoot * budget  # an undershooting shrink recovered
    with torch.no_grad():
        before = model(batch)
        opt.commit(step.alpha)
        after = model(batch)
    committed = float(exact_kl(before[:, :-1], after[:, :-1], TEMPERATURE).mean())
    assert committed == pytest.approx(step.kl, rel=1e-3)  # what the guard measured is what landed
    assert 0 < committed <= config.kl.max_overshoot * budget


def measured(value: float) -> KLEstimate:
    return KLEstimate(value, value, rows=4, tokens=40)


def test_guard_refuses_what_it_cannot_bring_within_the_bound():
    """A KL that does not fall with α (noise, a broken model) is refused after max_tries measurements; a KL
    within the bound is committed at the proposed α after one. Decisions read the upper bound."""
    controller = KLController(KLConfig(schedule="constant", budget=1e-3, max_overshoot=1.5, max_tries=3))
    alphas = []

    def stubborn(alpha):
        alphas.append(alpha)
        return measured(1.0)

    refused = controller.guard(q=4e-4, budget=1e-3, measure=stubborn)
    assert not refused.accepted and refused.tries == 3 and [m.mean for _, m in refused.tried] == [1.0, 1.0, 1.0]
    assert refused.proposed_alpha == pytest.approx(math.sqrt(2.5)) == alphas[0]
    assert alphas[1] == pytest.approx(alphas[0] * math.sqrt(1e-3))  # shrunk from the measurement, not q
    assert "KL guard" in refused.refusal() and "1e+03x the budget" in refused.refusal()
    assert "a floor that smaller steps do not go below" in refused.refusal()  # α shrank 300-fold, the KL not at all
    assert alphas[2] == pytest.approx(alphas[1] * 0.1)  # a KL flat in α (a plateau): shrunk tenfold

    slow = []  # a KL a little over the bound still shrinks α by at least MAX_SHRINK per try
    within = controller.guard(
        q=4e-4, budget=1e-3, measure=lambda a: slow.append(a) or measured(1.6e-3 * (a / slow[0]) ** 2)
    )
    assert within.accepted and within.tries == 2 and slow[1] == pytest.approx(0.7 * slow[0])

    def cliff(alpha):  # the shrink undershoots (1e-5); the power-law retry near the budget overshoots again
        return measured(1.0 if alpha > 0.1 else 1e-5)

    safe = controller.guard(q=4e-4, budget=1e-3, measure=cliff)
    assert safe.accepted and safe.tries == 3 and safe.kl == 1e-5 and safe.alpha == safe.tried[1][0]
    assert safe.tried[2][0] > safe.alpha and safe.tried[2][1].mean == 1.0

    once = controller.guard(q=4e-4, budget=1e-3, measure=lambda alpha: measured(1.2e-3))
    assert once.accepted and once.tries == 1 and once.alpha == once.proposed_alpha
    assert once.calibration == pytest.approx(1.2)
    wide = controller.guard(q=4e-4, budget=1e-3, measure=lambda alpha: KLEstimate(1e-3, 2e-3, rows=4, tokens=40))
    assert not wide.accepted  # the mean is within the budget, the bound is not: as far as the rows can tell
    with pytest.raises(FloatingPointError, match="measured KL"):
        controller.guard(q=4e-4, budget=1e-3, measure=lambda alpha: measured(float("nan")))


def test_guard_grows_an_undershooting_step_once_and_proposes_from_the_commits_measurements():
    """A first try far below the budget is tried again closer to it (KL ∝ α³ from one measurement, up to α_max) and
    kept if within the bound; with `estimator=previous` the next proposal is the committed steps' measured
    curvature (a geometric EMA), and the first (nothing measured yet) is α = 1."""
    config = KLConfig(schedule="constant", budget=1e-3, alpha_max=10.0, estimator="previous")
    controller = KLController(config)
    quadratic = lambda alpha: measured(1e-4 * alpha**2)  # noqa: E731 - KL(α) = 1e-4·α²
    first = controller.guard(q=None, budget=1e-3, measure=quadratic)
    assert first.proposed_alpha == 1.0 and math.isnan(first.calibration)
    assert first.tries == 2 and first.alpha == pytest.approx(10 ** (1 / 3))  # (budget / 1e-4)^(1/3)
    controller.record(1, first)
    assert controller.curvature == pytest.approx(1e-4)
    second = controller.guard(q=controller.curvature, budget=1e-3, measure=quadratic)
    assert second.tries == 1 and second.kl == pytest.approx(1e-3)  # on the budget at once
    controller.record(2, controller.guard(q=None, budget=1e-3, measure=lambda alpha: measured(8e-4 * alpha**2)))
    assert controller.curvature == pytest.approx(1e-4 * 8**0.3)  # a geometric average, weight 0.3 on the newest
    assert controller.budget_since(1, 2) == 1e-3 and controller.budget_since(0, 2) == 2e-3
    assert controller.budget_since(0, 3) is None  # version 3 was never granted a budget
    restored = KLController(config)
    restored.load_state_dict(controller.state_dict())
    assert restored.curvature == controller.curvature and restored.granted == controller.granted
    restored.load_state_dict({"mismatch": 0.1})  # a checkpoint from before either existed
    assert restored.curvature is None and restored.granted == {}


@pytest.mark.parametrize(
    ("key", "value"), [("max_overshoot", 0.9), ("max_tries", 0), ("guard_responses", -1), ("guard_confidence", 1.0)]
)
def test_guard_settings_are_checked(key, value):
    with pytest.raises(ValueError, match=f"logra.kl.{key}"):
        KLConfig(**{key: value})


def test_auto_merges_per_try_off_gpus_only_while_the_copy_is_small_and_the_rows_have_work_to_save():
    """`trial_merge=auto` holds a copy of the rank's target rows per try off GPUs, up to TRIAL_COPY_BYTES (SmolLM2's
    0.4 GiB, not a 1.5B model's 2.4 GiB a rank), for tries with TRIAL_MIN_WORK or more (SmolLM2's guard rows: ~4,800
    tokens; not the quickstart's ~450 tokens on 0.8M parameters a rank, where a forward's fixed cost dominates);
    per_try and per_unit are what they say."""
    from logra_rl.logra.config import TRIAL_COPY_BYTES

    auto = KLConfig()
    assert auto.merges_per_try(cuda=False, copy_bytes=0.4 * 2**30)
    assert auto.merges_per_try(cuda=False, copy_bytes=0.4 * 2**30, tokens=4800)
    assert not auto.merges_per_try(cuda=False, copy_bytes=4 * 0.8e6, tokens=450)
    assert not auto.merges_per_try(cuda=False, copy_bytes=TRIAL_COPY_BYTES + 1)
    assert not auto.merges_per_try(cuda=True, copy_bytes=1)
    assert KLConfig(trial_merge="per_try").merges_per_try(cuda=True, copy_bytes=10 * TRIAL_COPY_BYTES, tokens=1)
    assert not KLConfig(trial_merge="per_unit").merges_per_try(cuda=False, copy_bytes=1)


def test_cosine_schedule_endpoints_and_reference_values():
    config = KLConfig()
    assert scheduled_budget(config, 0) == pytest.approx(2e-4, rel=1e-12)
    assert scheduled_budget(config, 299) == pytest.approx(2e-5, rel=1e-12)
    assert scheduled_budget(config, 1000) == pytest.approx(2e-5, rel=1e-12)
    for update, value in [(50, 1.8786e-4), (100, 1.5473e-4), (149, 1.1047e-4), (199, 6.527e-5)]:
        assert scheduled_budget(config, update) == pytest.approx(value, rel=1e-4)
    constant = KLConfig(schedule="constant", budget=1.5e-4)
    assert {scheduled_budget(constant, n) for n in (0, 150, 299, 5000)} == {1.5e-4}


def test_a_warm_up_grows_the_budget_linearly_then_follows_the_schedule():
    """`warmup_steps=4`: updates 0-3 get 1/4 .. 4/4 of the scheduled budget, later ones the schedule itself (which
    keeps counting from update 0); 0 is no warm-up; a negative count is refused."""
    plain, warm = KLConfig(), KLConfig(warmup_steps=4)
    for update in range(4):
        assert scheduled_budget(warm, update) == pytest.approx((update + 1) / 4 * scheduled_budget(plain, update))
    assert all(scheduled_budget(warm, n) == scheduled_budget(plain, n) for n in (4, 50, 299, 1000))
    constant = KLConfig(schedule="constant", budget=1e-3, warmup_steps=2)
    assert [scheduled_budget(constant, n) for n in range(3)] == pytest.approx([5e-4, 1e-3, 1e-3])
    with pytest.raises(ValueError, match=r"logra\.kl\.warmup_steps"):
        KLConfig(warmup_steps=-1)


def test_step_scale_rule():
    alpha = step_scale(0.008, 2e-4, 3.0)
    assert alpha == pytest.approx(math.sqrt(0.025)) and alpha**2 * 0.008 == pytest.approx(2e-4)
    assert step_scale(1e-12, 2e-4, 3.0) == 3.0
    assert step_scale(0.0, 2e-4, 3.0) == 1.0
    for q in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(FloatingPointError):
            step_scale(q, 2e-4, 3.0)
    with pytest.raises(ValueError):
        step_scale(1e-3, 0.0, 3.0)


def test_mismatch_subtraction_arithmetic():
    controller = KLController(KLConfig(schedule="constant", budget=2e-4))
    assert controller.step_budget(0, mismatch_sum=0.0, mismatch_tokens=0) == 2e-4 and controller.mismatch == 0
    # observed 1e-4 -> m = 0.3e-4 -> δ_eff = 1.7e-4
    assert controller.step_budget(1, mismatch_sum=0.1, mismatch_tokens=1000) == pytest.approx(1.7e-4)
    assert controller.mismatch == pytest.approx(3e-5)
    # a negative observation counts as 0: m = 0.7 * 3e-5
    assert controller.step_budget(2, mismatch_sum=-5.0, mismatch_tokens=1000) == pytest.approx(2e-4 - 2.1e-5)
    # no finished responses: m unchanged and the budget not reduced
    assert controller.step_budget(3) == 2e-4 and controller.mismatch == pytest.approx(2.1e-5)
    # a large mismatch hits the floor 0.5·δ
    assert controller.step_budget(4, mismatch_sum=10.0, mismatch_tokens=100) == pytest.approx(1e-4)
    with pytest.raises(FloatingPointError):
        controller.step_budget(5, mismatch_sum=float("nan"), mismatch_tokens=3)
    off = KLController(KLConfig(schedule="constant", mismatch_subtraction=False))
    assert off.step_budget(0, mismatch_sum=10.0, mismatch_tokens=100) == 2e-4 and off.mismatch == 0


def committed(controller: KLController, version: int, budget: float) -> None:
    """An update that made `version` was committed at `budget`, as far as the controller reads the guard."""
    controller.record(version, GuardedStep(None, budget, ((1.0, estimate(budget)),), 1.0, estimate(budget), True, 0.0))


def estimate(kl: float) -> KLEstimate:
    return KLEstimate(kl, kl, 10, 100)


def test_what_a_stale_batch_shows_its_updates_overshot_is_a_debt_the_next_budgets_pay_in_full():
    """A batch sampled `staleness` updates ago (algorithm.max_staleness) is expected to be the budgets those updates
    were granted away, plus the engines' numerics (the behaviour KL of on-policy batches). What it is beyond that is
    owed, whether the batch trains or is refused, and taken off the next budgets down to the floor until it is paid:
    nothing is forgiven, with mismatch subtraction on or off, for every update (PPO epochs after the first too)."""
    for subtraction in (True, False):
        controller = KLController(KLConfig(schedule="constant", budget=2e-4, mismatch_subtraction=subtraction))
        controller.observe_numerics(1e-5)  # step 0: sampled by the policy it trains
        assert controller.numerics == 1e-5 and controller.debt == 0
        assert controller.step_budget(0) == 2e-4
        committed(controller, 1, 2e-4)
        # one update behind, 5e-4 away: 2.9e-4 beyond the 2e-4 granted and the 1e-5 numerics
        controller.owe(1, behaviour_kl=5e-4, staleness=1)
        assert controller.debt == pytest.approx(2.9e-4)
        assert controller.step_budget(1) == pytest.approx(1e-4)  # the floor, 0.5·δ; 1e-4 of the debt paid...
        committed(controller, 2, 1e-4)
        assert controller.debt == pytest.approx(1.9e-4)  # ...once the update commits
        assert controller.step_budget(2) == pytest.approx(1e-4)  # an update the guard refuses pays nothing
        assert controller.debt == pytest.approx(1.9e-4)
        # a refused batch owes too: one update behind the 1e-4 granted to version 2, 3e-4 away; a debt once its
        # step trains on the batch generated again (a step stopped before then refuses it again when it reruns)
        controller.owe(2, behaviour_kl=3e-4, staleness=1, refused_at=7)
        stopped = controller.state_dict()  # a checkpoint while it is generated again: the step reruns on resume
        controller.owe(2, behaviour_kl=3e-4, staleness=1, refused_at=7)  # refused again by the rerun: owed once
        assert controller.debt == pytest.approx(1.9e-4) and controller.refused == {7: pytest.approx(1.9e-4)}
        controller.carry_refused()
        assert controller.debt == pytest.approx(1.9e-4 + 1.9e-4) and controller.refused == {}
        resumed = KLController(controller.config)
        resumed.load_state_dict(stopped)
        resumed.owe(2, behaviour_kl=3e-4, staleness=1, refused_at=7)
        resumed.carry_refused()
        assert resumed.debt == pytest.approx(controller.debt)
        for version in range(3, 7):
            controller.step_budget(version)
            committed(controller, version + 1, 1e-4)
        assert controller.debt == pytest.approx(0, abs=1e-12)  # paid 1e-4 an update, never more than owed
        assert controller.step_budget(7) == pytest.approx(2e-4)
        # as far as the skipped update was allowed to move it, plus the numerics: nothing owed
        expected = scheduled_budget(controller.config, 7) + 1e-5
        controller.owe(8, behaviour_kl=expected, staleness=1)
        assert controller.debt == pytest.approx(0, abs=1e-12)
        # one-sided: a batch under its updates' budgets owes nothing and pays nothing back
        controller.owe(8, behaviour_kl=expected + 5e-5, staleness=1)
        controller.owe(8, behaviour_kl=expected - 3e-5, staleness=1)
        assert controller.debt == pytest.approx(5e-5)
        with pytest.raises(FloatingPointError):
            controller.owe(9, behaviour_kl=float("nan"), staleness=1)
    # the granted part on a cosine schedule: the budgets of the updates the batch is behind
    cosine = KLController(KLConfig(schedule="cosine", budget=4e-4, final_budget=1e-4, schedule_steps=3))
    cosine.owe(2, behaviour_kl=scheduled_budget(cosine.config, 1) + 2e-5, staleness=1)
    assert cosine.debt == pytest.approx(2e-5)


def test_the_default_staleness_bound_follows_the_budget_and_sits_above_the_numerics():
    """Twice what the guard lets the updates a batch is behind move the policy (max_overshoot × their budgets),
    plus 4 × the measured numerics: late in a cosine run it follows the budget down; under bf16 numerics (~2e-3
    per token, far above a 1e-4 budget) it stays above them instead of refusing every stale batch."""
    cosine = KLController(KLConfig(schedule="cosine", budget=4e-4, final_budget=1e-4, schedule_steps=10))
    assert cosine.staleness_bound(1, 1) == pytest.approx(2 * 1.5 * 4e-4)
    assert cosine.staleness_bound(20, 1) == pytest.approx(2 * 1.5 * 1e-4)  # the schedule's end
    assert cosine.staleness_bound(20, 2) == pytest.approx(2 * 1.5 * 2e-4)  # two updates behind (PPO epochs)
    bf16 = KLController(KLConfig(schedule="constant", budget=1e-4, max_overshoot=1.5))
    bf16.observe_numerics(2e-3)
    assert bf16.staleness_bound(5, 1) == pytest.approx(3e-4 + 8e-3) and bf16.staleness_bound(5, 1) > 3 * 2e-3
    committed(bf16, 5, 5e-5)  # where the controller remembers the budget it granted, that one
    assert bf16.staleness_bound(5, 1) == pytest.approx(1.5e-4 + 8e-3)
    restored = KLController(bf16.config)
    restored.load_state_dict(bf16.state_dict())
    assert restored.numerics == bf16.numerics and restored.staleness_bound(5, 1) == bf16.staleness_bound(5, 1)
