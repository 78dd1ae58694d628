#!/usr/bin/env python
"""LoGRA benchmarks: training-step memory and time, payload size, apply time, bf16 drift.

    .venv/bin/python scripts/bench/bench_logra.py                        # everything (~5 min on 2 CPU cores)
    .venv/bin/python scripts/bench/bench_logra.py --only payload,drift   # some sections
    .venv/bin/python scripts/bench/bench_logra.py --quick                # smoke test, < 2 min

Sections: memory and time (one training step of a Qwen3-shaped model, dense AdamW vs LoGRA,
each variant in its own fresh subprocess so its peak RSS is its own), payload (bytes of
one update for real model shapes), apply (rollout-side merge of one 7B decoder layer) and
drift (bf16 rollout weights after many updates, per residual dtype). Results are printed
as tables and written to JSON (--out). docs/benchmarks.md discusses the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.table import Table
from torch import nn

from logra_rl.apps.bench_runs import child_result, print_child_result
from logra_rl.logra import (
    DEFAULT_TARGET_MODULES,
    LoGRAConfig,
    LoGRAOptimizer,
    PayloadEntry,
    PayloadMerger,
    UpdatePayload,
    find_targets,
    hf_targets,
    join_master,
    make_projection,
    merge_low_rank_,
    projection_fingerprint,
    projection_seed,
)
from logra_rl.models.shapes import GEMMA3_27B, QUICK_TRAIN_SHAPE, QWEN25_1P5B, QWEN25_7B, TRAIN_SHAPE, Shape
from logra_rl.utils.memory import GIB, RssSampler, peak_rss_bytes, rss_bytes
from logra_rl.utils.timing import timed

SECTIONS = ("memory", "time", "payload", "apply", "drift")
MEMORY_TARGET = 0.40  # LoGRA peak RSS / dense peak RSS
TIME_TARGET = 0.85  # LoGRA step time / dense step time at rank 64
RESIDUALS = ("tail", "float32", "bfloat16", "none")  # rollout-side residuals compared in the drift section
MIB = 2**20
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)


# ---- model shapes (logra_rl/models/shapes.py) ---------------------------------------------------


PAYLOAD_SHAPES = (QWEN25_1P5B, QWEN25_7B, GEMMA3_27B)


@dataclass(frozen=True)
class Target:
    name: str
    d_out: int
    k_in: int


def meta_model(shape: Shape) -> nn.Module:
    """The model on the meta device: exact names and parameter counts, no memory, no download."""
    with torch.device("meta"):
        return shape.model_class()(shape.hf_config())


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def layer_targets(model: nn.Module) -> list[Target]:
    """LoGRA's targets, found by the library's own rule (the 7 projections per layer)."""
    found = find_targets(model, DEFAULT_TARGET_MODULES)
    return [Target(name, m.out_features, m.in_features) for name, m in found]


# ---- small utilities -----------------------------------------------------------------------


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def verdict(ratio: float, target: float, quick: bool) -> str:
    """Targets are judged on the real shape only; --quick shapes are too small to say anything."""
    if quick:
        return "n/a (--quick)"
    return f"{'met' if ratio <= target else 'MISSED'} (<= {target})"


def show(title: str, columns: list[str], rows: list[list[str]], plain: bool) -> None:
    """Print a table with rich, or as aligned plain text (logs, CI, copy into markdown)."""
    if not plain:
        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(column, justify="right" if column != columns[0] else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(str(x)) for x in column) for column in zip(columns, *rows, strict=True)]
    print(f"\n{title}")
    for line in [columns, ["-" * w for w in widths], *rows]:
        cells = [str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths, strict=True))]
        print("  ".join(cells))


# ---- memory and time: one training step, in a child process --------------------------------


def token_sum_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over tokens (LoGRA normalises by num_tokens in prepare)."""
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def build_train_model(shape: Shape, grad_ckpt: bool) -> nn.Module:
    """Random-init fp32 model (fixed seed); optional non-reentrant activation checkpointing."""
    torch.manual_seed(0)
    model = shape.model_class()(shape.hf_config()).float().train()
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


Updater = Callable[[int], dict[str, float]]  # num_tokens -> timings of the update's own phases


