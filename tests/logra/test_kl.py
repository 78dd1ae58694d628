"""Predicted-KL control: the prediction against the exact KL of the committed step, and the controller."""

import math

import pytest
import torch

from logra_rl.logra import (
    KLConfig,
    KLController,
    LoGRAConfig,
    LoGRAOptimizer,
    exact_kl,
    predicted_kl,
    scheduled_budget,
    step_scale,
)
from logra_rl.logra.kl import POSITION_CHUNK
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
    return model, opt, batch, loss_mask


def committed_kl(model, opt, batch, loss_mask, alpha):
    """Mean exact KL(π_before ‖ π_after) over generated-token predictions of the probed rows."""
    rows = batch[: opt.config.kl.probe_responses]
    with torch.no_grad():
        before = model(input_ids=rows).logits
        opt.commit(alpha)
        after = model(input_ids=rows).logits
    mask = loss_mask[: rows.shape[0], 1:].bool()
    return float(exact_kl(before[:, :-1], after[:, :-1], TEMPERATURE)[mask].mean())


def test_prediction_matches_exact_kl_of_committed_step():
    model, opt, batch, loss_mask = prepared_optimizer(LoGRAConfig(rank=8, seed=1, wire_dtype="float32"))
    q = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)
    alpha = 0.5
    actual = committed_kl(model, opt, batch, loss_mask, alpha)
    assert actual > 0
    assert q * alpha**2 == pytest.approx(actual, rel=0.03)


def test_realized_kl_is_the_kl_of_the_committed_wire_rounded_step():
    model, opt, batch, loss_mask = prepared_optimizer(LoGRAConfig(rank=8, seed=1, update_ratio=1e-3))
    alpha = 2.0
    realised = opt.realized_kl(logits_fn(model), batch, loss_mask, TEMPERATURE, alpha)
    assert realised == pytest.approx(committed_kl(model, opt, batch, loss_mask, alpha), rel=1e-3)


def test_finite_difference_estimate_agrees_with_jvp():
    config = LoGRAConfig(rank=8, seed=1)
    model, opt, batch, loss_mask = prepared_optimizer(config)
    jvp = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)
    opt.config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator="finite_difference", fd_step=3.0))
    finite_difference = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)
    assert finite_difference == pytest.approx(jvp, rel=0.05)
    assert all(not p.requires_grad for p in model.parameters())


def test_probe_uses_first_rows_truncated_and_leaves_weights_untouched():
    config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(probe_responses=2, probe_max_tokens=16))
    model, opt, batch, loss_mask = prepared_optimizer(config)
    before = [p.clone() for p in model.parameters()]
    q_full = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)
    q_rows = opt.probe_kl(logits_fn(model), batch[:2, :16], loss_mask[:2, :16], TEMPERATURE)
    assert q_full == q_rows
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="no generated tokens"):
        opt.probe_kl(logits_fn(model), batch, torch.zeros_like(loss_mask), TEMPERATURE)


@pytest.mark.parametrize("estimator", ["jvp", "finite_difference"])
def test_probes_through_the_lm_head_in_chunks_equal_the_full_logits(estimator):
    """forward → hidden states, head → logits of at most POSITION_CHUNK positions at a time: the predicted
    and the realised KL equal the full-logits probes' within fp32 rounding."""
    config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator=estimator, fd_step=3.0, probe_responses=3))
    model, opt, batch, loss_mask = prepared_optimizer(config)
    batch, loss_mask = batch.repeat(1, 4), loss_mask.repeat(1, 4)  # 96 positions: two chunks
    widths = []

    def head(hidden):
        widths.append(hidden.shape[1])
        return model.lm_head(hidden)

    def hidden_states(input_ids):
        return model.model(input_ids=input_ids).last_hidden_state

    q_full = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)
    q_chunked = opt.probe_kl(hidden_states, batch, loss_mask, TEMPERATURE, head)
    assert q_chunked == pytest.approx(q_full, rel=1e-5) and q_full > 0
    realised_full = opt.realized_kl(logits_fn(model), batch, loss_mask, TEMPERATURE, 0.5)
    realised_chunked = opt.realized_kl(hidden_states, batch, loss_mask, TEMPERATURE, 0.5, head)
    assert realised_chunked == pytest.approx(realised_full, rel=1e-5) and realised_full > 0
    assert max(widths) <= POSITION_CHUNK and len(widths) >= 2 * 2  # never the whole 95 positions at once


def test_lost_jvp_is_an_error():
    model, opt, batch, loss_mask = prepared_optimizer(LoGRAConfig(rank=8, seed=1))
    detached = lambda ids: model(input_ids=ids).logits.detach().clone()  # noqa: E731 - a forward that drops tangents
    with pytest.raises(RuntimeError, match="JVP was lost"):
        opt.probe_kl(detached, batch, loss_mask, TEMPERATURE)


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


