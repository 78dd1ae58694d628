"""Rollout engines: generate with sampling log-probs, merge LoGRA payloads in place, accept full resyncs."""

from logra_rl.rollout.base import Completion, EngineSpec, MergeMode, RolloutEngine, SamplingParams, SyncResult

__all__ = ["Completion", "EngineSpec", "MergeMode", "RolloutEngine", "SamplingParams", "SyncResult"]