def dense_updater(model: nn.Module) -> tuple[Updater, Callable[[], int]]:
    """The paper's dense baseline: AdamW over every parameter (embeddings included)."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def update(num_tokens: int) -> dict[str, float]:
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {}

    def state_bytes() -> int:  # fp32 grads (alive at the peak) + the two Adam moments
        moments = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        return moments + sum(p.nbytes for p in params)

    return update, state_bytes


def frozen_updater(model: nn.Module) -> tuple[Updater, Callable[[], int]]:
    """No update: backward through a frozen model, the floor of any method that needs input gradients."""
    model.requires_grad_(False)
    model.enable_input_require_grads()  # the embedding output requires grad, so backward runs through the layers
    return (lambda num_tokens: {}), (lambda: 0)


def logra_updater(model: nn.Module, rank: int) -> tuple[Updater, Callable[[], int]]:
    """LoGRA at `rank`: sketches during backward, then prepare + commit at alpha 1."""
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=rank))

    def update(num_tokens: int) -> dict[str, float]:
        _, prepare_s = timed(lambda: opt.prepare(num_tokens=num_tokens))
        _, commit_s = timed(lambda: opt.commit(alpha=1.0))
        return {"prepare_s": prepare_s, "commit_s": commit_s}

    def state_bytes() -> int:  # sketches, projections and RowAdam row moments (directions are transient)
        tensors = [t.sketch for t in opt.targets] + [t.projection for t in opt.targets] + opt.second_moments
        return sum(t.numel() * t.element_size() for t in tensors)

    return update, state_bytes


def timed_step(model: nn.Module, ids: torch.Tensor, update: Updater) -> dict[str, float]:
    """One forward + backward + update, timed per phase."""
    cpu_start = time.process_time()
    loss, forward_s = timed(lambda: token_sum_loss(model, ids))
    _, backward_s = timed(loss.backward)
    phases, update_s = timed(lambda: update(ids[:, 1:].numel()))
    times = {"forward_s": forward_s, "backward_s": backward_s, "update_s": update_s}
    # cpu_s / step_s near the thread count means the step had the cores to itself
    return {**times, "step_s": forward_s + backward_s + update_s, "cpu_s": time.process_time() - cpu_start, **phases}


def updated_params(model: nn.Module, variant: str) -> int:
    """Parameters the step changes: all for dense AdamW; the 7 targeted linears per layer for LoGRA."""
    if variant == "dense":
        return param_count(model)
    if variant == "frozen":
        return 0
    return sum(m.weight.numel() for _, m in find_targets(model, DEFAULT_TARGET_MODULES))


def run_step_child(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one variant in this (fresh) process: baseline RSS, peak RSS, step times."""
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    shape = QUICK_TRAIN_SHAPE if args.quick else TRAIN_SHAPE
    grad_ckpt = args.grad_ckpt == "on"
    load_before = os.getloadavg()[0]  # other work on the machine distorts the times; recorded, not hidden
    model = build_train_model(shape, grad_ckpt)
    build_peak = peak_rss_bytes()
    ids = torch.randint(0, shape.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    baseline = rss_bytes()
    if args.variant == "dense":
        update, state_bytes = dense_updater(model)
    elif args.variant == "frozen":
        update, state_bytes = frozen_updater(model)
    else:
        update, state_bytes = logra_updater(model, args.rank)
    sampler = RssSampler()
    sampler.start()
    steps = [timed_step(model, ids, update) for _ in range(args.warmup + args.steps)]
    sampler.stop()
    timed = steps[args.warmup :]
    return {
        "variant": args.variant,
        "rank": args.rank if args.variant == "logra" else None,
        "grad_ckpt": grad_ckpt,
        "quick": args.quick,
        "shape": asdict(shape),
        "params": param_count(model),
        "updated_params": updated_params(model, args.variant),
        "tokens": args.batch * args.seq_len,
        "baseline_rss_bytes": baseline,
        "build_peak_rss_bytes": build_peak,
        "peak_rss_bytes": peak_rss_bytes(),
        "psutil_peak_rss_bytes": max(sampler.samples),
        "mean_step_rss_bytes": statistics.fmean(sampler.samples),
        "optimizer_state_bytes": state_bytes(),
        **{key: statistics.median(s[key] for s in timed) for key in timed[0]},
        "min_step_s": min(s["step_s"] for s in timed),
        # share of the threads' CPU time the steps got: well below 1.0 means another process competed for the cores
        "cpu_share": statistics.median(s["cpu_s"] / s["step_s"] for s in timed) / args.threads,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "all_steps": steps,
    }


def spawn_step_child(args: argparse.Namespace, variant: str, rank: int, grad_ckpt: str) -> dict[str, Any]:
    """Run one variant in a fresh interpreter so that ru_maxrss is that variant's alone."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "step", "--variant", variant]
    command += ["--rank", str(rank), "--grad-ckpt", grad_ckpt, "--threads", str(args.threads)]
    command += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    command += ["--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    label = f"{variant}{f' r={rank}' if variant == 'logra' else ''} (grad ckpt {grad_ckpt})"
    console.print(f"[step] running {label} in a fresh process (load average {os.getloadavg()[0]:.2f}) ...")
    return child_result(command, label)


def bench_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Dense vs LoGRA at each rank, for each activation-checkpointing setting; adds ratios."""
    rows = []
    for grad_ckpt in ("off", "on") if args.grad_ckpt == "both" else (args.grad_ckpt,):
        dense = spawn_step_child(args, "dense", 0, grad_ckpt)
        group = [dense] + [spawn_step_child(args, "logra", rank, grad_ckpt) for rank in args.ranks]
        if args.frozen_floor:
            group.append(spawn_step_child(args, "frozen", 0, grad_ckpt))
        for row in group:
            row["memory_ratio"] = row["peak_rss_bytes"] / dense["peak_rss_bytes"]
            row["time_ratio"] = row["step_s"] / dense["step_s"]
            row["time_ratio_min"] = row["min_step_s"] / dense["min_step_s"]
        rows += group
    return rows


def variant_label(row: dict[str, Any]) -> str:
    names = {"dense": "dense AdamW", "frozen": "floor: frozen fwd+bwd"}
    name = names.get(row["variant"], f"LoGRA r={row['rank']}")
    return f"{name}{' +ckpt' if row['grad_ckpt'] else ''}"


def print_memory(rows: list[dict[str, Any]], plain: bool) -> None:
    columns = ["variant", "baseline GiB", "peak GiB", "psutil peak", "mean step", "peak-base", "opt state"]
    columns += ["peak / dense", "target"]
    table = []
    for row in rows:
        gib = [row[k] / GIB for k in ("baseline_rss_bytes", "peak_rss_bytes", "psutil_peak_rss_bytes")]
        gib += [row["mean_step_rss_bytes"] / GIB, (row["peak_rss_bytes"] - row["baseline_rss_bytes"]) / GIB]
        gib += [row["optimizer_state_bytes"] / GIB]
        target = "" if row["variant"] != "logra" else verdict(row["memory_ratio"], MEMORY_TARGET, row["quick"])
        table.append([variant_label(row), *(fmt(x) for x in gib), fmt(row["memory_ratio"], 3), target])
    first = rows[0]
    shape = first["shape"]
    title = (
        f"Memory: one training step, {shape['name']} ({first['params'] / 1e6:.0f}M params, hidden {shape['hidden']}, "
        f"{shape['layers']} layers), {first['tokens']} tokens, RSS"
    )
    show(title, columns, table, plain)


def print_time(rows: list[dict[str, Any]], plain: bool) -> None:
    columns = ["variant", "forward s", "backward s", "update s", "step s (median)", "step / dense", "target"]
    columns += ["min step s", "min / dense", "cpu share"]
    table = []
    for row in rows:
        is_r64 = row["variant"] == "logra" and row["rank"] == 64
        target = verdict(row["time_ratio"], TIME_TARGET, row["quick"]) if is_r64 else ""
        times = [row[k] for k in ("forward_s", "backward_s", "update_s", "step_s")]
        table.append([variant_label(row), *(fmt(x) for x in times), fmt(row["time_ratio"], 3), target])
        table[-1] += [fmt(row["min_step_s"]), fmt(row["time_ratio_min"], 3), fmt(row["cpu_share"])]
    show("Step time: forward + backward + update (phases: medians; target on the median step)", columns, table, plain)
    contended = [variant_label(row) for row in rows if row["cpu_share"] < 0.9]
    if contended:
        console.print(f"WARNING: other processes competed for the CPU during {contended}; rerun on a quiet machine")


# ---- payload size ----------------------------------------------------------------------------


def make_payload(targets: list[Target], rank: int, factors: list[torch.Tensor], version: int = 0) -> UpdatePayload:
    """An UpdatePayload built as LoGRAOptimizer.commit builds one (seeded A, fingerprint of the first)."""
    base_seed = LoGRAConfig().seed
    first = targets[0]
    projection = make_projection(rank, first.k_in, projection_seed(base_seed, version, first.name))
    entries = tuple(PayloadEntry(t.name, t.d_out, t.k_in, f) for t, f in zip(targets, factors, strict=True))
    return UpdatePayload(
        base_version=version,
        new_version=version + 1,
        base_seed=base_seed,
        projection_update=version,
        rank=rank,
        distribution="rademacher",
        wire_dtype="bfloat16",
        fingerprint=projection_fingerprint(projection),
        entries=entries,
    )


def zero_factors(targets: list[Target], rank: int) -> list[torch.Tensor]:
    """Zero bf16 factors; expanded views, so only to_bytes materialises them (one at a time)."""
    zero = torch.zeros((), dtype=torch.bfloat16)
    return [zero.expand(t.d_out, rank) for t in targets]


def measure_payload(targets: list[Target], rank: int, max_factor_bytes: float) -> dict[str, Any]:
    """len(to_bytes()) for real; above max_factor_bytes, analytic factors + the header measured at rank 1."""
    formula = sum(t.d_out * rank * 2 for t in targets)  # Σ d_out · rank · bytes(bf16)
    measured_rank = rank if formula <= max_factor_bytes else 1
    payload = make_payload(targets, measured_rank, zero_factors(targets, measured_rank))
    data, seconds = timed(payload.to_bytes)
    metadata = len(data) - payload.factor_bytes
    if measured_rank == rank:
        assert payload.factor_bytes == formula, (payload.factor_bytes, formula)
    return {
        "rank": rank,
        "factor_bytes": formula,
        "metadata_bytes": metadata,
        "payload_bytes": formula + metadata,
        "method": "to_bytes" if measured_rank == rank else "analytic factors + rank-1 header",
        "to_bytes_s": seconds if measured_rank == rank else None,
    }


def bench_payload(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for shape in args.payload_shapes:
        model = meta_model(shape)
        params, targets = param_count(model), layer_targets(model)
        for rank in args.payload_ranks:
            console.print(f"[payload] {shape.name} r={rank} ...")
            row = measure_payload(targets, rank, args.payload_max_gib * GIB)
            row.update(model=shape.name, layers=shape.layers, params=params, modules=len(targets))
            row.update(target_params=sum(t.d_out * t.k_in for t in targets), full_bf16_bytes=params * 2)
            rows.append(row)
    return rows


def print_payload(rows: list[dict[str, Any]], plain: bool) -> None:
    columns = ["model", "params", "full bf16", "rank", "payload", "factors", "metadata B", "% of full", "to_bytes s"]
    table = []
    for row in rows:
        seconds = "-" if row["to_bytes_s"] is None else fmt(row["to_bytes_s"])
        table.append(
            [
                f"{row['model']} ({row['modules']} modules)",
                f"{row['params'] / 1e9:.2f}B",
                f"{row['full_bf16_bytes'] / GIB:.2f} GiB",
                str(row["rank"]),
                f"{row['payload_bytes'] / MIB:.1f} MiB",
                f"{row['factor_bytes'] / MIB:.1f} MiB",
                f"{row['metadata_bytes']}{'' if row['method'] == 'to_bytes' else ' (rank-1 header)'}",
                f"{100 * row['payload_bytes'] / row['full_bf16_bytes']:.2f}%",
                seconds,
            ]
        )
    show("Payload size per update (bf16 factors) vs the full bf16 model", columns, table, plain)


# ---- apply time: one decoder layer on the rollout side -----------------------------------------


def random_layer(targets: list[Target], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.d_out, t.k_in, generator=generator).mul_(0.02).to(dtype) for t in targets}


def random_factors(targets: list[Target], rank: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.d_out, rank, generator=generator).mul_(1e-4).to(torch.bfloat16) for t in targets]


