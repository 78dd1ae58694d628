import pytest

from logra_rl.config import OptimizerConfig, RunConfig
from logra_rl.train.optimizers import dense_lr_factor


def test_dense_schedule_matches_the_paper_baseline():
    config = OptimizerConfig(name="dense")
    lr = [config.lr * dense_lr_factor(i, config) for i in range(301)]
    assert lr[0] == pytest.approx(1e-6 / 9)
    assert lr[8] == pytest.approx(1e-6)
    assert lr[100] == pytest.approx(7.96e-7, rel=1e-3)
    assert lr[199] == pytest.approx(3.38e-7, rel=1e-3)
    assert lr[299] == pytest.approx(1e-7) and lr[300] == pytest.approx(1e-7)


def test_dense_update_rescales_fsdp_averaged_gradients_and_skips_non_finite_ones():
    import torch

    from logra_rl.train.api import FullResync, NoChange
    from logra_rl.train.optimizers import DenseUpdate, KLProbe, UpdateInputs

    model = torch.nn.Linear(4, 3)
    update = DenseUpdate(model, RunConfig(optimizer=OptimizerConfig(name="dense", lr=1e-2)), world_size=2)

    def probe() -> KLProbe:
        raise AssertionError("the dense rule must not build a KL probe")

    for p in model.parameters():
        p.grad = torch.ones_like(p)
    metrics, outcome = update.update(
        UpdateInputs(step=0, num_tokens=10, mismatch_sum=0, mismatch_tokens=0, probe=probe)
    )
    assert outcome == FullResync() and metrics["actor/skipped"] == 0.0 and update.version == 1
    assert metrics["actor/grad_norm"] == pytest.approx((15 * (2 / 10) ** 2) ** 0.5)  # 15 ones × world / tokens
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    metrics, outcome = update.update(
        UpdateInputs(step=1, num_tokens=10, mismatch_sum=0, mismatch_tokens=0, probe=probe)
    )
    assert metrics["actor/skipped"] == 1.0 and isinstance(outcome, NoChange) and update.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
