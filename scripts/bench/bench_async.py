"""The synchronous loop against generation and training at the same time (`algorithm.max_staleness=1`), on one
preset and several seeds, each pair on the same cores.

    .venv/bin/python scripts/bench/bench_async.py                                   # quickstart, pinned, seeds 1-3
    .venv-vllm/bin/python scripts/bench/bench_async.py --preset smollm2 --steps 20 --seeds 1
    .venv/bin/python scripts/bench/bench_async.py --shared --steps 60 --out bench_results/async_shared
    .venv/bin/python scripts/bench/bench_async.py --report-only                     # tables from finished runs

`--pinned` (the default) runs both loops with `cluster.pin_cores=true`: each group on its own cores for the whole
run, as on GPUs; `--shared` keeps the CPU default (both groups' threads on every core). Runs go one at a time
(side by side they would measure contention) into OUT/runs/<arm>/seed<k>/ (`logra_rl.apps.bench_runs`; a
finished run is not rerun). Per run and per seed pair:
- updates per hour: 3600 × committed updates / the wall seconds of steps 1..N−1 (step 0 pays the start-up);
  the asynchronous over the synchronous run of the same seed;
- the last 10 steps' mean train reward, and its difference from the synchronous run's;
- the behaviour KL (max, mean) against the staleness bound each batch was read against (`async/staleness_bound`),
  batches generated again past it, staleness;
- each phase's mean seconds, the groups' busy fractions, held-out pass@1 at each eval;
- the gain model: from the synchronous run's phase times, the expected ratio
  (generation + train + rest) / (max(generation, train) + rest), beside the measured one.
Writes OUT/async.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from logra_rl.apps.bench_runs import finished, launch, run_dir, spread
from logra_rl.apps.plot import Run, load_run

PINNED = "cluster.pin_cores=true cluster.device=cpu"
LAST = 10  # steps the reward comparison averages
BOUND = "async/staleness_bound"


def arms(pinned: bool) -> dict[str, str]:
    cores = PINNED if pinned else ""
    return {"sync": f"{cores} algorithm.max_staleness=0", "async": f"{cores} algorithm.max_staleness=1"}


def mean(records: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def run_summary(run: Run, steps: int) -> dict[str, Any]:
    records = [r for r in run.records if "timing_s/step" in r and r["step"] < steps]
    timed = records[1:]  # step 0 pays the start-up
    updates = sum(1 - float(r.get("train/skipped", 0.0)) for r in timed)
    phases = {
        phase: mean(timed, f"timing_s/{phase}")
        for phase in ("step", "rollout", "reward", "train", "rollout_wait", "sync")
    }
    phases["rest"] = phases["step"] - sum(phases[p] for p in ("rollout", "train", "rollout_wait", "sync"))
    # the engines' own generation seconds (timing_s/rollout is the driver's wait, ~0 one step off)
    phases["generation"] = statistics.fmean(float(r["perf/rollout_busy"]) * float(r["timing_s/step"]) for r in timed)
    behaviour = [float(r["async/behaviour_kl"]) for r in records if r.get("async/behaviour_kl") is not None]
    # each stale batch against the bound it was read against (the default follows the budget and the numerics)
    bounded = [(float(r["async/behaviour_kl"]), float(r["async/staleness_bound"])) for r in records if r.get(BOUND)]
    evals = {r["step"]: r[run.pass1_key] for r in run.records if run.pass1_key and r.get(run.pass1_key) is not None}
    return {
        "updates_per_hour": 3600 * updates / sum(float(r["timing_s/step"]) for r in timed),
        "reward_last": statistics.fmean(float(r["reward/mean"]) for r in records[-LAST:]),
        "behaviour_kl_max": max(behaviour, default=float("nan")),
        "behaviour_kl_mean": statistics.fmean(behaviour) if behaviour else float("nan"),
        "staleness_bound_min": min((bound for _, bound in bounded), default=float("nan")),
        "within_bound": all(kl <= bound for kl, bound in bounded),
        "sampled_again": sum(float(r.get("async/refused", 0.0)) for r in records),
        "staleness_mean": mean(records, "async/staleness"),
        "train_busy": mean(timed, "perf/train_busy"),
        "rollout_busy": mean(timed, "perf/rollout_busy"),
        "kl_budget_mean": mean(records, "logra/kl_budget"),
        "phases_s": phases,
        "pass@1": evals,
    }


def expected_ratio(phases: dict[str, float]) -> float:
    """The gain model on a synchronous run's phase times: the overlapped step takes the longer of generation and
    training plus what stays serial (grading, the weight sync, the driver's own work)."""
    generation, train = phases["rollout"], phases["train"]
    serial = phases["step"] - generation - train
    return phases["step"] / (max(generation, train) + serial)


def print_table(runs: dict[str, dict[int, dict[str, Any]]], pairs: dict[int, dict[str, float]]) -> None:
    table = Table(title="synchronous vs one step off (algorithm.max_staleness=1)")
    for column in (
        "arm",
        "seed",
        "updates/h",
        "ratio",
        "model",
        f"reward last {LAST}",
        "Δ reward",
        "behaviour KL max / least bound",
        "again",
        "gen s",
        "train s",
        "step s",
        "busy train / rollout",
        "pass@1 (last eval)",
    ):
        table.add_column(column)
    for arm, by_seed in runs.items():
        for seed, s in sorted(by_seed.items()):
            pair = pairs.get(seed, {})
            last_eval = s["pass@1"][max(s["pass@1"])] if s["pass@1"] else float("nan")
            table.add_row(
                arm,
                str(seed),
                f"{s['updates_per_hour']:.0f}",
                f"{pair['ratio']:.2f}" if arm == "async" and pair else "",
                f"{pair['expected_ratio']:.2f}" if arm == "async" and pair else "",
                f"{s['reward_last']:.3f}",
                f"{pair['reward_difference']:+.3f}" if arm == "async" and pair else "",
                f"{s['behaviour_kl_max']:.3g} / {s['staleness_bound_min']:.3g}",
                f"{s['sampled_again']:.0f}",
                f"{s['phases_s']['generation']:.3f}",
                f"{s['phases_s']['train']:.3f}",
                f"{s['phases_s']['step']:.3f}",
                f"{s['train_busy']:.2f} / {s['rollout_busy']:.2f}",
                f"{last_eval:.3f}",
            )
    Console(width=240).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quickstart", help="the +experiment= preset")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="1,2,3")
    cores = parser.add_mutually_exclusive_group()
    cores.add_argument("--pinned", dest="pinned", action="store_true", default=True, help="cluster.pin_cores=true")
    cores.add_argument("--shared", dest="pinned", action="store_false", help="the CPU default: cores shared")
    parser.add_argument("--eval-every", type=int, default=None, help="eval.every (default: the preset's)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/async"))
    parser.add_argument("--report-only", action="store_true", help="only summarise the finished runs under OUT")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = arms(args.pinned)
    if args.eval_every is not None:
        chosen = {arm: f"{overrides} eval.every={args.eval_every}" for arm, overrides in chosen.items()}
    if not args.report_only:
        for seed in seeds:  # the pair of a seed back to back: the machine's state drifts less between them
            for arm, overrides in chosen.items():
                if not finished(run_dir(args.out, arm, seed), args.steps - 1):
                    launch(args.preset, overrides, args.steps, seed, args.out, arm, checkpoint_every=0)
    runs = {
        arm: {
            seed: run_summary(load_run(run_dir(args.out, arm, seed)), args.steps)
            for seed in seeds
            if finished(run_dir(args.out, arm, seed), args.steps - 1)
        }
        for arm in chosen
    }
    pairs = {
        seed: {
            "ratio": runs["async"][seed]["updates_per_hour"] / runs["sync"][seed]["updates_per_hour"],
            "expected_ratio": expected_ratio(runs["sync"][seed]["phases_s"]),
            "reward_difference": runs["async"][seed]["reward_last"] - runs["sync"][seed]["reward_last"],
        }
        for seed in seeds
        if seed in runs["sync"] and seed in runs["async"]
    }
    if not pairs:
        raise SystemExit(f"no finished pair of runs under {args.out / 'runs'}; run without --report-only first")
    print_table(runs, pairs)
    summary = {
        key: spread([p[key] for p in pairs.values()]) for key in ("ratio", "expected_ratio", "reward_difference")
    }
    setup = {"preset": args.preset, "steps": args.steps, "seeds": seeds, "pinned": args.pinned, "arms": chosen}
    result = {"setup": setup, "summary": summary, "pairs": pairs, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'async.json'}")


if __name__ == "__main__":
    main()
