"""LoGRA, the method: low-rank gradient sketches, RowAdam, predicted-KL control, payloads.

Pure torch: nothing here imports Ray, vLLM or Hydra.
"""

from logra_rl.logra.config import DEFAULT_TARGET_MODULES, KLConfig, LoGRAConfig
from logra_rl.logra.kl import (
    ATTENTION_BLOCK,
    POSITION_CHUNK,
    GuardedStep,
    KLController,
    KLEstimate,
    KLRows,
    LogitChunks,
    ProbeError,
    exact_kl,
    features,
    jvp_kl,
    kl_estimate,
    masked_logits,
    predicted_kl,
    reduced_mean_kl,
    row_kl,
    scheduled_budget,
    step_scale,
)
from logra_rl.logra.merge import (
    MergeTarget,
    PayloadMerger,
    PayloadRefused,
    hf_targets,
    join_master,
    merge_low_rank_,
    split_master,
)
from logra_rl.logra.optimizer import LoGRAOptimizer
from logra_rl.logra.payload import PayloadEntry, PayloadFormatError, UpdatePayload
from logra_rl.logra.projection import canonical_name, make_projection, projection_fingerprint, projection_seed
from logra_rl.logra.rowadam import row_adam_direction
from logra_rl.logra.targets import check_rank, decoder_layers, decoder_of, find_targets

__all__ = [
    "ATTENTION_BLOCK",
    "DEFAULT_TARGET_MODULES",
    "POSITION_CHUNK",
    "GuardedStep",
    "KLConfig",
    "KLController",
    "KLEstimate",
    "KLRows",
    "LoGRAConfig",
    "LoGRAOptimizer",
    "LogitChunks",
    "MergeTarget",
    "PayloadEntry",
    "PayloadFormatError",
    "PayloadMerger",
    "PayloadRefused",
    "ProbeError",
    "UpdatePayload",
    "canonical_name",
    "check_rank",
    "decoder_layers",
    "decoder_of",
    "exact_kl",
    "features",
    "find_targets",
    "hf_targets",
    "join_master",
    "jvp_kl",
    "kl_estimate",
    "make_projection",
    "masked_logits",
    "merge_low_rank_",
    "predicted_kl",
    "projection_fingerprint",
    "projection_seed",
    "reduced_mean_kl",
    "row_adam_direction",
    "row_kl",
    "scheduled_budget",
    "split_master",
    "step_scale",
]
