"""RowAdam: one second moment per output row, applied to a sketch (as in the reference port).

The state is keyed by output row, not by projected coordinate, so it stays meaningful when
the projection is redrawn after every update. There is no first moment.
"""

from __future__ import annotations

import torch


def check_finite(sketch: torch.Tensor, name: str) -> None:
    """Raise FloatingPointError if the sketch holds NaN or Inf (before any state is touched)."""
    if not bool(torch.isfinite(sketch).all()):
        raise FloatingPointError(
            f"LoGRA sketch of {name!r} contains NaN or Inf; the update is refused and no state was changed"
        )


def row_adam_direction(
    sketch: torch.Tensor, second_moment: torch.Tensor, step: int, beta2: float, epsilon: float, name: str = "?"
) -> torch.Tensor:
    """Return the direction D for `sketch` (d_out × rank) and update `second_moment` (d_out × 1) in place.

    `step` is 1-based (bias correction). The row scales are inverse bias-corrected row RMS
    with a relative epsilon, normalised to RMS 1; the result keeps the sketch's Frobenius norm.
    """
    if step < 1:
        raise ValueError(f"RowAdam step must be >= 1, got {step}")
    if not 0 <= beta2 < 1 or epsilon <= 0:
        raise ValueError(f"RowAdam needs 0 <= beta2 < 1 and epsilon > 0, got beta2={beta2}, epsilon={epsilon}")
    if second_moment.shape != (sketch.shape[0], 1):
        raise ValueError(
            f"RowAdam second moment of {name!r} has shape {tuple(second_moment.shape)}, expected {(sketch.shape[0], 1)}"
        )
    check_finite(sketch, name)
    tiny = torch.finfo(sketch.dtype).tiny
    second_moment.mul_(beta2).add_(sketch.square().mean(dim=1, keepdim=True), alpha=1 - beta2)
    row_rms = (second_moment / (1 - beta2**step)).sqrt()
    denominator = row_rms + max(epsilon * float(row_rms.mean()), tiny)
    scale = denominator.min() / denominator
    scale = scale / scale.square().mean().sqrt().clamp_min(tiny)
    direction = scale * sketch
    return direction * (torch.linalg.vector_norm(sketch) / torch.linalg.vector_norm(direction).clamp_min(tiny))
