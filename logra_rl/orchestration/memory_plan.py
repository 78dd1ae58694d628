"""The run's memory, planned before anything starts.

From the model's config (`models.footprint`: parameter counts, and the activations a layer saves, traced on
the meta device): what each process holds, part by part, and when. Each component names its own parts: the
update rule (`RuleMemory`: optimizer state, sketches, KL probe, payload), the train worker (`TrainWorker.memory`:
weights, activations, logits) and the rollout engine (`memory`: weights, residual, KV cache); the plan adds
the processes' runtimes and sums them by phase. A part is held for the whole run
(`RESIDENT`) or only in one phase of the synchronous loop (loading, training, generating, syncing), so a
process's peak is its resident parts plus its largest phase, and a device's need is its processes' resident
parts plus the largest phase summed over them (on a CPU machine every process shares the host). One step off
(`algorithm.max_staleness=1`) the engines generate while the train ranks train: the host counts both at once.

The estimates are arithmetic plus a few measured constants (library runtimes, allocator slack), checked
against measured peaks by `scripts/bench/bench_memory.py` (docs/benchmarks.md §12).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch
from rich.console import Console
from rich.table import Table

from logra_rl.config import RunConfig
from logra_rl.models.footprint import (
    GENERATING,
    PHASES,
    RESIDENT,
    SYNCING,
    TRAINING,
    Lengths,
    Machine,
    ModelFootprint,
    Part,
    model_footprint,
)
from logra_rl.orchestration.cluster import MIN_OBJECT_STORE_MB
from logra_rl.orchestration.rollout_group import engine_class
from logra_rl.train.optimizers import UPDATE_RULES, RuleMemory, update_rule_class
from logra_rl.train.weight_export import largest_resync_bucket
from logra_rl.train.worker import TrainWorker
from logra_rl.utils.device import compute_dtype
from logra_rl.utils.memory import GIB

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


def plan_memory(config: RunConfig, model_path: str, machine: Machine, prompt_tokens: int | None = None) -> MemoryPlan:
    """The plan of `config` on `machine` for the model at `model_path` (only its config is read), for prompts
    of at most `prompt_tokens` (the data's longest; None: `data.max_prompt_length`)."""
    dtype = compute_dtype(config.model.compute_dtype, machine.cuda)
    model = model_footprint(model_path, config.model.target_modules, dtype)
    prompt = min(prompt_tokens or config.data.max_prompt_length, config.data.max_prompt_length)
    lengths = Lengths(prompt, prompt + config.data.max_response_length)
    rule = update_rule_class(config).memory(config, model, lengths.sequence, machine.cuda)
    sent, received = _transfer_buckets(config, model, machine.cuda)
    train = _train_ranks(config, model, rule, lengths, machine.cuda, sent)
    backend = config.rollout.backend
    held, notes = engine_class(backend).memory(config, model, lengths, machine, merges=rule.payload > 0)
    device = "each rollout GPU" if machine.cuda else "host"
    engines = ProcessPlan(
        "rollout engine", config.rollout.num_engines, device, (*held, *received, *_runtime(backend, machine.cuda))
    )
    driver = _driver(config, model, rule)
    processes = (*train, engines, driver)
    gpus = {}  # each GPU of a kind needs what its largest process needs
    for process in (*train, engines):
        if process.device != "host" and process.count:
            gpus[process.device] = max(gpus.get(process.device, 0.0), process.peak)
    budgets = [Budget(device, need, machine.gpu) for device, need in gpus.items()]
    overlapping = engines if config.algorithm.max_staleness else None
    budgets.append(Budget("host", _host_need(processes, overlapping), machine.host))
    return MemoryPlan(processes, tuple(budgets), tuple(notes))


def _host_need(processes: tuple[ProcessPlan, ...], generating: ProcessPlan | None = None) -> float:
    """What the processes need of the host together at the worst phase: everything of CPU processes, the host
    side of GPU ones. The synchronous loop runs one phase at a time; one step off (`generating`: the engines'
    plan) the engines generate while the other processes train, so that pair of phases is summed too."""

    def need(phase_of: Callable[[ProcessPlan], str]) -> float:
        return sum(p.count * p.held(phase_of(p), on_host=p.device != "host") for p in processes)

    worst = max(need(lambda p, phase=phase: phase) for phase in PHASES)
    if generating is not None:
        worst = max(worst, need(lambda p: GENERATING if p is generating else TRAINING))
    return worst


def _runtime(kind: str, cuda: bool) -> list[Part]:
    """A process's libraries: on a GPU node a CUDA context on its GPU and the CUDA libraries in host memory,
    else their measured share of the host (`RUNTIME_GIB[kind]`)."""
    if cuda:
        return [Part("CUDA context", CUDA_CONTEXT_GIB * GIB), Part("runtime", CUDA_HOST_GIB * GIB, on_host=True)]
    return [Part("runtime", RUNTIME_GIB[kind] * GIB)]


def _transfer_buckets(config: RunConfig, model: ModelFootprint, cuda: bool) -> tuple[list[Part], list[Part]]:
    """(train rank 0's parts, each engine's) of a full resync through the process group
    (`sync.resync_route=process_group`): rank 0 packs each bucket into one flat fp32 tensor on its host and, on a
    GPU, copies it to its device; every engine process receives it whole on its device (each tensor-parallel
    worker, which on a CPU all share the host). The object store's route is the driver's."""
    if config.sync.resync_route != "process_group":
        return [], []
    lora_rank = config.optimizer.lora_rank if config.optimizer.name == "lora" else 0
    bucket = largest_resync_bucket(model, config.sync.bucket_mb * 2**20, lora_rank)
    name = "resync bucket (process group)"
    sent = [Part(name, bucket, SYNCING, on_host=cuda), *([Part(name, bucket, SYNCING)] if cuda else [])]
    workers = 1 if cuda else config.rollout.gpus_per_engine
    return sent, [Part(name, workers * bucket, SYNCING)]


def _train_ranks(
    config: RunConfig,
    model: ModelFootprint,
    rule: RuleMemory,
    lengths: Lengths,
    cuda: bool,
    sent: list[Part],
) -> tuple[ProcessPlan, ...]:
    """Rank 0 (which also reads the checkpoint and sends the process group's resync buckets, `sent`) and the
    other ranks: the worker's weights, activations and logits around the update rule's state and KL probe."""
    resident, training, loading = TrainWorker.memory(config, model, rule.saved_per_token, lengths.sequence, cuda)
    parts = [*resident, *rule.state, *training, *rule.probe]
    transients = sum(p.nbytes for p in parts if p.phase == TRAINING)
    parts += [Part("allocator slack", (SLACK - 1) * transients, TRAINING), *_runtime("train", cuda)]
    device, ranks = "each train GPU" if cuda else "host", config.cluster.train_workers
    first = ProcessPlan("train rank 0", 1, device, (*parts, loading, *sent))
    return (first, ProcessPlan("train rank", ranks - 1, device, tuple(parts))) if ranks > 1 else (first,)


def _driver(config: RunConfig, model: ModelFootprint, rule: RuleMemory) -> ProcessPlan:
    """The driver with Ray's own processes, the grading processes, a step's payload in Ray's object store (rank
    0 puts it there and the engines read it; the driver holds only a reference) and (on a local Ray) the object
    store's pages a full resync writes: the fp32 model, up to the store's size."""
    parts = [
        Part("runtime", RUNTIME_GIB["driver"] * GIB),
        Part("data", DATA_GIB.get(config.data.task, 0.0) * GIB),
        Part("Ray processes", RUNTIME_GIB["ray"] * GIB),
        Part("graders", config.trainer.grader_workers * RUNTIME_GIB["grader"] * GIB),
    ]
    if rule.payload:
        parts.append(Part("payload (object store)", rule.payload, SYNCING))
    if not config.ray.address:
        store = config.ray.object_store_mb or max(MIN_OBJECT_STORE_MB, 3 * config.sync.bucket_mb)
        parts.append(Part("object store", min(store * 2**20, 4 * model.params), SYNCING))
    return ProcessPlan("driver + Ray", 1, "host", tuple(parts))


RUN_ANYWAY = "cluster.memory_check=false runs anyway"


class MemoryPlanError(ValueError):
    """The run does not fit its devices: one line with what needs how much, and what would fit."""


def alternatives(config: RunConfig) -> list[tuple[str, RunConfig]]:
    """The changes a user can make to need less memory, as (override, changed config): a lean update rule
    (`memory_lean`), more train ranks, activation checkpointing, smaller microbatches, full resyncs through the
    object store instead of the process group, the rule's own cuts."""
    changes = [
        (f"optimizer={name}", {"optimizer": {"name": name}})
        for name, rule in UPDATE_RULES.items()
        if rule.memory_lean and name != config.optimizer.name
    ]
    workers = config.cluster.train_workers
    changes.append((f"cluster.train_workers={2 * workers}", {"cluster": {"train_workers": 2 * workers}}))
    if not config.model.activation_checkpointing:
        changes.append(("model.activation_checkpointing=true", {"model": {"activation_checkpointing": True}}))
    tokens = config.trainer.micro_batch_tokens
    if tokens >= 1024:
        changes.append((f"trainer.micro_batch_tokens={tokens // 2}", {"trainer": {"micro_batch_tokens": tokens // 2}}))
    if config.sync.resync_route == "process_group":
        changes.append(("sync.resync_route=object_store", {"sync": {"resync_route": "object_store"}}))
    changes += update_rule_class(config).memory_cuts(config)
    return [(override, with_changes(config, **groups)) for override, groups in changes]


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
