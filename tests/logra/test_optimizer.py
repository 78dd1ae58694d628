"""LoGRAOptimizer: the update it commits, its state, and the errors users see."""

import io

import pytest
import torch
from torch import nn

from logra_rl.logra import LoGRAConfig, LoGRAOptimizer, make_projection
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss

BATCHES = [random_batch(2, 16, seed=s) for s in range(6)]


def backward_and_prepare(model, opt, batch):
    token_sum_loss(model, batch).backward()
    return opt.prepare(num_tokens=batch[:, 1:].numel())


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("alpha", [0.7, 2.5])
def test_global_update_ratio_and_row_space(alpha):
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5, update_ratio=0.01, wire_dtype="float32"))
    before = weights(model)
    assert backward_and_prepare(model, opt, BATCHES[0]) > 0
    proposal = [(module, a.clone(), d.clone()) for module, a, d in opt.proposal()]
    opt.commit(alpha)
    after = weights(model)

    targets = {f"{t.name}.weight" for t in opt.targets}
    for name in before:
        if name not in targets:  # embeddings, norms, lm_head stay frozen
            assert torch.equal(before[name], after[name]), name
    delta_sq = sum(((after[n] - before[n]).double() ** 2).sum() for n in targets)
    weight_sq = sum((before[n].double() ** 2).sum() for n in targets)
    assert float((delta_sq / weight_sq).sqrt()) == pytest.approx(0.01 * alpha, rel=1e-5)

    for module, projection, direction in proposal:
        name = next(t.name for t in opt.targets if t.module is module)
        delta = (after[f"{name}.weight"] - before[f"{name}.weight"]).double()
        torch.testing.assert_close(delta, -alpha * direction.double() @ projection.double(), rtol=0, atol=1e-7)
        a = projection.double()
        outside = delta - delta @ a.t() @ torch.linalg.solve(a @ a.t(), a)  # component outside A's row space
        assert outside.norm() / delta.norm() < 1e-4


def test_commit_rounds_the_factor_to_the_wire_dtype_and_redraws_projections():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5))
    target = opt.targets[3]
    w0, a0 = target.module.weight.detach().clone(), target.projection.clone()
    backward_and_prepare(model, opt, BATCHES[0])
    direction = dict((m, d) for m, _, d in opt.proposal())[target.module].clone()
    payload = opt.commit(0.5)
    factor = (0.5 * direction).to(torch.bfloat16)
    entry = payload.entries[3]
    assert entry.name == target.name and entry.factor.dtype == torch.bfloat16
    assert torch.equal(entry.factor, factor)
    torch.testing.assert_close(target.module.weight.detach(), w0 - factor.float() @ a0, rtol=0, atol=1e-7)
    assert opt.policy_version == 1 and (payload.base_version, payload.new_version) == (0, 1)
    assert torch.equal(target.projection, make_projection(8, target.in_features, target.seed(1)))
    assert not torch.equal(target.projection, a0)
    assert all(not t.sketch.any() and t.contributions == 0 for t in opt.targets)  # consumed by the commit


def test_fixed_projection_when_refresh_is_off():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5, refresh=False))
    a0 = opt.targets[0].projection.clone()
    for batch in BATCHES[:2]:
        backward_and_prepare(model, opt, batch)
        payload = opt.commit(1.0)
        assert payload.projection_update == 0
    assert torch.equal(opt.targets[0].projection, a0)


def test_prepare_commit_protocol_errors():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5))
    with pytest.raises(RuntimeError, match="no update is prepared"):
        opt.commit(1.0)
    backward_and_prepare(model, opt, BATCHES[0])
    with pytest.raises(RuntimeError, match="already prepared"):
        opt.prepare(num_tokens=10)
    with pytest.raises(RuntimeError, match="while an update is prepared"):
        opt.zero_sketches()
    with pytest.raises(RuntimeError, match="while an update is prepared"):
        token_sum_loss(model, BATCHES[1]).backward()


def test_discard_restores_state_and_leaves_weights_untouched():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5))
    backward_and_prepare(model, opt, BATCHES[0])
    opt.commit(1.0)
    moments, before = [v.clone() for v in opt.second_moments], weights(model)
    backward_and_prepare(model, opt, BATCHES[1])
    assert not all(torch.equal(v, m) for v, m in zip(opt.second_moments, moments, strict=True))
    opt.discard()
    assert all(torch.equal(v, m) for v, m in zip(opt.second_moments, moments, strict=True))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert opt.policy_version == 1 and not opt.prepared


