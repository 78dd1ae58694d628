import numpy as np
import pytest
import torch

from logra_rl.logra import row_adam_direction


def _reference_rowadam(sketches, beta2=0.95, epsilon=1e-8):
    """An independent float64 numpy statement of the reference arithmetic (inverse scale, not min/den)."""
    v = np.zeros((sketches[0].shape[0], 1))
    directions, moments = [], []
    for step, x in enumerate(sketches, start=1):
        v = beta2 * v + (1 - beta2) * np.mean(x**2, axis=1, keepdims=True)
        rho = np.sqrt(v / (1 - beta2**step))
        den = rho + max(epsilon * rho.mean(), np.finfo(np.float32).tiny)
        inverse = 1 / den
        inverse = inverse / np.sqrt(np.mean(inverse**2))
        d = inverse * x
        directions.append(d * np.linalg.norm(x) / np.linalg.norm(d))
        moments.append(v.copy())
    return directions, moments


def test_matches_independent_formulation_across_updates():
    generator = torch.Generator().manual_seed(0)
    row_scales = torch.logspace(-3, 1, 7).unsqueeze(1)  # rows differ by 4 orders of magnitude
    sketches = [torch.randn(7, 3, generator=generator) * row_scales for _ in range(4)]
    expected_d, expected_v = _reference_rowadam([s.double().numpy() for s in sketches])
    moment = torch.zeros(7, 1)
    for step, sketch in enumerate(sketches, start=1):
        direction = row_adam_direction(sketch, moment, step, beta2=0.95, epsilon=1e-8)
        np.testing.assert_allclose(direction.numpy(), expected_d[step - 1], rtol=2e-6, atol=1e-12)
        np.testing.assert_allclose(moment.numpy(), expected_v[step - 1], rtol=2e-6)
        # the layer keeps its sketch norm; the rows are equalised (small rows are amplified)
        assert torch.linalg.vector_norm(direction).item() == pytest.approx(torch.linalg.vector_norm(sketch).item())
    row_norms = direction.norm(dim=1)
    assert row_norms.max() / row_norms.min() < (sketch.norm(dim=1).max() / sketch.norm(dim=1).min()) / 100


def test_zero_sketch_gives_exactly_zero_direction():
    moment = torch.zeros(5, 1)
    direction = row_adam_direction(torch.zeros(5, 4), moment, 1, 0.95, 1e-8)
    assert torch.equal(direction, torch.zeros(5, 4)) and torch.equal(moment, torch.zeros(5, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_sketch_raises_before_state_changes(bad):
    moment = torch.full((5, 1), 0.25)
    sketch = torch.ones(5, 4)
    sketch[2, 1] = bad
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        row_adam_direction(sketch, moment, 3, 0.95, 1e-8, name="layer")
    assert torch.equal(moment, torch.full((5, 1), 0.25))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="step must be >= 1"):
        row_adam_direction(torch.ones(2, 2), torch.zeros(2, 1), 0, 0.95, 1e-8)
    with pytest.raises(ValueError, match="second moment"):
        row_adam_direction(torch.ones(2, 2), torch.zeros(3, 1), 1, 0.95, 1e-8)
