"""The memory plan of the paper's presets on one 8×H100-80GB node (4 train + 4 rollout GPUs): dense vs LoGRA vs
LoRA, what fits and with what margin, and what the tail residual buys in vLLM's KV cache (issue 14).

    .venv/bin/python scripts/tools/plan_presets.py [--gpu-gib 80] [--host-gib 1800] [--out FILE]

Runs anywhere (no GPU): the models are their configs alone (logra_rl/models/shapes.py), planned as `logra-plan
+experiment=NAME` plans them without CUDA (cluster.device=cuda cluster.gpu_memory_gib=80). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_module

from logra_rl.config import RunConfig
from logra_rl.logra.merge import residual_bytes
from logra_rl.models.footprint import Machine, model_footprint
from logra_rl.models.shapes import HUB_SHAPES, PRESET_MODELS, write_model
from logra_rl.orchestration.memory_plan import CUDA_CONTEXT_GIB, plan_memory, with_changes
from logra_rl.rollout.vllm_engine import VLLM_ACTIVATION_GIB
from logra_rl.train.optimizers import UPDATE_RULES
from logra_rl.utils.memory import GIB

PRESETS = {preset: HUB_SHAPES[model] for preset, model in PRESET_MODELS.items()}


def preset_config(name: str, model_dir: Path) -> RunConfig:
    overrides = [f"+experiment={name}", f"model.path={model_dir}", "cluster.device=cuda"]
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return RunConfig.from_mapping(compose("config", overrides=overrides))


def kv_room(config: RunConfig, model_dir: Path, residual: str, gpu: float) -> tuple[float, float, float, float]:
    """(the residual's GiB per rollout GPU, the largest gpu_memory_utilization that leaves room for it beside
    vLLM, vLLM's KV cache then in GiB per GPU, and in tokens)."""
    model = model_footprint(str(model_dir), config.model.target_modules, "bfloat16")
    tp = config.rollout.gpus_per_engine
    residual_gpu = residual_bytes(residual, config.rollout.dtype) * model.target_params / tp
    utilization = (gpu - residual_gpu - CUDA_CONTEXT_GIB * GIB) / gpu
    kv = utilization * gpu - 2 * model.params / tp - VLLM_ACTIVATION_GIB * GIB
    return residual_gpu / GIB, utilization, kv / GIB, kv / model.kv_bytes_per_token(2, tp)


def guard_rows(config: RunConfig, model_dir: Path, machine: Machine) -> dict[str, object]:
    """LoGRA's KL guard on the preset: its part of a train rank at the default `guard_responses`, and the most
    responses per rank it can measure with the plan still fitting (the rank's whole share at most)."""
    rank_rows = -(-config.trainer.prompts_per_step * config.rollout.n // config.cluster.train_workers)

    def plan(rows: int):
        kl = dataclasses.replace(config.logra.kl, guard_responses=rows)
        return plan_memory(with_changes(config, logra={"kl": kl}), str(model_dir), machine)

    default = config.logra.kl.guard_responses or rank_rows
    part = next(p for p in plan(default).processes[0].parts if p.name == "KL probe and guard")
    fits = max((rows for rows in range(1, rank_rows + 1) if plan(rows).fits), default=0)
    return {"rank_rows": rank_rows, "default": default, "default_gib": part.nbytes / GIB, "fits": fits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--host-gib", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("bench_results/plan_presets.json"))
    args = parser.parse_args()
    machine = Machine(cuda=True, host=args.host_gib * GIB, gpu=args.gpu_gib * GIB)
    results = {}
    print(f"| preset | optimizer | each train GPU (of {args.gpu_gib:g} GiB) | each rollout GPU | host | fits |")
    print("|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for preset, shape in PRESETS.items():
            model_dir = write_model(shape, Path(scratch) / preset, weights=False)
            config = preset_config(preset, model_dir)
            for optimizer in UPDATE_RULES:
                plan = plan_memory(with_changes(config, optimizer={"name": optimizer}), str(model_dir), machine)
                needs = {b.device: b.need / GIB for b in plan.budgets}
                train = plan.processes[0]
                state = {p.name: p.nbytes / GIB for p in train.parts}
                results[f"{preset}/{optimizer}"] = {"needs_gib": needs, "fits": plan.fits, "train_rank_gib": state}
                margin = args.gpu_gib - needs["each train GPU"]
                train_gpu = f"{needs['each train GPU']:.1f} ({margin:+.1f}; {train.largest(3)})"
                print(
                    f"| {preset} ({shape.name}) | {optimizer} | {train_gpu} | {needs['each rollout GPU']:.1f} | "
                    f"{needs['host']:.0f} | {'yes' if plan.fits else 'NO'} |"
                )
            rooms = {residual: kv_room(config, model_dir, residual, machine.gpu) for residual in ("tail", "float32")}
            results[f"{preset}/kv_room"] = rooms
            results[f"{preset}/guard_rows"] = guard_rows(config, model_dir, machine)
    print("\n| preset | residual | GiB per rollout GPU | largest vLLM share beside it | KV cache per GPU | tokens |")
    print("|---|---|---:|---:|---:|---:|")
    for preset in PRESETS:
        for residual, (size, utilization, kv, tokens) in results[f"{preset}/kv_room"].items():
            print(f"| {preset} | {residual} | {size:.1f} | {utilization:.2f} | {kv:.1f} GiB | {tokens:,.0f} |")
    print("\n| preset | rows a train rank trains on | the KL guard's part (default rows) | most guard rows that fit |")
    print("|---|---:|---|---:|")
    for preset in PRESETS:
        rows = results[f"{preset}/guard_rows"]
        part = f"{rows['default_gib']:.1f} GiB ({rows['default']} rows)"
        print(f"| {preset} | {rows['rank_rows']} | {part} | {rows['fits']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