def bench_apply(args: argparse.Namespace) -> list[dict[str, Any]]:
    """merger.apply (A regenerated from seeds, fp32 residual) vs A generation alone vs the trainer's fp32 merge."""
    shape = args.apply_shape
    targets = [t for t in layer_targets(meta_model(shape)) if t.name.startswith("model.layers.0.")]
    merger = PayloadMerger(hf_targets(random_layer(targets, torch.bfloat16), "float32"))
    master = {name: w.float() for name, w in merger.weights.items()}
    rows = []
    for rank in args.apply_ranks:
        console.print(f"[apply] {shape.name} layer 0, r={rank} ...")
        applies, generation, trainer = [], [], []
        for _ in range(args.apply_repeats):
            payload = make_payload(targets, rank, random_factors(targets, rank, merger.version), merger.version)
            applies.append(timed(lambda p=payload: merger.apply(p))[1])
            generation.append(timed(lambda p=payload: [p.projection(e) for e in p.entries])[1])
            projections = [payload.projection(e) for e in payload.entries]

            def trainer_merge(p: UpdatePayload = payload, a: list[torch.Tensor] = projections) -> None:
                for entry, projection in zip(p.entries, a, strict=True):
                    merge_low_rank_(master[entry.name], entry.factor, projection)

            trainer.append(timed(trainer_merge)[1])
        rows.append(
            {
                "model": shape.name,
                "layers": shape.layers,
                "rank": rank,
                "layer_params": sum(t.d_out * t.k_in for t in targets),
                "layer_payload_bytes": payload.factor_bytes,
                "apply_s": statistics.median(applies),
                "projection_s": statistics.median(generation),
                "trainer_merge_s": statistics.median(trainer),
                "repeats": args.apply_repeats,
            }
        )
    return rows


