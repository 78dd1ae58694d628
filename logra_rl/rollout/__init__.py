"""Rollout engines: generate with sampling log-probs, merge LoGRA payloads in place, accept full resyncs."""

from logra_rl.rollout.base import Completion, RolloutEngine, SamplingParams, SyncResult

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "SyncResult"]
