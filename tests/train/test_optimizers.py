import subprocess

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
    config = RunConfig(optimizer=OptimizerConfig(name="dense", lr=1e-2, measure_kl=False))
    update = DenseUpdate(model, config, world_size=2)

    def probe() -> KLProbe:
        raise AssertionError("with optimizer.measure_kl=false the dense rule must not build a KL probe")

    for p in model.parameters():
        p.grad = torch.ones_like(p)
    metrics, outcome = update.update(
        UpdateInputs(step=0, num_tokens=10, mismatch_sum=0, mismatch_tokens=0, probe=probe)
    )
    assert outcome == FullResync() and metrics["train/skipped"] == 0.0 and update.version == 1
    assert metrics["train/grad_norm"] == pytest.approx((15 * (2 / 10) ** 2) ** 0.5)  # 15 ones × world / tokens
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    metrics, outcome = update.update(
        UpdateInputs(step=1, num_tokens=10, mismatch_sum=0, mismatch_tokens=0, probe=probe)
    )
    assert metrics["train/skipped"] == 1.0 and isinstance(outcome, NoChange) and update.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_a_dense_step_reports_the_exact_kl_it_moved_the_policy_by():
    """`train/kl_realized` of a dense step is KL(π_before ‖ π_after) per generated token on the probe rows, the
    head included (a trained LM head changes the logits too), and the step itself is the plain AdamW step."""
    import torch

    from logra_rl.logra import exact_kl
    from logra_rl.train.optimizers import DenseUpdate, KLProbe, UpdateInputs, dense_lr_factor

    torch.manual_seed(0)
    body, head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)
    model = torch.nn.Sequential(body, head)
    twin = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    twin.load_state_dict(model.state_dict())
    config = RunConfig(optimizer=OptimizerConfig(name="dense", lr=3e-2, warmup_steps=0))
    update, reference = (
        DenseUpdate(model, config, world_size=1),
        torch.optim.AdamW(
            twin.parameters(),
            lr=3e-2 * dense_lr_factor(0, config.optimizer),
            betas=config.optimizer.betas,
            eps=config.optimizer.eps,
            weight_decay=0.0,
        ),
    )
    input_ids = torch.randint(0, 11, (3, 7))
    loss_mask = torch.zeros(3, 7)
    loss_mask[:, 4:] = 1  # the generated tokens: logits at positions 3..5 predict them
    probe = KLProbe(forward=body, input_ids=input_ids, loss_mask=loss_mask, head=head)
    for net in (model, twin):
        net(input_ids).logsumexp(-1).sum().backward()
    with torch.no_grad():
        before = model(input_ids)
    metrics, _ = update.update(
        UpdateInputs(step=0, num_tokens=1, mismatch_sum=0, mismatch_tokens=0, probe=lambda: probe)
    )
    reference.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    with torch.no_grad():
        after = model(input_ids)
    where = loss_mask[:, 1:].bool()
    want = exact_kl(before[:, :-1][where], after[:, :-1][where], config.rollout.temperature).mean()
    assert want > 1e-3  # the step moved the policy measurably
    assert metrics["train/kl_realized"] == pytest.approx(float(want), rel=1e-6)
    assert model.training  # the probe's eval mode is undone


def test_the_quickstart_commits_no_step_past_its_kl_bound(tmp_path):
    """`logra-train` as `make run` runs it (the real quickstart, first 60 of its 200 steps: the phase where the
    quadratic prediction missed by up to 700x and a committed overshoot collapsed the run). Every committed
    step is within max_overshoot x its budget; the guard had work to do (proposals past the bound, shrunk);
    and the policy learns."""
    from tests.runs import LOGRA_TRAIN, records

    args = ["trainer.total_steps=60", "eval.every=0", "trainer.checkpoint_every=0", "trainer.run_name=guard"]
    args += ["logger.progress=false", "logger.plot=false"]
    result = subprocess.run([LOGRA_TRAIN, *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(tmp_path / "outputs/quickstart/guard") if "reward/mean" in r]
    assert len(steps) == 60
    committed = [r for r in steps if r.get("train/kl_realized") is not None]
    assert len(committed) >= 55 and sum(r.get("logra/overshoot_refused", 0) for r in steps) <= 5
    for r in committed:
        assert r["train/kl_realized"] <= 1.5 * r["logra/kl_budget"], r
    proposed = [r for r in steps if r.get("logra/kl_realized_over_predicted") is not None]  # probed, q > 0
    first_try = [
        r["logra/kl_realized_over_predicted"] * r["logra/kl_per_unit_step"] * r["logra/alpha_proposed"] ** 2
        for r in proposed
    ]
    overshot = [r for r, kl in zip(proposed, first_try, strict=True) if kl > 1.5 * r["logra/kl_budget"]]
    assert len(overshot) >= 3  # proposals the old controller would have committed past the bound
    assert all(r["logra/line_search_tries"] >= 2 for r in overshot)
    rewards = [r["reward/mean"] for r in steps]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.03