def print_apply(rows: list[dict[str, Any]], plain: bool) -> None:
    columns = ["rank", "layer payload", "apply s", "of which A gen s", "trainer fp32 merge s", "whole model apply s"]
    table = [
        [
            str(row["rank"]),
            f"{row['layer_payload_bytes'] / MIB:.2f} MiB",
            fmt(row["apply_s"], 3),
            fmt(row["projection_s"], 3),
            fmt(row["trainer_merge_s"], 3),
            f"~{row['apply_s'] * row['layers']:.1f} (x{row['layers']})",
        ]
        for row in rows
    ]
    first = rows[0]
    title = (
        f"Apply on CPU: one {first['model']} decoder layer (7 targets, {first['layer_params'] / 1e6:.0f}M params, "
        f"bf16 weights + fp32 residual), median of {first['repeats']}"
    )
    show(title, columns, table, plain)


# ---- drift: bf16 rollout weights after many updates -------------------------------------------


def drift_update(
    master: torch.Tensor,
    direction: torch.Tensor,
    name: str,
    step: int,
    rank: int,
    ratio: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """U = c·(G + noise)·Aᵀ, the sketch of a consistent gradient G, scaled so ‖UA‖/‖W‖ = ratio, in bf16."""
    projection = make_projection(rank, master.shape[1], projection_seed(LoGRAConfig().seed, step, name))
    gradient = direction + torch.randn(direction.shape, generator=generator)
    factor = gradient @ projection.t()
    scale = ratio * torch.linalg.vector_norm(master) / torch.linalg.vector_norm(factor @ projection)
    return (factor * scale).to(torch.bfloat16), projection


def drift_metrics(weight: torch.Tensor, master: torch.Tensor, master0: torch.Tensor) -> dict[str, float]:
    """Errors relative to the accumulated update, bit-equality with bf16(master), share of the update lost.

    rel_error includes bf16's own rounding of the master (the floor any bf16 copy has);
    rel_drift is the part beyond it: the distance to the ideal copy bf16(master).
    """
    update = master - master0
    update_norm = torch.linalg.vector_norm(update)
    realised = weight.float() - master0.to(torch.bfloat16).float()
    return {
        "rel_error": float(torch.linalg.vector_norm(weight.float() - master) / update_norm),
        "rel_drift": float(torch.linalg.vector_norm(weight.float() - master.to(torch.bfloat16).float()) / update_norm),
        "bit_equal_fraction": float((weight == master.to(torch.bfloat16)).float().mean()),
        "update_lost_fraction": float(1 - (realised * update).sum() / update.square().sum()),
        "max_abs_diff": float((weight.float() - master).abs().max()),
    }


def bench_drift(args: argparse.Namespace) -> dict[str, Any]:
    """An fp32 master and bf16 rollout copies (residual tail / fp32 / bf16 / none) fed the same payloads."""
    name, size, rank, ratio = "model.layers.0.mlp.down_proj", args.drift_size, 16, LoGRAConfig().update_ratio
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(size, size, generator=generator).mul_(0.02)
    master0 = master.clone()
    direction = torch.randn(size, size, generator=generator)  # the consistent component of every step
    mergers = {
        dtype: PayloadMerger(hf_targets({name: torch.empty(size, size, dtype=torch.bfloat16)}, dtype))
        for dtype in RESIDUALS
    }
    for merger in mergers.values():
        merger.resync({name: master}, version=0)
    changed = []
    for step in range(args.drift_steps):
        factor, projection = drift_update(master, direction, name, step, rank, ratio, generator)
        merge_low_rank_(master, factor, projection)
        payload = make_payload([Target(name, size, size)], rank, [factor], version=step)
        before = mergers["float32"].weights[name].clone()
        for merger in mergers.values():
            merger.apply(payload)
        changed.append(float((mergers["float32"].weights[name] != before).float().mean()))
    rows = [{"residual": dtype, **drift_metrics(m.weights[name], master, master0)} for dtype, m in mergers.items()]
    tail = mergers["tail"].targets[name]
    rows[0]["master_bit_equal_fraction"] = float((join_master(tail.weight, tail.residual) == master).float().mean())
    rows[0]["exact_ties"] = int((tail.weight != master.to(torch.bfloat16)).sum())
    rows.append({"residual": "ideal: bf16(master)", **drift_metrics(master.to(torch.bfloat16), master, master0)})
    accumulated = float(torch.linalg.vector_norm(master - master0) / torch.linalg.vector_norm(master0))
    return {
        "shape": [size, size],
        "rank": rank,
        "steps": args.drift_steps,
        "update_ratio": ratio,
        "accumulated_update_ratio": accumulated,
        "changed_fraction_per_step": statistics.fmean(changed),
        "rows": rows,
        "sparse_delta_estimate": sparse_delta_estimate(args, statistics.fmean(changed)),
    }


def sparse_delta_estimate(args: argparse.Namespace, changed_fraction: float) -> list[dict[str, Any]]:
    """An exact sparse bf16 delta (int32 index + bf16 value per changed element), extrapolated per model."""
    rows = []
    for shape in args.payload_shapes:
        target_params = sum(t.d_out * t.k_in for t in layer_targets(meta_model(shape)))
        rows.append({"model": shape.name, "bytes": int(target_params * changed_fraction * 6)})
    return rows


def print_drift(result: dict[str, Any], plain: bool) -> None:
    columns = ["rollout residual", "rel. error", "rel. drift", "bit-equal to bf16(master)", "update lost", "max |diff|"]
    table = [
        [
            row["residual"],
            f"{row['rel_error']:.4f}",
            f"{row['rel_drift']:.4f}",
            f"{100 * row['bit_equal_fraction']:.2f}%",
            f"{100 * row['update_lost_fraction']:.1f}%",
            f"{row['max_abs_diff']:.2e}",
        ]
        for row in result["rows"]
    ]
    size = result["shape"]
    title = (
        f"Drift after {result['steps']} updates of a {size[0]}x{size[1]} weight (rank {result['rank']}, "
        f"‖UA‖/‖W‖ = {result['update_ratio']:g} per step, accumulated ‖ΔW‖/‖W‖ = "
        f"{result['accumulated_update_ratio']:.2e}); rel. error = ‖W_rollout − master‖ / ‖master − master_0‖, "
        "rel. drift = ‖W_rollout − bf16(master)‖ / ‖master − master_0‖"
    )
    show(title, columns, table, plain)
    tail = result["rows"][0]
    print(
        f"tail residual: bf16 + tail equals the fp32 master for {100 * tail['master_bit_equal_fraction']:.2f}% "
        f"of elements; the bf16 weight differs from bf16(master) at {tail['exact_ties']} exact ties"
    )
    fraction = result["changed_fraction_per_step"]
    estimate = result["sparse_delta_estimate"]
    sparse = [[row["model"], f"{100 * fraction:.2f}%", f"{row['bytes'] / MIB:.1f} MiB"] for row in estimate]
    columns = ["model", "bf16 elements changed", "sparse delta (int32 index + bf16 value)"]
    show("Exact sparse bf16 delta per step (estimate from the drift run)", columns, sparse, plain)


# ---- driver -----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats: a smoke test, < 2 min")
    parser.add_argument("--out", type=Path, default=Path("bench_results/logra_bench.json"), help="JSON output path")
    parser.add_argument("--plain", action="store_true", help="plain-text tables instead of rich")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process")
    step = parser.add_argument_group("memory / time")
    step.add_argument("--ranks", type=int_list, default=[64, 256], help="LoGRA ranks to compare with dense")
    step.add_argument("--batch", type=int, default=2, help="sequences per step")
    step.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    step.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    step.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    step.add_argument(
        "--no-frozen-floor",
        dest="frozen_floor",
        action="store_false",
        help="skip the reference row: backward through the frozen model with no update",
    )
    step.add_argument("--grad-ckpt", choices=("off", "on", "both"), default="both", help="activation checkpointing")
    other = parser.add_argument_group("payload / apply / drift")
    other.add_argument("--payload-ranks", type=int_list, default=[16, 64, 256])
    other.add_argument("--payload-max-gib", type=float, default=4.0, help="above this, factor bytes are analytic")
    other.add_argument("--apply-ranks", type=int_list, default=[16, 64, 256])
    other.add_argument("--apply-repeats", type=int, default=3)
    other.add_argument("--drift-steps", type=int, default=200)
    other.add_argument("--drift-size", type=int, default=1024)
    internal = parser.add_argument_group("internal (one variant in a child process)")
    internal.add_argument("--child", choices=("step",), help=argparse.SUPPRESS)
    internal.add_argument("--variant", choices=("dense", "logra", "frozen"), help=argparse.SUPPRESS)
    internal.add_argument("--rank", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    args.payload_shapes, args.apply_shape = PAYLOAD_SHAPES, QWEN25_7B
    if args.quick:  # same code paths, smaller shapes and fewer repeats
        args.warmup, args.steps, args.seq_len = 1, 2, 64
        args.payload_ranks, args.apply_ranks, args.apply_repeats = [16, 64], [16, 64], 1
        args.apply_shape, args.drift_steps, args.drift_size = QWEN25_1P5B, 30, 512
    return args


def save(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print_child_result(run_step_child(args))
        return
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    internal = ("child", "variant", "rank", "payload_shapes", "apply_shape")
    config = {k: v for k, v in vars(args).items() if k not in internal}
    results: dict[str, Any] = {"machine": machine_info(), "args": config}
    console.print(f"machine: {results['machine']}")
    if {"memory", "time"} & set(args.sections):
        results["steps"] = bench_steps(args)
        save(args.out, results)
        if "memory" in args.sections:
            print_memory(results["steps"], args.plain)
        if "time" in args.sections:
            print_time(results["steps"], args.plain)
    sections = {"payload": (bench_payload, print_payload), "apply": (bench_apply, print_apply)}
    sections["drift"] = (bench_drift, print_drift)
    for name, (bench, report) in sections.items():
        if name in args.sections:
            results[name] = bench(args)
            save(args.out, results)
            report(results[name], args.plain)
    results["total_s"] = time.perf_counter() - started
    save(args.out, results)
    console.print(f"wrote {args.out} ({results['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
