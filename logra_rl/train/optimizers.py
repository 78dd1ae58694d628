"""The two update rules a TrainWorker can run: LoGRA (default) and the paper's dense AdamW baseline.

Both take the same backward (a token-sum loss) and expose `update(...) -> metrics, payload`:
LoGRA returns the payload of its update; dense returns None, so the controller resyncs full weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from logra_rl.config import OptimizerConfig
from logra_rl.logra import LoGRAConfig, LoGRAOptimizer
from logra_rl.logra.kl import ProbeError


def dense_lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio` at `schedule_steps` (held after)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.schedule_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps + 1) / span, 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DenseUpdate:
    """AdamW over the trainable parameters (all of them, or LoRA adapters), on the gradient of the
    global token-mean loss.

    Each rank backpropagates its token-sum loss; FSDP2 averages gradients over the ranks, so the
    gradient is rescaled by world_size / global tokens (gloo has no pre-scaled sum to do it inside).
    """

    def __init__(self, model: nn.Module, config: OptimizerConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        trainable = [p for p in model.parameters() if p.requires_grad]  # all weights, or the LoRA adapters
        self.optimizer = torch.optim.AdamW(
            trainable, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.model = model
        self.update_count = 0

    def update(self, step: int, num_tokens: float) -> tuple[dict[str, float], None]:
        lr = self.config.lr * dense_lr_factor(step, self.config)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for grad in grads:
            grad.mul_(self.world_size / num_tokens)
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        skipped = not math.isfinite(grad_norm)  # the same on every rank: the norm is global
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.update_count += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/lr": lr, "actor/grad_norm": grad_norm, "actor/skipped": float(skipped)}, None

    def state_dict(self) -> dict:
        return {"update_count": self.update_count}

    def load_state_dict(self, state: dict) -> None:
        self.update_count = state["update_count"]


class LoGRAUpdate:
    """prepare → KL probe → budget → α → realised KL → commit, on the probe rows of this rank's batch.

    A non-finite sketch, a probe that fails (no generated tokens, non-finite KL) or a non-finite
    realised KL skips the update: the prepared update is discarded and nothing changes.
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig, temperature: float) -> None:
        self.optimizer = LoGRAOptimizer(model, config)
        self.temperature = temperature

    def update(
        self,
        step: int,
        num_tokens: float,
        forward: Callable[[torch.Tensor], torch.Tensor],
        probe_ids: torch.Tensor,
        probe_mask: torch.Tensor,
        mismatch_sum: float,
        mismatch_count: int,
        serialise: bool,
    ) -> tuple[dict[str, float], bytearray | None]:
        opt = self.optimizer
        try:
            sketch_norm = opt.prepare(num_tokens=num_tokens)
        except FloatingPointError:
            opt.zero_sketches()
            return {"actor/skipped": 1.0}, None
        start = time.perf_counter()
        try:
            q = opt.probe_kl(forward, probe_ids, probe_mask, self.temperature)
            budget = opt.kl_controller.step_budget(opt.update_count, mismatch_sum, mismatch_count)
            alpha = opt.kl_controller.alpha(q, budget)
            realized = opt.realized_kl(forward, probe_ids, probe_mask, self.temperature, alpha)
        except (FloatingPointError, ProbeError):
            opt.discard()
            return {"actor/skipped": 1.0}, None
        probe_seconds = time.perf_counter() - start
        payload = opt.commit(alpha)
        metrics = {
            "logra/alpha": alpha,
            "logra/kl_budget": budget,
            "logra/kl_per_unit_step": q,
            "logra/kl_predicted": q * alpha**2,
            "logra/kl_realized": realized,
            "logra/update_ratio": opt.config.update_ratio * alpha,
            "logra/sketch_norm": sketch_norm,
            "logra/mismatch_ema": opt.kl_controller.mismatch,
            "actor/skipped": 0.0,
            "timing_s/probe": probe_seconds,
        }
        return metrics, payload.to_bytes() if serialise else None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