def test_non_finite_sketch_refuses_update_with_no_state_change():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5))
    backward_and_prepare(model, opt, BATCHES[0])
    opt.commit(1.0)
    moments = [v.clone() for v in opt.second_moments]
    token_sum_loss(model, BATCHES[1]).backward()
    opt.targets[-1].sketch[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        opt.prepare(num_tokens=30)
    assert not opt.prepared
    assert all(torch.equal(v, m) for v, m in zip(opt.second_moments, moments, strict=True))
    opt.zero_sketches()  # the caller skips the step and carries on
    backward_and_prepare(model, opt, BATCHES[2])
    opt.commit(1.0)
    assert opt.policy_version == 2


def _run(model, opt, batches, alpha=1.0):
    for batch in batches:
        backward_and_prepare(model, opt, batch)
        opt.commit(alpha)


def test_resume_mid_run_is_bit_identical():
    config = LoGRAConfig(rank=8, seed=5)
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, config)
    _run(model, opt, BATCHES[:3])
    opt.kl_controller.step_budget(update=3, mismatch_sum=0.5, mismatch_tokens=1000)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model = tiny_qwen3(seed=99)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = LoGRAOptimizer(resumed_model, config)
    resumed.load_state_dict(checkpoint["optimizer"])

    _run(model, opt, BATCHES[3:])
    _run(resumed_model, resumed, BATCHES[3:])
    assert resumed.policy_version == opt.policy_version == 6
    assert resumed.kl_controller.mismatch == opt.kl_controller.mismatch > 0
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(opt.targets, resumed.targets, strict=True):
        assert torch.equal(a.projection, b.projection)
    for v, w in zip(opt.second_moments, resumed.second_moments, strict=True):
        assert torch.equal(v, w)


def test_state_errors():
    model = tiny_qwen3(seed=2)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=5))
    state = opt.state_dict()
    other = LoGRAOptimizer(tiny_qwen3(seed=2), LoGRAConfig(rank=8, seed=6, kl={"budget": 1e-4}))
    with pytest.raises(ValueError, match=r"does not match the current one in \['kl.budget', 'seed'\]"):
        other.load_state_dict(state)
    older = {**state, "config": {**state["config"], "kl": dict(state["config"]["kl"])}}
    del older["config"]["kl"]["max_overshoot"], older["config"]["kl"]["max_tries"]  # saved before the KL guard
    LoGRAOptimizer(tiny_qwen3(seed=2), LoGRAConfig(rank=8, seed=5)).load_state_dict(older)
    with pytest.raises(ValueError, match=r"in \['kl.max_overshoot'\]"):  # a default the run did not use
        LoGRAOptimizer(tiny_qwen3(seed=2), LoGRAConfig(rank=8, seed=5, kl={"max_overshoot": 2.0})).load_state_dict(
            older
        )
    backward_and_prepare(model, opt, BATCHES[0])
    with pytest.raises(RuntimeError, match="cannot checkpoint while an update is prepared"):
        opt.state_dict()


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"matched no modules.*model.layers.0.self_attn.q_proj"):
        LoGRAOptimizer(tiny_qwen3(), LoGRAConfig(rank=8, target_modules=("query", "value")))
    with pytest.raises(TypeError, match=r"'model\.layers\.0\.mlp' is a Qwen3MLP, not an nn\.Linear"):
        LoGRAOptimizer(tiny_qwen3(), LoGRAConfig(rank=8, target_modules=("mlp",)))
    with pytest.raises(ValueError, match=r"rank 65 exceeds min\(d_out, k_in\) = 64"):
        LoGRAOptimizer(tiny_qwen3(), LoGRAConfig(rank=65))
    with pytest.raises(ValueError, match="needs fp32 master weights"):
        LoGRAOptimizer(tiny_qwen3().to(torch.bfloat16), LoGRAConfig(rank=8))

    model = tiny_qwen3()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8))
    with pytest.raises(ValueError, match="num_tokens"):
        opt.prepare(num_tokens=0)
    backward_and_prepare(model, opt, BATCHES[0])
    before = weights(model)
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(FloatingPointError, match="not finite"):
            opt.commit(alpha)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        opt.commit(-1.0)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert opt.prepared  # still committable after a refused alpha


def test_plain_module_without_embeddings():
    """Any nn.Module with HF-like linear names works, even when the input does not require grad."""
    model = nn.Sequential()
    model.add_module("up_proj", nn.Linear(16, 32))
    model.add_module("act", nn.Tanh())
    model.add_module("down_proj", nn.Linear(32, 4))
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, seed=3))
    x = torch.randn(10, 16)
    model(x).square().sum().backward()
    assert all(t.contributions == 1 and t.sketch.any() for t in opt.targets)
    opt.prepare(num_tokens=10)
    payload = opt.commit(1.0)
    assert [e.name for e in payload.entries] == ["up_proj", "down_proj"]
