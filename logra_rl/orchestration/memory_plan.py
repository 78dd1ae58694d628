"""The run's memory, planned before anything starts.

From the model's config (`models.footprint`: parameter counts, and the activations a layer saves, traced on
the meta device), the optimizer, LoGRA rank and targets, dtypes, microbatch tokens, sequence lengths, train
ranks and engines: what each process holds, part by part, and when. A part is held for the whole run
(`RESIDENT`) or only in one phase of the synchronous loop (loading, training, generating, syncing), so a
process's peak is its resident parts plus its largest phase, and a device's need is its processes' resident
parts plus the largest phase summed over them (on a CPU machine every process shares the host).

The estimates are arithmetic plus a few measured constants (library runtimes, allocator slack), checked
against measured peaks by `scripts/bench_memory.py` (docs/benchmarks.md §12).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import psutil
import torch
from rich.console import Console
from rich.table import Table

from logra_rl.config import RunConfig
from logra_rl.models.footprint import ModelFootprint, model_footprint
from logra_rl.orchestration.cluster import MIN_OBJECT_STORE_MB
from logra_rl.rl.logprobs import logprob_chunk

GIB = 2**30
RESIDENT, LOADING, TRAINING, GENERATING, SYNCING = "resident", "loading", "training", "generating", "syncing"
PHASES = (LOADING, TRAINING, GENERATING, SYNCING)

# Private memory of each process's libraries and interpreter, measured on CPU (torch 2.13, transformers 5):
# a train worker (torch, transformers, peft, Ray's core worker, gloo), an HF engine, a vLLM-CPU engine, the
# driver (Hydra, Ray, data), Ray's own processes (GCS, raylet, agents, one idle worker), one grading process.
RUNTIME_GIB = {"train": 0.35, "hf": 0.3, "vllm": 1.0, "driver": 0.45, "ray": 0.35, "grader": 0.1}
# The driver's prompts and the libraries that make them (reasoning-gym's generators import matplotlib and more)
DATA_GIB = {"reasoning_gym": 0.3, "math": 0.2, "files": 0.1}
CUDA_CONTEXT_GIB = 0.6  # per process and GPU, outside the caching allocator's statistics
CUDA_HOST_GIB = 2.5  # host memory of a process driving a GPU (CUDA libraries, pinned buffers)
# A phase's transient memory costs more than its tensors: glibc keeps freed blocks under 32 MB (released at
# phase ends, `utils.memory.release_free_memory`), the CUDA caching allocator rounds and fragments.
SLACK = 1.1
RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor kills a worker above this share of the node's memory
VLLM_ACTIVATION_GIB = 1.5  # vLLM's profiled activation peak and CUDA graphs, per GPU (a rough allowance)
RESIDUAL_BYTES = {"tail": 2, "float32": 4, "bfloat16": 2, "none": 0}


@dataclass(frozen=True)
class Part:
    name: str
    nbytes: float
    phase: str = RESIDENT
    on_host: bool = False  # host memory of a process that computes on a GPU


@dataclass(frozen=True)
class ProcessPlan:
    """One kind of process: `count` of them, each holding `parts` on `device` (host, train GPU, rollout GPU)."""

    name: str
    count: int
    device: str
    parts: tuple[Part, ...]

    def held(self, phase: str, on_host: bool = False) -> float:
        return sum(p.nbytes for p in self.parts if p.phase in (RESIDENT, phase) and p.on_host == on_host)

    @property
    def peak(self) -> float:
        """On its device (the host for a CPU process); a GPU process's host memory is `host_peak`."""
        return max(self.held(phase) for phase in PHASES)

    @property
    def host_peak(self) -> float:
        return max(self.held(phase, on_host=True) for phase in PHASES)

    def largest(self, count: int = 4) -> str:
        """Its largest parts at its peak, as `name size` (GiB)."""
        phase = max(PHASES, key=self.held)
        held = (p for p in self.parts if p.phase in (RESIDENT, phase) and not p.on_host)
        parts = sorted(held, key=lambda p: -p.nbytes)
        return ", ".join(f"{p.name} {p.nbytes / GIB:.1f}" for p in parts[:count] if p.nbytes >= 0.05 * GIB)


@dataclass(frozen=True)
class Budget:
    """One device (the host, each train GPU, each rollout GPU): what its processes need at the worst
    phase, and what it has (None: unknown here, e.g. GPUs planned from a machine without them)."""

    device: str
    need: float
    have: float | None

    @property
    def fits(self) -> bool:
        return self.have is None or self.need <= self.have