def test_cosine_schedule_endpoints_and_reference_values():
    config = KLConfig()
    assert scheduled_budget(config, 0) == pytest.approx(2e-4, rel=1e-12)
    assert scheduled_budget(config, 299) == pytest.approx(2e-5, rel=1e-12)
    assert scheduled_budget(config, 1000) == pytest.approx(2e-5, rel=1e-12)
    for update, value in [(50, 1.8786e-4), (100, 1.5473e-4), (149, 1.1047e-4), (199, 6.527e-5)]:
        assert scheduled_budget(config, update) == pytest.approx(value, rel=1e-4)
    constant = KLConfig(schedule="constant", budget=1.5e-4)
    assert {scheduled_budget(constant, n) for n in (0, 150, 299, 5000)} == {1.5e-4}


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


def test_finite_difference_and_realised_kl_are_unbiased_under_bf16_compute(monkeypatch):
    """Under bf16 autocast a LoGRA-sized step (update ratio 6e-5) is below half a bf16 ulp of the layer
    outputs. Measured at h = 1 the finite-difference q is far off the fp32 JVP; enlarged until resolved
    and scaled back, q and the realised KL agree with the fp32 figures."""
    import logra_rl.logra.kl as kl

    model, opt, batch, loss_mask = prepared_optimizer(LoGRAConfig(rank=8, seed=1))
    reference = opt.probe_kl(logits_fn(model), batch, loss_mask, TEMPERATURE)  # JVP, fp32
    alpha = 2.0
    realised_fp32 = opt.realized_kl(logits_fn(model), batch, loss_mask, TEMPERATURE, alpha)
    opt.config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator="finite_difference"))

    def bf16(input_ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=input_ids).logits

    assert bf16(batch).dtype == torch.bfloat16
    finite_difference = opt.probe_kl(bf16, batch, loss_mask, TEMPERATURE)
    realised = opt.realized_kl(bf16, batch, loss_mask, TEMPERATURE, alpha)
    assert finite_difference == pytest.approx(reference, rel=0.1)
    assert realised == pytest.approx(realised_fp32, rel=0.1)
    jvp_bf16 = LoGRAConfig(rank=8, seed=1)  # the JVP runs its tangent in fp32 and needs no enlarging
    opt.config = jvp_bf16
    assert opt.probe_kl(bf16, batch, loss_mask, TEMPERATURE) == pytest.approx(reference, rel=0.1)

    monkeypatch.setattr(kl, "LOW_PRECISION_RESOLUTION", 0.0)  # the old behaviour: measured at h = 1
    opt.config = LoGRAConfig(rank=8, seed=1, kl=KLConfig(estimator="finite_difference"))
    naive = opt.probe_kl(bf16, batch, loss_mask, TEMPERATURE)
    assert abs(naive - reference) > 0.5 * reference  # measured here: 60× too large
    assert abs(opt.realized_kl(bf16, batch, loss_mask, TEMPERATURE, alpha) - realised_fp32) > 0.5 * realised_fp32


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
    config = LoGRAConfig(rank=4, seed=1, update_ratio=3e3, target_modules=("q_proj",), wire_dtype="float32")
    model = CosineHead()
    opt = LoGRAOptimizer(model, config)
    batch = torch.arange(16).reshape(2, 8)
    loss_mask = torch.ones_like(batch)
    model.linear_logits(batch)[..., 0].sum().backward()
    opt.prepare(num_tokens=batch.numel())

    step = opt.guarded_step(model, batch, loss_mask, TEMPERATURE, budget)

    assert step.q * config.kl.alpha_max**2 < 1e-2 * budget  # the prediction sees almost nothing ...
    assert step.proposed_alpha == config.kl.alpha_max
    assert step.tried[0][1] > 10 * budget and step.calibration > 1e5  # ... the true KL is far past the budget
    assert step.accepted and step.tries >= 2 and step.alpha < step.proposed_alpha
    assert 0.5 * budget <= step.kl <= config.kl.max_overshoot * budget  # the undershooting shrink was recovered
    with torch.no_grad():
        before = model(batch)
        opt.commit(step.alpha)
        after = model(batch)
    committed = float(exact_kl(before[:, :-1], after[:, :-1], TEMPERATURE).mean())
    assert committed == pytest.approx(step.kl, rel=1e-3)  # what the guard measured is what landed
    assert 0 < committed <= config.kl.max_overshoot * budget


