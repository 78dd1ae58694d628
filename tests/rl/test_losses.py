import pytest
import torch

from logra_rl.rl import RunningBaseline, length_weighted, policy_gradient_loss


def test_reinforce_gradient_matches_the_reference_recipe():
    """∂L/∂log π = −A'·min(π_train/π_rollout, 2)·mask, with A' length-weighted."""
    baseline = RunningBaseline()
    baseline.value = 0.2
    outcomes = torch.tensor([1.0, 0.0])
    lengths = torch.tensor([2, 6])
    advantages = length_weighted(baseline.advantages(outcomes), lengths, 1024).float()
    logprobs = torch.full((2, 6), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    ratios = torch.tensor([0.5, 3.0])  # π_train / π_rollout per row: one below the cap, one above
    rollout = logprobs.detach() - ratios.log()[:, None]
    loss, stats = policy_gradient_loss(logprobs, rollout, advantages, mask, tis_cap=2.0)
    loss.backward()
    o = torch.tensor([1.0, -0.01])
    expected = -(o - 0.2)[:, None] * (1024 / lengths[:, None]) * ratios.clamp(max=2)[:, None] * mask
    torch.testing.assert_close(logprobs.grad, expected)
    assert stats.tokens == 8 and stats.is_truncated == 6
    assert stats.is_ratio_sum == pytest.approx(2 * 0.5 + 6 * 3.0)


def test_ppo_clipping_stops_the_gradient_outside_the_trust_region():
    old = torch.zeros(1, 3)
    logprobs = torch.tensor([[0.5, -0.5, 0.05]], requires_grad=True)  # ratios e^0.5, e^-0.5, e^0.05
    mask = torch.ones(1, 3)
    loss, stats = policy_gradient_loss(
        logprobs, old, torch.tensor([1.0]), mask, old_logprobs=old, clip_low=0.2, clip_high=0.2
    )
    loss.backward()
    # A > 0: the ratio e^0.5 > 1.2 is clipped (no gradient); e^-0.5 and e^0.05 still push up
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] < 0 and logprobs.grad[0, 2] < 0
    assert stats.clipped == 1


@pytest.mark.parametrize(
    ("clip_low", "clip_high", "advantage", "clipped_token"),
    [
        (0.2, None, -1.0, 0),  # A < 0 clips on the low side only: ratio e^-0.5 < 0.8 stops pushing down
        (None, 0.2, -1.0, None),  # ... and with no low bound nothing clips
        (None, 0.2, 1.0, 1),  # A > 0 clips on the high side only: ratio e^0.5 > 1.2 stops pushing up
        (0.2, None, 1.0, None),  # ... and with no high bound nothing clips
    ],
)
def test_a_missing_clip_bound_leaves_that_side_unclipped(clip_low, clip_high, advantage, clipped_token):
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[-0.5, 0.5]], requires_grad=True)  # ratios e^-0.5 (< 0.8) and e^0.5 (> 1.2)
    loss, stats = policy_gradient_loss(
        logprobs,
        old,
        torch.tensor([advantage]),
        torch.ones(1, 2),
        old_logprobs=old,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    loss.backward()
    for token in (0, 1):
        assert (logprobs.grad[0, token] == 0) == (token == clipped_token), token
    assert stats.clipped == float(clipped_token is not None)


def test_one_update_per_step_needs_no_old_logprob_pass():
    """With one update per step π_old is the current policy: the clipped loss from the current log-probs
    (no separate no-grad pass) has the old-log-prob pass's value and gradient, with nothing clipped."""
    torch.manual_seed(0)
    values = torch.randn(3, 5) - 2
    rollout, advantages, mask = values + 0.1 * torch.randn(3, 5), torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 5)
    results = []
    for old in (values.clone(), None):  # the separate pass's values, or none
        logprobs = values.clone().requires_grad_(True)
        loss, stats = policy_gradient_loss(
            logprobs, rollout, advantages, mask, old_logprobs=old, clip_low=0.2, clip_high=0.28
        )
        loss.backward()
        results.append((loss.detach(), logprobs.grad, stats.clipped))
    (loss_a, grad_a, clipped_a), (loss_b, grad_b, clipped_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and clipped_a == clipped_b == 0


def test_an_entropy_bonus_subtracts_coeff_times_the_entropy_of_each_loss_token():
    """L = L_pg − c·Σ_loss tokens H: ∂L/∂H = −c on the loss tokens, 0 elsewhere; the entropies are summed for the
    metric whatever c, and c > 0 without entropies is refused."""
    logprobs = torch.full((1, 3), -1.0, requires_grad=True)
    entropy = torch.tensor([[2.0, 0.5, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    plain, _ = policy_gradient_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask)
    loss, stats = policy_gradient_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0]), mask, entropy=entropy, entropy_coeff=0.1
    )
    loss.backward()
    assert float(loss) == pytest.approx(float(plain) - 0.1 * 2.5)
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1, -0.1, 0.0]]))
    assert stats.entropy == pytest.approx(2.5)
    _, metric_only = policy_gradient_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, entropy=entropy)
    assert metric_only.entropy == pytest.approx(2.5)
    with pytest.raises(ValueError, match="entropies"):
        policy_gradient_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, entropy_coeff=0.1)
