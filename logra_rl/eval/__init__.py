"""Evaluation: pass@k over k samples per prompt."""

from logra_rl.eval.passk import pass_at_k, pass_at_k_metrics

__all__ = ["pass_at_k", "pass_at_k_metrics"]