@dataclass(frozen=True)
class Lengths:
    """Token lengths the plan sizes buffers for: the longest prompt, and prompt plus the longest response."""

    prompt: int
    sequence: int


@dataclass(frozen=True)
class Machine:
    """What the run's devices have: the host's memory the run may use, each GPU's total (None: unknown)."""

    cuda: bool
    host: float | None
    gpu: float | None


@dataclass(frozen=True)
class MemoryPlan:
    processes: tuple[ProcessPlan, ...]
    budgets: tuple[Budget, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return all(b.fits for b in self.budgets)

    def process(self, name: str) -> ProcessPlan:
        return next(p for p in self.processes if p.name == name)

    def shortfall(self) -> Budget | None:
        """The device that misses by the most, or None when everything fits."""
        short = [b for b in self.budgets if not b.fits]
        return max(short, key=lambda b: b.need - b.have, default=None)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(process, count, peak GiB each, largest parts) per process, then (device, '', need, have) rows."""
        rows = [(p.name, str(p.count), f"{p.peak / GIB:.2f}", p.largest()) for p in self.processes]
        for budget in self.budgets:
            have = "unknown here" if budget.have is None else f"{budget.have / GIB:.1f} GiB available"
            verdict = "" if budget.have is None else ("fits" if budget.fits else "DOES NOT FIT")
            rows.append((f"{budget.device} needs", "", f"{budget.need / GIB:.2f}", f"{have} {verdict}".strip()))
        return rows


def machine_of(config: RunConfig) -> Machine:
    """This machine's memory for the run, or the cluster's as configured (`cluster.host_memory_gib`,
    `cluster.gpu_memory_gib`). The host figure is what is available now, less the margin at which Ray's
    memory monitor starts killing workers."""
    cluster = config.cluster
    cuda = cluster.device == "cuda" or (cluster.device == "auto" and (torch.cuda.is_available() or config.ray.address))
    host = cluster.host_memory_gib * GIB if cluster.host_memory_gib is not None else None
    planned_elsewhere = config.ray.address or (cuda and not torch.cuda.is_available())  # not this machine's host
    if host is None and not planned_elsewhere:
        memory = psutil.virtual_memory()
        host = memory.available - (1 - RAY_MEMORY_THRESHOLD) * memory.total
    gpu = cluster.gpu_memory_gib * GIB if cluster.gpu_memory_gib is not None else None
    if gpu is None and cuda and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory
    return Machine(cuda=bool(cuda), host=host, gpu=gpu)


def compute_dtype(config: RunConfig, cuda: bool) -> str:
    """The trainer's compute dtype (`model.compute_dtype`; auto: bf16 on GPUs, fp32 on CPU)."""
    dtype = config.model.compute_dtype
    return ("bfloat16" if cuda else "float32") if dtype == "auto" else dtype


def plan_memory(config: RunConfig, model_path: str, machine: Machine, prompt_tokens: int | None = None) -> MemoryPlan:
    """The plan of `config` on `machine` for the model at `model_path` (only its config is read), for prompts
    of at most `prompt_tokens` (the data's longest; None: `data.max_prompt_length`)."""
    dtype = compute_dtype(config, machine.cuda)
    footprint = model_footprint(model_path, config.logra.target_modules, dtype)
    lora = config.optimizer.name == "lora"  # its adapters sit on optimizer.lora_targets
    trained = model_footprint(model_path, config.optimizer.lora_targets, dtype) if lora else footprint
    prompt = min(prompt_tokens or config.data.max_prompt_length, config.data.max_prompt_length)
    lengths = Lengths(prompt, prompt + config.data.max_response_length)
    train = _train_ranks(config, trained, lengths, machine.cuda)
    engines, notes = _engines(config, footprint, lengths, machine)
    driver = _driver(config, footprint)
    processes = (*train, engines, driver)
    gpus = {}  # each GPU of a kind needs what its largest process needs
    for process in (*train, engines):
        if process.device != "host" and process.count:
            gpus[process.device] = max(gpus.get(process.device, 0.0), process.peak)
    budgets = [Budget(device, need, machine.gpu) for device, need in gpus.items()]
    budgets.append(Budget("host", _host_need(processes), machine.host))
    return MemoryPlan(processes, tuple(budgets), tuple(notes))


def _host_need(processes: tuple[ProcessPlan, ...]) -> float:
    """What the processes need of the host together at the worst phase (the synchronous loop runs one phase
    at a time): everything of CPU processes, the host side of GPU ones."""
    return max(sum(p.count * p.held(phase, on_host=p.device != "host") for p in processes) for phase in PHASES)


def _train_ranks(config: RunConfig, model: ModelFootprint, lengths: Lengths, cuda: bool) -> tuple[ProcessPlan, ...]:
    """Rank 0 (which also reads the checkpoint) and the other ranks."""
    ranks = config.cluster.train_workers
    c = model.compute_bytes
    optimizer, rank = config.optimizer.name, config.logra.rank
    parts = [Part("weights", 4 * model.params / ranks)]
    if optimizer == "logra":
        # sketches (d_out × r) and projections (r × k_in) of every target on every rank, fp32; row moments;
        # the prepared direction (d_out × r) while an update is built
        state = 4 * rank * (model.target_rows + model.target_cols) + 4 * model.target_rows
        parts += [Part("LoGRA state", state), Part("LoGRA update", 4 * rank * model.target_rows, TRAINING)]
    elif optimizer == "dense":
        parts += [Part("Adam moments", 8 * model.params / ranks)]
        parts += [Part("gradients", 4 * model.params / ranks + 2 * 4 * model.layer_params, TRAINING)]
    else:  # `model`'s targets are LoRA's here (plan_memory)
        adapters = sum(config.optimizer.lora_rank * (d_out + k_in) for d_out, k_in in model.targets)
        parts += [Part("LoRA adapters + Adam", 16 * adapters / ranks), Part("gradients", 4 * adapters, TRAINING)]
    # FSDP2 gathers a layer group into a flat buffer, then copies it out into the unsharded parameters: the
    # root (embeddings, head) stays unsharded through forward and backward, one layer is computed while the
    # next is gathered
    gathered = c * (2 * model.root_params + 3 * model.layer_params)
    parts += [Part("unsharded weights", gathered, TRAINING)]
    tokens = _microbatch_tokens(config, lengths.sequence)
    parts += [Part("activations", _activations(config, model, optimizer, tokens), TRAINING)]
    responses = min(tokens, _rank_rows(config) * config.data.max_response_length)  # log-probs of response tokens
    parts += [Part("logits", _logits(model, responses, c), TRAINING)]
    parts += [Part("KL probe", _probe(config, model, lengths.sequence, c), TRAINING)]
    if optimizer != "logra" and config.optimizer.measure_kl:
        parts += [Part("KL probe logits", _kept_logits(config, model), TRAINING, on_host=cuda)]
    transients = sum(p.nbytes for p in parts if p.phase == TRAINING)
    parts += [Part("allocator slack", (SLACK - 1) * transients, TRAINING)]
    if cuda:
        parts += [Part("CUDA context", CUDA_CONTEXT_GIB * GIB), Part("runtime", CUDA_HOST_GIB * GIB, on_host=True)]
        device = "each train GPU"
    else:
        parts += [Part("runtime", RUNTIME_GIB["train"] * GIB)]
        device = "host"
    # rank 0 reads the whole checkpoint as fp32 into host memory while its shards exist, then broadcasts it;
    # an fp32 checkpoint is memory-mapped (page cache, which the kernel reclaims), any other is converted
    loaded = 0 if model.checkpoint_bytes == 4 else 4 * model.params
    loading = Part("checkpoint copy", loaded, LOADING, on_host=cuda)
    first = ProcessPlan("train rank 0", 1, device, (*parts, loading))
    return (first, ProcessPlan("train rank", ranks - 1, device, tuple(parts))) if ranks > 1 else (first,)


def _microbatch_tokens(config: RunConfig, sequence: int) -> int:
    """Tokens of a rank's largest microbatch: the budget (or one whole sequence when it is longer), or the rank's
    whole share of the step when that is less."""
    return min(max(config.trainer.micro_batch_tokens, sequence), _rank_rows(config) * sequence)


def _rank_rows(config: RunConfig) -> int:
    """Responses a train rank gets per step."""
    return math.ceil(config.trainer.prompts_per_step * config.rollout.n / config.cluster.train_workers)


def _activations(config: RunConfig, model: ModelFootprint, optimizer: str, tokens: int) -> float:
    """What backward needs of one microbatch: every layer's saved tensors, or with activation checkpointing
    each layer's input plus one layer recomputed. LoGRA keeps x·Aᵀ (tokens × rank) per target; LoRA keeps its
    adapters' inputs and the rank-wide middle."""
    c = model.compute_bytes
    per_layer = model.saved_trainable if optimizer == "dense" else model.saved_frozen
    targets_per_layer = len(model.targets) / model.layers
    if optimizer == "logra":
        per_layer += c * targets_per_layer * config.logra.rank
    elif optimizer == "lora":
        per_layer = model.saved_trainable + c * targets_per_layer * config.optimizer.lora_rank
    if config.model.activation_checkpointing:
        return tokens * (model.layers * model.hidden * c + per_layer)
    return tokens * model.layers * per_layer


def _logits(model: ModelFootprint, responses: int, c: int) -> float:
    """Sampled-token log-probs of the `responses` tokens through the LM head in chunks (`rl.head_logprobs`): one
    chunk's logits in the compute dtype, as fp32 and scaled, and in backward their gradient (the last chunk is
    kept, not recomputed)."""
    positions = min(responses, logprob_chunk(model.vocab))
    return positions * model.vocab * (c + 3 * 4)


def _kept_logits(config: RunConfig, model: ModelFootprint) -> float:
    """A dense or LoRA step's KL is measured against the policy's logits before it, kept in fp32 (on the host
    on a GPU node) at the probe rows' generated-token predictions."""
    kl = config.logra.kl
    return 4 * kl.probe_responses * min(config.data.max_response_length, kl.probe_max_tokens) * model.vocab


def _probe(config: RunConfig, model: ModelFootprint, sequence: int, c: int) -> float:
    """LoGRA's KL probe: `probe_responses` whole rows run without gradients, one layer's intermediates at a
    time, their final hidden states kept for the stepped pass. The JVP estimator also carries a tangent for
    each, and its attention runs on SDPA's math backend (no fused kernel has a forward-AD rule): scores,
    probabilities and their tangents, rows × heads × length² for one layer at a time. Dense and LoRA steps
    measure their realised KL with no-grad forwards of the same rows, once the backward's activations are
    freed (`_kept_logits` is what they hold)."""
    if config.optimizer.name != "logra":
        return 0.0
    kl = config.logra.kl
    rows, length = kl.probe_responses, min(sequence, kl.probe_max_tokens)
    layer = rows * length * (model.saved_frozen + 2 * model.hidden * c)
    if kl.estimator != "jvp":
        return layer
    return 2 * layer + 4 * rows * model.heads * length**2 * c


def _engines(
    config: RunConfig, model: ModelFootprint, lengths: Lengths, machine: Machine
) -> tuple[ProcessPlan, list[str]]:
    """One rollout engine: its weights, merge residual, KV cache and generation transients."""
    rollout = config.rollout
    dtype = torch.finfo(getattr(torch, rollout.dtype)).bits // 8
    # the tail is an fp32 master's low bits: fp32 weights need none (the other residuals are allocated as asked)
    residual = 0 if rollout.dtype == "float32" and rollout.residual == "tail" else RESIDUAL_BYTES[rollout.residual]
    if config.optimizer.name != "logra":
        residual = 0  # dense and LoRA updates reach the engines as full resyncs: no merge, no residual
    tp = rollout.gpus_per_engine
    sequence = lengths.sequence
    notes = []
    parts = [Part("weights", dtype * model.params / tp), Part("residual", residual * model.target_params / tp)]
    if machine.cuda and rollout.backend == "vllm":
        # vLLM takes gpu_memory_utilization of its GPU for weights, activations and KV cache; the residual
        # lives beside it
        budget = rollout.gpu_memory_utilization * (machine.gpu or 80 * GIB)
        kv = budget - parts[0].nbytes - VLLM_ACTIVATION_GIB * GIB
        parts += [Part("KV cache (vLLM's share)", max(kv, 0.0)), Part("vLLM activations", VLLM_ACTIVATION_GIB * GIB)]
        parts += [Part("CUDA context", CUDA_CONTEXT_GIB * GIB), Part("runtime", CUDA_HOST_GIB * GIB, on_host=True)]
        tokens = kv / model.kv_bytes_per_token(dtype, tp)
        notes.append(
            f"each vLLM engine: KV cache for about {kv / GIB:.1f} GiB per GPU = {tokens:,.0f} tokens "
            f"({tokens / sequence:.1f} sequences of {sequence}); the {rollout.residual} residual takes "
            f"{parts[1].nbytes / GIB:.1f} GiB per GPU beside vLLM's {rollout.gpu_memory_utilization:g}"
        )
        if machine.gpu is None:
            notes.append("vLLM's KV cache assumed of an 80 GiB GPU: set cluster.gpu_memory_gib to plan another")
        if kv <= 0:
            notes.append(
                f"vLLM's share ({rollout.gpu_memory_utilization:g} of the GPU) does not hold the weights: raise "
                "rollout.gpu_memory_utilization or rollout.gpus_per_engine"
            )
        return ProcessPlan("rollout engine", rollout.num_engines, "each rollout GPU", tuple(parts)), notes
    if rollout.backend == "vllm":  # vLLM-CPU: packed weights beside HF-layout shadows of the targets
        from logra_rl.rollout.base import EngineSpec
        from logra_rl.rollout.vllm_engine import cpu_kv_cache_gib

        spec = EngineSpec.from_config(config, "")
        kv_gib = cpu_kv_cache_gib(model.kv_bytes_per_token(dtype, tp), spec.max_model_len, spec.max_num_seqs)
        shadow = dtype * model.target_params if config.optimizer.name == "logra" else 0
        parts += [Part("shadow targets", shadow), Part("KV cache", tp * kv_gib * GIB)]
        runtime = RUNTIME_GIB["vllm"]
    else:
        rows = _generate_rows(config)
        parts += [Part("KV cache", rows * sequence * model.kv_bytes_per_token(dtype), GENERATING)]
        parts += [Part("logits", 3 * 4 * rows * model.vocab, GENERATING)]
        # the whole batch's prompts go through one layer at a time: that layer's intermediates are the peak
        parts += [Part("prefill", rows * lengths.prompt * model.saved_frozen * dtype / model.compute_bytes, GENERATING)]
        runtime = RUNTIME_GIB["hf"]
    if residual:  # a resync splits each weight's fp32 master into bf16 and tail with int32 temporaries
        largest = max(d_out * k_in for d_out, k_in in model.targets)
        parts += [Part("resync split", 16 * largest, SYNCING)]
    if machine.cuda:
        parts += [Part("CUDA context", CUDA_CONTEXT_GIB * GIB), Part("runtime", CUDA_HOST_GIB * GIB, on_host=True)]
    else:
        parts += [Part("runtime", runtime * GIB)]
    device = "each rollout GPU" if machine.cuda else "host"
    return ProcessPlan("rollout engine", rollout.num_engines, device, tuple(parts)), notes


def _generate_rows(config: RunConfig) -> int:
    """Rows an HF engine generates together: a step's (or an eval's) share, at most one generate batch."""
    from logra_rl.rollout.hf_engine import GENERATE_BATCH_ROWS

    train = config.trainer.prompts_per_step * config.rollout.n
    evaluation = (config.data.eval_size or 0) * config.rollout.eval_samples if config.trainer.eval_every else 0
    return min(GENERATE_BATCH_ROWS, math.ceil(max(train, evaluation) / config.rollout.num_engines))


def _driver(config: RunConfig, model: ModelFootprint) -> ProcessPlan:
    """The driver with Ray's own processes, the grading processes and (on a local Ray) the object store's
    pages a full resync writes: the fp32 model, up to the store's size."""
    parts = [
        Part("runtime", RUNTIME_GIB["driver"] * GIB),
        Part("data", DATA_GIB.get(config.data.task, 0.0) * GIB),
        Part("Ray processes", RUNTIME_GIB["ray"] * GIB),
        Part("graders", config.trainer.grader_workers * RUNTIME_GIB["grader"] * GIB),
    ]
    if config.optimizer.name == "logra":  # a payload from rank 0, received and deserialised on its way
        payload = config.logra.rank * model.target_rows * (2 if config.logra.wire_dtype == "bfloat16" else 4)
        parts.append(Part("payloads", 2 * payload, SYNCING))
    if not config.ray.address:
        store = config.ray.object_store_mb or max(MIN_OBJECT_STORE_MB, 3 * config.rollout.resync_bucket_mb)
        parts.append(Part("object store", min(store * 2**20, 4 * model.params), SYNCING))
    return ProcessPlan("driver + Ray", 1, "host", tuple(parts))


RUN_ANYWAY = "cluster.memory_check=false runs anyway"


class MemoryPlanError(ValueError):
    """The run does not fit its devices: one line with what needs how much, and what would fit."""


def alternatives(config: RunConfig) -> list[tuple[str, RunConfig]]:
    """The changes a user can make to need less memory, as (override, changed config)."""
    changes = []
    if config.optimizer.name != "logra":
        changes.append(("optimizer=logra", with_changes(config, optimizer={"name": "logra"})))
    workers = config.cluster.train_workers
    changes.append(
        (f"cluster.train_workers={2 * workers}", with_changes(config, cluster={"train_workers": 2 * workers}))
    )
    if not config.model.activation_checkpointing:
        changes.append(
            ("model.activation_checkpointing=true", with_changes(config, model={"activation_checkpointing": True}))
        )
    tokens = config.trainer.micro_batch_tokens
    if tokens >= 1024:
        changes.append(
            (
                f"trainer.micro_batch_tokens={tokens // 2}",
                with_changes(config, trainer={"micro_batch_tokens": tokens // 2}),
            )
        )
    if config.optimizer.name == "logra" and config.logra.rank >= 16:
        changes.append(
            (f"logra.rank={config.logra.rank // 2}", with_changes(config, logra={"rank": config.logra.rank // 2}))
        )
    return changes


def memory_problem(
    plan: MemoryPlan, config: RunConfig, model_path: str, machine: Machine, prompt_tokens: int | None = None
) -> str | None:
    """One line when `plan` does not fit: the device, its need against what it has, the processes behind
    it, and the single changes that would fit (each re-planned), else the ones that help most."""
    short = plan.shortfall()
    if short is None:
        return None
    if short.device == "host":
        processes = [p for p in plan.processes if p.count]
        held = "; ".join(
            f"{p.name} {p.peak / GIB:.1f} GiB ({p.largest(3)})"
            if p.device == "host"
            else f"{p.name} {p.host_peak / GIB:.1f} GiB"
            for p in processes
        )
    else:
        processes = [p for p in plan.processes if p.device == short.device and p.count]
        held = "; ".join(f"{p.name} {p.peak / GIB:.1f} GiB ({p.largest(3)})" for p in processes)
    line = f"memory plan: {short.device} needs {short.need / GIB:.1f} GiB, {short.have / GIB:.1f} GiB available: {held}"
    needs = []
    for override, changed in alternatives(config):
        changed_plan = plan_memory(changed, model_path, machine, prompt_tokens)
        budget = next(b for b in changed_plan.budgets if b.device == short.device)
        needs.append((budget.need, budget.fits, override))
    fitting = [f"{override} ({need / GIB:.1f} GiB)" for need, fits, override in sorted(needs) if fits]
    if fitting:
        line += f". Fits with {' or '.join(fitting[:3])}"
    elif needs:
        best = [f"{override} ({need / GIB:.1f} GiB)" for need, _, override in sorted(needs)[:2]]
        line += f". No single change fits; the largest cuts: {', '.join(best)}"
    return line


def plan_table(plan: MemoryPlan, machine: Machine) -> Table:
    """The plan as a short table: each process's peak and largest parts, then each device's need."""
    where = "GPU node" if machine.cuda else "CPU"
    table = Table(title=f"memory plan ({where}; GiB at each process's peak)", title_justify="left")
    for column in ("process", "×", "GiB", "largest parts (GiB)"):
        table.add_column(column, justify="right" if column in ("×", "GiB") else "left")
    for row in plan.rows():
        table.add_row(*row)
    return table


def check_memory(
    config: RunConfig,
    model_path: str,
    console: Console,
    prompt_tokens: int | None = None,
    machine: Machine | None = None,
) -> MemoryPlan:
    """Plan the run on `machine` (default: this one now, or the configured one), print the plan, and raise
    MemoryPlanError when it does not fit, unless `cluster.memory_check` is off (then say so and go on).
    Measure the machine before the run starts anything: the plan counts the driver and Ray itself."""
    machine = machine or machine_of(config)
    plan = plan_memory(config, model_path, machine, prompt_tokens)
    console.print(plan_table(plan, machine))
    problem = memory_problem(plan, config, model_path, machine, prompt_tokens)
    if problem and config.cluster.memory_check:
        raise MemoryPlanError(f"{problem}. {RUN_ANYWAY}; logra-plan prints the whole plan")
    if problem:
        console.print(f"[logra-train] {problem}. Running anyway: cluster.memory_check=false", soft_wrap=True)
    return plan


def with_changes(config: RunConfig, **groups: dict[str, object]) -> RunConfig:
    """`config` with some fields of some groups replaced: with_changes(c, optimizer={"name": "logra"})."""
    return dataclasses.replace(
        config, **{group: dataclasses.replace(getattr(config, group), **values) for group, values in groups.items()}
    )