def test_guard_refuses_what_it_cannot_bring_within_the_bound():
    """A KL that does not fall with α (noise, a broken model) is refused after max_tries measurements; a KL
    within the bound is committed at the proposed α after one."""
    controller = KLController(KLConfig(schedule="constant", budget=1e-3, max_overshoot=1.5, max_tries=3))
    alphas = []

    def stubborn(alpha):
        alphas.append(alpha)
        return 1.0

    refused = controller.guard(q=4e-4, budget=1e-3, realized_kl=stubborn)
    assert not refused.accepted and refused.tries == 3 and [kl for _, kl in refused.tried] == [1.0, 1.0, 1.0]
    assert refused.proposed_alpha == pytest.approx(math.sqrt(2.5)) == alphas[0]
    assert alphas[1] == pytest.approx(alphas[0] * math.sqrt(1e-3))  # shrunk from the measurement, not q
    assert "KL guard" in refused.refusal() and "1e+03x the budget" in refused.refusal()

    slow = []  # a KL a little over the bound still shrinks α by at least MAX_SHRINK per try
    within = controller.guard(q=4e-4, budget=1e-3, realized_kl=lambda a: slow.append(a) or 1.6e-3 * (a / slow[0]) ** 2)
    assert within.accepted and within.tries == 2 and slow[1] == pytest.approx(0.7 * slow[0])

    def cliff(alpha):  # the shrink undershoots (1e-5); the power-law retry near the budget overshoots again
        return 1.0 if alpha > 0.1 else 1e-5

    safe = controller.guard(q=4e-4, budget=1e-3, realized_kl=cliff)
    assert safe.accepted and safe.tries == 3 and safe.kl == 1e-5 and safe.alpha == safe.tried[1][0]
    assert safe.tried[2][0] > safe.alpha and safe.tried[2][1] == 1.0

    once = controller.guard(q=4e-4, budget=1e-3, realized_kl=lambda alpha: 1.2e-3)
    assert once.accepted and once.tries == 1 and once.alpha == once.proposed_alpha
    assert once.calibration == pytest.approx(1.2)
    with pytest.raises(FloatingPointError, match="realised KL"):
        controller.guard(q=4e-4, budget=1e-3, realized_kl=lambda alpha: float("nan"))


@pytest.mark.parametrize(("key", "value"), [("max_overshoot", 0.9), ("max_tries", 0)])
def test_guard_settings_are_checked(key, value):
    with pytest.raises(ValueError, match=f"logra.kl.{key}"):
        KLConfig(**{key: value})


def test_a_stale_batch_is_charged_the_behaviour_kl_its_skipped_updates_were_not_granted():
    """A batch sampled `staleness` updates ago (algorithm.max_staleness) is expected to be the sum of those
    updates' budgets away: only what its behaviour KL exceeds that by is charged (or the on-policy mismatch EMA
    when larger), and a stale batch leaves the EMA as on-policy batches measured it. The floor holds."""
    controller = KLController(KLConfig(schedule="constant", budget=2e-4))
    controller.step_budget(0, mismatch_sum=0.1, mismatch_tokens=1000)  # EMA 3e-5 from an on-policy batch
    # one update behind, 2.5e-4 away: 5e-5 beyond the 2e-4 granted -> δ_eff = 2e-4 − 5e-5
    assert controller.stale_budget(1, behaviour_kl=2.5e-4, staleness=1) == pytest.approx(1.5e-4)
    assert controller.mismatch == pytest.approx(3e-5)
    # as far as the skipped update was allowed to move it: only the EMA is charged
    assert controller.stale_budget(2, behaviour_kl=2e-4, staleness=1) == pytest.approx(2e-4 - 3e-5)
    # two updates behind, 4.5e-4 away: 5e-5 beyond 2 × 2e-4
    assert controller.stale_budget(3, behaviour_kl=4.5e-4, staleness=2) == pytest.approx(1.5e-4)
    assert controller.stale_budget(4, behaviour_kl=1.0, staleness=1) == pytest.approx(1e-4)  # the floor, 0.5·δ
    with pytest.raises(FloatingPointError):
        controller.stale_budget(5, behaviour_kl=float("nan"), staleness=1)
    # on a cosine schedule the granted part is the budgets of the updates skipped over
    cosine = KLController(KLConfig(schedule="cosine", budget=4e-4, final_budget=1e-4, schedule_steps=3))
    granted = scheduled_budget(cosine.config, 1)  # 2.5e-4, the budget of update 1 (the batch skipped it)
    assert cosine.stale_budget(2, behaviour_kl=granted + 2e-5, staleness=1) == pytest.approx(1e-4 - 2e-5)
    assert cosine.stale_budget(1, behaviour_kl=scheduled_budget(cosine.config, 0), staleness=1) == pytest.approx(
        scheduled_budget(cosine.config, 1)
    )
    off = KLController(KLConfig(schedule="constant", budget=2e-4, mismatch_subtraction=False))
    assert off.stale_budget(0, behaviour_kl=1e-3, staleness=1) == 2e-4  # mismatch_subtraction=false charges nothing
