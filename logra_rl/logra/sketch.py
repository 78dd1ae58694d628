"""Sketch capture on nn.Linear: S += gᵀ·(x·Aᵀ), without ever forming the weight gradient.

The weight gradient of a linear layer over T tokens is G = gᵀx (g: output gradients, x:
inputs). Its sketch is S = G·Aᵀ = gᵀ(x·Aᵀ), so the forward keeps only P = x·Aᵀ (T × rank)
and the backward adds gᵀP into an fp32 accumulator (d_out × rank). The weight is frozen, so
the linear's own autograd node keeps the weight (for the input gradient) but not x.

P is saved through an identity autograd Function rather than a closure: autograd frees it
with the graph, and non-reentrant activation checkpointing recomputes it on backward while
only the original node runs its backward (no double counting).

Under FSDP2 the forward sees the unsharded weight, so S always covers all d_out rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from logra_rl.logra.projection import canonical_name, make_projection, projection_seed


class _SketchCapture(torch.autograd.Function):
    """Identity on the layer output; its backward accumulates the sketch."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, projected: torch.Tensor, anchor: torch.Tensor, target: LinearSketch
    ) -> torch.Tensor:
        ctx.save_for_backward(projected)
        ctx.target = target
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (projected,) = ctx.saved_tensors
        ctx.target.accumulate(grad_output, projected)
        return grad_output, None, None, None


class LinearSketch:
    """One targeted nn.Linear: its projection A, its sketch S, and the forward hook that feeds S.

    `anchor` is a leaf that requires grad, passed to the capture Function so the layer output
    is part of the autograd graph even though every weight is frozen (no embedding hook needed).
    """

    def __init__(self, name: str, module: nn.Linear, rank: int, base_seed: int, distribution: str) -> None:
        self.name = canonical_name(name)
        self.module = module
        self.rank = rank
        self.base_seed = base_seed
        self.distribution = distribution
        device = module.weight.device
        self.projection = torch.empty(rank, module.in_features, dtype=torch.float32, device=device)
        self.sketch = torch.zeros(module.out_features, rank, dtype=torch.float32, device=device)
        self.contributions = 0  # backward passes that reached this layer since the last reset
        self.locked = False  # set while an update is prepared: a backward then would corrupt it
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.draw_projection(update=0)
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    @property
    def out_features(self) -> int:
        return self.module.out_features

    @property
    def in_features(self) -> int:
        return self.module.in_features

    def seed(self, update: int) -> int:
        return projection_seed(self.base_seed, update, self.name)

    def draw_projection(self, update: int) -> None:
        """Write A for `update` completed updates into the existing buffer (same storage)."""
        device = self.projection.device
        self.projection.copy_(
            make_projection(self.rank, self.in_features, self.seed(update), self.distribution, device)
        )

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        x = args[0] if args else kwargs["input"]
        with torch.no_grad():
            projected = x.reshape(-1, self.in_features) @ self.projection.t().to(x.dtype)
        return _SketchCapture.apply(output, projected, self._anchor, self)

    def accumulate(self, grad_output: torch.Tensor, projected: torch.Tensor) -> None:
        if self.locked:
            raise RuntimeError(
                f"backward reached LoGRA target {self.name!r} while an update is prepared; "
                "commit() or discard() the prepared update before the next backward"
            )
        grad = grad_output.reshape(-1, self.out_features)
        self.sketch.add_((grad.t() @ projected.to(grad.dtype)).float())
        self.contributions += 1

    def zero_(self) -> None:
        self.sketch.zero_()
        self.contributions = 0

    def remove(self) -> None:
        self._handle.remove()
