"""logra_rl against TRL's GRPOTrainer on the same small job, run one after the other (issue 13).

    .venv/bin/python scripts/bench/bench_trl.py [--runs trl_dense,trl_lora,dense,logra,lora] [--steps 6]
        [--task products|basic_arithmetic] [--override KEY=VALUE ...] [--out bench_results/trl_comparison.json]

The job: SmolLM2-135M-Instruct, reasoning-gym one-digit products (the smollm2 preset's task, answers in
\\boxed{}; `--task basic_arithmetic` for the issue's, on which SmolLM2 earns no reward spread), GRPO with
8 prompts x 4 responses, 64 new tokens at T=1, lr 1e-5, fp32, one training process, 6 steps. logra_rl
runs `logra-train +experiment=smollm2` with the HF engine, fp32 rollout weights and no residual and
otherwise its defaults (threads, microbatches, cluster); TRL 1.16.0 runs with its defaults (gradient
checkpointing on) in its own throwaway environment, built here on first use (~/.cache/logra_rl/bench),
with the project's torch and transformers versions; scripts/bench/trl_grpo_job.py is its side. Both get prompts
of the same task built by logra_rl's data code.

Per run: the median seconds per step (the first step left out: it warms up), generation (TRL: completions
and rewards; logra_rl: `timing_s/rollout` + `timing_s/reward`) and train seconds (the rest of the step),
start-up (process start to the first step), and the machine's peak used memory (MemTotal - MemAvailable,
sampled every 0.2 s) above its idle level before the run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table

from logra_rl.config import RunConfig
from logra_rl.data import load_task
from logra_rl.models.loading import resolve_model_path
from logra_rl.utils.memory import run_measured

TRL_VERSION = "1.16.0"
TRL_VENV = Path.home() / ".cache" / "logra_rl" / "bench" / f"trl-{TRL_VERSION}"
JOB = [
    "+experiment=smollm2",
    "rollout.backend=hf",
    "cluster.train_workers=1",
    "rollout.dtype=float32",
    "sync.residual=none",
    "model.compute_dtype=float32",
    "rollout.temperature=1.0",
    "trainer.prompts_per_step=8",
    "rollout.n=4",
    "data.max_response_length=64",
    "eval.every=0",
    "trainer.checkpoint_every=0",
    "logger.progress=false",
    "logger.plot=false",
]
# The task: SmolLM2 scores 0 on nearly every group, so no step has a gradient (logra_rl skips them).
TASKS = {
    "products": [],
    "basic_arithmetic": ["data.reasoning_gym.datasets=[basic_arithmetic]", "~data.reasoning_gym.config"],
}
OPTIMIZERS = {"dense": ["optimizer=dense", "optimizer.lr=1e-5"], "logra": [], "lora": ["optimizer=lora"]}
LOGRA_PHASES = ("rollout", "reward", "train", "forward", "backward", "update", "probe", "sync", "step")


def trl_python() -> Path:
    """TRL's environment, built on first use with the project's torch and transformers."""
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        torch_version = torch.__version__.split("+")[0]
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={torch_version}"], check=True)  # first: the CPU build
        packages = [f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}", "peft", "psutil"]
        subprocess.run([*pip, *packages], check=True)
    return python


def job_config(job: list[str]) -> RunConfig:
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return RunConfig.from_mapping(compose("config", overrides=job))


def write_prompts(config: RunConfig, path: Path) -> None:
    examples = load_task(config.data).train
    path.write_text("".join(json.dumps({"prompt": list(e.messages), "answer": e.answer}) + "\n" for e in examples))


def run_trl(lora: bool, model: Path, prompts: Path, work: Path, steps: int) -> dict:
    out = work / f"trl_{'lora' if lora else 'dense'}.json"
    command = [str(trl_python()), str(Path(__file__).with_name("trl_grpo_job.py")), "--model", str(model)]
    command += ["--prompts", str(prompts), "--out", str(out), "--steps", str(steps)] + (["--lora"] if lora else [])
    measured = run_measured(command, out.with_suffix(".log"))
    job = json.loads(out.read_text())
    steps_s, generation = job["step_s"][1:], job["generation_s"][1:]
    return {
        "s_per_step": statistics.median(steps_s),
        "generation_s": statistics.median(generation),
        "train_s": statistics.median(s - g for s, g in zip(steps_s, generation, strict=True)),
        "startup_s": job["startup_s"],
        "memory_gib": measured.above_idle_gib,
        "process_peaks_gib": measured.peaks_by_label(),
        "wall_s": measured.wall_s,
        "reward_mean": job["reward_mean"],
        "gradient_checkpointing": job["gradient_checkpointing"],
    }


def run_logra(optimizer: str, job: list[str], work: Path) -> dict:
    run_dir = work / f"logra_{optimizer}"
    command = [str(Path(sys.executable).with_name("logra-train")), *job, *OPTIMIZERS[optimizer]]
    command += [f"trainer.output_dir={run_dir}"]
    measured = run_measured(command, work / f"logra_{optimizer}.log")
    records = [json.loads(line) for line in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
    later = records[1:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in later)

    phases = {phase: median(f"timing_s/{phase}") for phase in LOGRA_PHASES}
    generation = statistics.median(r["timing_s/rollout"] + r["timing_s/reward"] for r in later)
    return {
        "s_per_step": phases["step"],
        "generation_s": generation,
        "train_s": statistics.median(r["timing_s/step"] - r["timing_s/rollout"] - r["timing_s/reward"] for r in later),
        "startup_s": records[0]["timing_s/startup"],
        "startup_parts_s": {k: v for k, v in records[0].items() if k.startswith("timing_s/startup_")},
        "memory_gib": measured.above_idle_gib,
        "process_peaks_gib": measured.peaks_by_label(),
        "wall_s": measured.wall_s,
        "reward_mean": statistics.fmean(r["reward/mean"] for r in records),
        "skipped_updates": sum(r.get("train/skipped", 0.0) for r in records),
        "phases_s": phases,
        "train_peak_gib": max(r.get("memory/train_peak_gib", 0.0) for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="trl_dense,trl_lora,dense,logra,lora")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--override", action="append", default=[], help="a logra-train override for its runs")
    parser.add_argument("--task", choices=sorted(TASKS), default="products", help="reasoning-gym task (the preset's)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/trl_comparison.json"))
    args = parser.parse_args()
    job = [*JOB, *TASKS[args.task], f"trainer.total_steps={args.steps}", *args.override]
    config = job_config(job)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(resolve_model_path(config, work))
        prompts = work / "prompts.jsonl"
        write_prompts(config, prompts)
        for run in args.runs.split(","):
            print(f"[bench_trl] {run} ...", flush=True)
            if run.startswith("trl_"):
                results[run] = run_trl(run == "trl_lora", model, prompts, work, args.steps)
            else:
                results[run] = run_logra(run, job, work)
            print(f"[bench_trl] {run}: {json.dumps(results[run])}", flush=True)
    title = f"GRPO on SmolLM2-135M, {args.task}, 8 prompts x 4, 64 tokens, fp32, {args.steps} steps (2 cores)"
    table = Table(title=title)
    for column in ("run", "s/step (median)", "generation s", "train s", "start-up s", "memory above idle GiB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for run, r in results.items():
        cells = (r["s_per_step"], r["generation_s"], r["train_s"], r["startup_s"])
        table.add_row(run, *(f"{v:.1f}" for v in cells), f"{r['memory_gib']:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"logra_overrides": job, "task": args.task, "trl": TRL_VERSION, "torch": torch.__version__}
    args.out.write_text(json.dumps({"job": setup, "runs": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
