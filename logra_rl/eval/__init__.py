"""Evaluation: pass@k over k samples per prompt."""

from logra_rl.eval.passk import eval_metrics, pass_at_k, pass_at_k_metrics

__all__ = ["eval_metrics", "pass_at_k", "pass_at_k_metrics"]
