"""Host memory and time of a full resync (trainer fp32 master → rollout engines) by bucket size.

    .venv/bin/python scripts/bench/bench_resync.py [--layers 24] [--hidden 1024] [--out bench_results/resync_bench.json]
        [--routes object_store process_group] [--buckets-mb 4096 256 64] [--model DIR]

Runs the real Controller through Ray on CPU: 2 FSDP2 train workers, 1 HF engine, a Qwen3-shaped
model (24 layers of hidden 1024 by default: 167M parameters, 0.67 GB in fp32). For each
`sync.bucket_mb` it resets every process's peak RSS (Linux `clear_refs`), runs full
resyncs, and reports how far each process's peak rose above its resident size before the resync,
plus the seconds per resync and the drift after it (0: the engine holds bf16(master) exactly), for each route a
resync's buckets take (`sync.resync_route`: Ray's object store, or a process group of their own).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import psutil
import torch
from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM

from logra_rl.config import RunConfig
from logra_rl.data import quickstart
from logra_rl.models.tiny import char_tokenizer, tiny_model
from logra_rl.orchestration.controller import started
from logra_rl.utils.memory import GIB, peak_rss_since_reset, reset_peak_rss
from logra_rl.utils.timing import timed


def ray_processes(class_name: str) -> list[psutil.Process]:
    """Ray names an actor's process `ray::<Class>` (or `ray::<Class>.<method>` while it runs one)."""
    return [
        p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(f"ray::{class_name}")
    ]


def measure(model_dir: Path, bucket_mb: float, repeats: int, route: str) -> dict[str, float]:
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "model=hf",
                f"model.path={model_dir}",
                f"sync.bucket_mb={bucket_mb}",
                f"sync.resync_route={route}",
                "cluster.memory_check=false",  # the plan counts training, which never runs here
                "logger.progress=false",
            ],
        )
    with (
        tempfile.TemporaryDirectory() as run_dir,
        started(RunConfig.from_mapping(cfg), Path(run_dir), {}) as controller,
    ):
        processes = {"train": ray_processes("TrainWorker"), "engine": ray_processes("HFEngine")}
        processes["driver"] = [psutil.Process()]
        controller.weight_sync.full_resync(controller.policy_version)  # the process group formed: not timed
        before = {role: [reset_peak_rss(p.pid) for p in procs] for role, procs in processes.items()}
        resyncs, seconds = timed(
            lambda: [controller.weight_sync.full_resync(controller.policy_version) for _ in range(repeats)]
        )
        moved, seconds = resyncs[-1], seconds / repeats
        drift = controller.weight_sync.drift(step=0)
        rise = {
            role: max(peak_rss_since_reset(p.pid) - b for p, b in zip(procs, before[role], strict=True))
            for role, procs in processes.items()
        }
        buckets = len(controller.weight_sync.buckets)
    return {
        "route": route,
        "bucket_mb": bucket_mb,
        "buckets": buckets,
        "fp32_gib": moved / GIB,
        "seconds": seconds,
        "train_rise_gib": rise["train"] / GIB,
        "engine_rise_gib": rise["engine"] / GIB,
        "driver_rise_gib": rise["driver"] / GIB,
        "drift": drift,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[4096, 256, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routes", nargs="+", default=["object_store", "process_group"])
    parser.add_argument("--model", type=Path, default=None, help="an HF model directory instead of the built one")
    parser.add_argument("--out", type=Path, default=Path("bench_results/resync_bench.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        model_dir = args.model or Path(directory) / "model"
        if args.model is None:
            tokenizer = char_tokenizer(quickstart.ALPHABET)
            model = tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers)
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            del model
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        rows = [measure(model_dir, mb, args.repeats, route) for route in args.routes for mb in args.buckets_mb]
        layers = config.num_hidden_layers

    table = Table(title=f"full resync, {parameters / 1e6:.0f}M parameters ({layers} layers): peak RSS rise in GiB")
    for column in (
        "route",
        "bucket MB",
        "buckets",
        "fp32 GiB",
        "s/resync",
        "Δpeak train",
        "Δpeak engine",
        "Δpeak driver",
        "drift",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["route"],
            f"{r['bucket_mb']:g}",
            str(r["buckets"]),
            f"{r['fp32_gib']:.2f}",
            f"{r['seconds']:.2f}",
            f"{r['train_rise_gib']:.3f}",
            f"{r['engine_rise_gib']:.3f}",
            f"{r['driver_rise_gib']:.3f}",
            f"{r['drift']:g}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"model": str(args.model or "built"), "parameters": parameters, "layers": layers, "rows": rows}, indent=2
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
