"""LoGRA against dense AdamW and LoRA on one preset and several seeds, measured the same way for all three.

    .venv-vllm/bin/python scripts/bench/bench_methods.py                          # smollm2, 20 steps, seeds 1-3
    .venv-vllm/bin/python scripts/bench/bench_methods.py --report-only            # tables and figure from finished runs
    .venv-vllm/bin/python scripts/bench/bench_methods.py --steps 10 --seeds 1 --out bench_results/lr_sweep \\
        --arm dense_lr2e-5="optimizer=dense optimizer.lr=2e-5" --arm dense_lr4e-5="optimizer=dense optimizer.lr=4e-5"

Each arm is a label and its `logra-train` overrides on top of `+experiment=<preset>` (`--arm LABEL="key=value
..."`, repeatable; an arm may name its own `+experiment=`). The default arms are the preset itself (LoGRA) and
its tuned baselines, the presets `<preset>_dense` and `<preset>_lora`. Runs go one at a time (two cores: runs
side by side would measure contention) into OUT/runs/<arm>/seed<k>/; a run that already logged its final eval
is not rerun, an unfinished or shorter one resumes from its last checkpoint (every 10 steps: a 10-step
learning-rate sweep run is the first half of that arm's 20-step run). Per arm, over the seeds (mean, sample
standard deviation, min, max):
- held-out pass@1 and pass@k at every eval, with the eval's sampling noise (`pass@1_stderr`: how far a second
  eval of the same weights could land) and each seed's gain over the last `--late-window` steps (20: levelled off
  or still rising);
- the KL each update moved the policy: `train/kl_realized`, the exact KL(π_before ‖ π_after) per generated
  token on the same guard rows for every rule (LoGRA measures it before its commit; dense and LoRA run the
  rows before and after the AdamW step), its median per step and its running sum (the cumulative KL at each
  eval counts the updates before it), and pass@1 at equal cumulative KL (each arm's mean curve, interpolated
  at the smallest final cumulative KL of all arms), and, with one point per step, the train reward (3-step
  mean) against cumulative KL, compared at the largest cumulative KL every run reached;
- train-worker memory (mean of the per-step average, and the peak), updates per hour (3600 / the median time of
  the steps 1..N-1 that committed an update: step 0 pays the start-up), the run's wall time.
Writes OUT/methods.json and OUT/methods.png (pass@1 vs step and vs cumulative KL, train reward vs cumulative
KL, KL per step).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from logra_rl.apps.bench_runs import finished, launch, run_dir, spread
from logra_rl.apps.plot import Run, load_run

KL = "train/kl_realized"
EVAL_KEYS = ("pass@1", "pass@k", "cumulative_kl")


def default_arms(preset: str) -> dict[str, str]:
    """The preset (LoGRA) and its tuned baselines, the presets `<preset>_dense` and `<preset>_lora`."""
    return {"logra": "", "dense": f"+experiment={preset}_dense", "lora": f"+experiment={preset}_lora"}


def cumulative_kl(run: Run) -> dict[int, float]:
    """Σ realised KL of the updates before each step (a skipped update moved nothing: 0). With PPO epochs a
    step logs the mean over its updates: counted `algorithm.epochs` times."""
    epochs = int(run.config.get("algorithm", {}).get("epochs", 1))
    per_step = {r["step"]: epochs * float(r[KL]) for r in run.records if r.get(KL) is not None}
    total, at = 0.0, {}
    for step in range(max(r["step"] for r in run.records) + 1):
        at[step] = total
        total += per_step.get(step, 0.0)
    return at


def run_summary(run: Run, steps: int) -> dict[str, Any]:
    """One run's evals, KL and costs of its first `steps` updates (a longer run is cut there: of its record at
    `steps`, only the eval)."""
    records = [r for r in run.records if r["step"] < steps]
    records += [
        {k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in run.records if r["step"] == steps
    ]
    run = Run(path=run.path, config=run.config, records=records)
    cumulative = cumulative_kl(run)
    evals = {
        r["step"]: {
            "pass@1": r[run.pass1_key],
            "pass@k": r.get(run.passk_key),
            "cumulative_kl": cumulative[r["step"]],
            "pass@1_stderr": r.get(f"{run.pass1_key}_stderr"),  # the eval's own sampling noise
        }
        for r in run.records
        if run.pass1_key and r.get(run.pass1_key) is not None
    }
    # steps that committed an update (at a task's ceiling every advantage is 0 and a step skips its update in
    # a fraction of the time: `perf/updates_per_hour` of such steps counts updates that did not happen)
    trained = [r["timing_s/step"] for r in run.records[1:] if r.get("timing_s/step") and r.get("train/skipped") == 0]
    wall = run.path / "bench_wall_s.json"
    return {
        "evals": evals,
        "kl_per_step": dict(zip(*run.series(KL), strict=True)),  # step -> realised KL of its update
        "train_memory_avg_gib": statistics.fmean(run.values("memory/train_avg_gib") or [float("nan")]),
        "train_memory_peak_gib": max(run.values("memory/train_peak_gib") or [float("nan")]),
        "updates_per_hour": 3600 / statistics.median(trained) if trained else float("nan"),
        "wall_s": json.loads(wall.read_text())["wall_s"] if wall.is_file() else None,
        "skipped_updates": sum(run.values("train/skipped")),
        "reward_by_kl": reward_by_kl(run, cumulative),
    }


def reward_by_kl(run: Run, cumulative: dict[int, float]) -> list[tuple[float, float]]:
    """(cumulative KL before the step, train reward of the step averaged over it and its two neighbours), one
    point per step: the step-by-step view of learning against KL that evals every few steps cannot give."""
    steps, rewards = run.series("reward/mean")
    smooth = [statistics.fmean(rewards[max(i - 1, 0) : i + 2]) for i in range(len(rewards))]
    return [(cumulative[step], value) for step, value in zip(steps, smooth, strict=True)]


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """y at x on the piecewise-linear curve through (xs, ys), xs increasing."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def arm_summary(runs: dict[int, dict[str, Any]], late_window: int) -> dict[str, Any]:
    """Mean and spread over seeds, at each eval step every seed logged; each seed's pass@1 gain from the last eval
    at least `late_window` steps before the end to the end (an arm gaining less than its eval noise has levelled
    off)."""
    steps = sorted(set.intersection(*(set(r["evals"]) for r in runs.values())))
    evals = {
        step: {key: spread([r["evals"][step][key] for r in runs.values()]) for key in EVAL_KEYS}
        for step in steps
        if all(r["evals"][step]["pass@k"] is not None for r in runs.values())
    }
    for step, summary in evals.items():
        noise = [r["evals"][step]["pass@1_stderr"] for r in runs.values()]
        summary["pass@1_stderr"] = statistics.fmean(noise) if None not in noise else None
    kl = [v for r in runs.values() for v in r["kl_per_step"].values()]
    walls = [r["wall_s"] for r in runs.values() if r["wall_s"] is not None]
    last = max(steps, default=0)
    before = [step for step in steps if step <= last - late_window]
    return {
        "seeds": sorted(runs),
        "evals": evals,
        "late_window": late_window,
        "late_gain": spread([r["evals"][last]["pass@1"] - r["evals"][before[-1]]["pass@1"] for r in runs.values()])
        if before
        else None,
        "kl_per_step_median": statistics.median(kl) if kl else None,
        "train_memory_avg_gib": spread([r["train_memory_avg_gib"] for r in runs.values()]),
        "train_memory_peak_gib": spread([r["train_memory_peak_gib"] for r in runs.values()]),
        "updates_per_hour": spread([r["updates_per_hour"] for r in runs.values()]),
        "wall_s": spread(walls) if walls else None,
        "skipped_updates": sum(r["skipped_updates"] for r in runs.values()),
        "runs": runs,
    }


def reward_at_kl(arms: dict[str, dict[str, Any]]) -> tuple[float, dict[str, dict[str, float]]]:
    """Train reward of each arm (mean and spread over its seeds) at the largest cumulative KL every run reached:
    each run's reward-vs-KL curve interpolated there (a curve is cut where its KL stops growing)."""
    curves = {arm: [run["reward_by_kl"] for run in s["runs"].values()] for arm, s in arms.items()}
    reached = [max(x for x, _ in curve) for runs in curves.values() for curve in runs if curve]
    if not reached or min(reached) <= 0:
        return float("nan"), {}
    common = min(reached)
    at = {}
    for arm, runs in curves.items():
        values = []
        for curve in runs:
            xs, ys = [], []
            for x, y in curve:  # keep the first point at each KL: steps that moved nothing add none
                if not xs or x > xs[-1]:
                    xs.append(x)
                    ys.append(y)
            values.append(interpolate(xs, ys, common))
        at[arm] = spread(values)
    return common, at


def equal_kl(arms: dict[str, dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """pass@1 of each arm's mean curve at the smallest final cumulative KL of the arms that measured KL."""
    curves = {}
    for arm, summary in arms.items():
        if summary["kl_per_step_median"] is None:
            print(f"[bench_methods] {arm} logged no train/kl_realized (optimizer.measure_kl=false?): no KL comparison")
            continue
        points = sorted((e["cumulative_kl"]["mean"], e["pass@1"]["mean"]) for e in summary["evals"].values())
        curves[arm] = ([x for x, _ in points], [y for _, y in points])
    if not curves:
        return float("nan"), {}
    common = min(xs[-1] for xs, _ in curves.values())
    return common, {arm: interpolate(xs, ys, common) for arm, (xs, ys) in curves.items()}


def fmt(s: dict[str, float] | None, spec: str = ".3f") -> str:
    if not s:
        return "—"
    return f"{s['mean']:{spec}} ± {s['std']:{spec}}" if s["n"] > 1 else f"{s['mean']:{spec}}"


def print_table(
    arms: dict[str, dict[str, Any]], at_kl: tuple[float, dict[str, float]], reward_kl: tuple[float, dict]
) -> None:
    steps = sorted({step for summary in arms.values() for step in summary["evals"]})
    table = Table(title="held-out pass@1 (mean ± std over seeds) and what each step cost")
    for column in (
        "arm",
        "seeds",
        *(f"pass@1 @{s}" for s in steps),
        "pass@k last",
        "cum. KL last",
        "KL/step (median)",
        "eval noise (SE)",
        "gain, last steps",
        f"pass@1 @ KL {at_kl[0]:.2g}",
        f"train reward @ KL {reward_kl[0]:.2g}",
        "train GiB avg / peak",
        "updates/h",
        "wall/run",
    ):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for arm, s in arms.items():
        last = s["evals"][max(s["evals"])]
        wall = s["wall_s"]
        table.add_row(
            arm,
            ",".join(map(str, s["seeds"])),
            *(fmt(s["evals"][step]["pass@1"]) if step in s["evals"] else "—" for step in steps),
            fmt(last["pass@k"]),
            fmt(last["cumulative_kl"], ".2g"),
            f"{s['kl_per_step_median']:.2g}" if s["kl_per_step_median"] is not None else "—",
            f"{last['pass@1_stderr']:.3f}" if last["pass@1_stderr"] is not None else "—",
            f"{fmt(s['late_gain'])} ({s['late_window']})" if s["late_gain"] else "—",
            f"{at_kl[1][arm]:.3f}" if arm in at_kl[1] else "—",
            fmt(reward_kl[1].get(arm)),
            f"{s['train_memory_avg_gib']['mean']:.1f} / {s['train_memory_peak_gib']['mean']:.1f}",
            f"{s['updates_per_hour']['mean']:.0f}",
            f"{wall['mean'] / 60:.1f} min" if wall else "—",
        )
    Console(width=240).print(table)


def plot(arms: dict[str, dict[str, Any]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ((by_step, by_kl), (reward, per_step)) = plt.subplots(2, 2, figsize=(13, 9))
    for arm, s in arms.items():
        steps = sorted(s["evals"])
        mean = [s["evals"][t]["pass@1"]["mean"] for t in steps]
        low = [s["evals"][t]["pass@1"]["min"] for t in steps]
        high = [s["evals"][t]["pass@1"]["max"] for t in steps]
        (line,) = by_step.plot(steps, mean, marker="o", label=f"{arm} ({len(s['seeds'])} seeds)")
        by_step.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
        kl = [s["evals"][t]["cumulative_kl"]["mean"] for t in steps]
        by_kl.errorbar(
            kl,
            mean,
            yerr=[
                [m - lo for m, lo in zip(mean, low, strict=True)],
                [hi - m for m, hi in zip(mean, high, strict=True)],
            ],
            marker="o",
            color=line.get_color(),
            capsize=3,
            label=arm,
        )
        for seed, run in s["runs"].items():
            reward.plot(
                *zip(*run["reward_by_kl"], strict=True),
                color=line.get_color(),
                alpha=0.7,
                lw=1,
                label=arm if seed == s["seeds"][0] else None,
            )
            per_step.plot(
                list(run["kl_per_step"]),
                list(run["kl_per_step"].values()),
                color=line.get_color(),
                alpha=0.6,
                lw=1,
                label=arm if seed == s["seeds"][0] else None,
            )
    by_step.set(xlabel="step (updates)", ylabel="held-out pass@1", title="pass@1 vs step (band: min-max over seeds)")
    by_kl.set(
        xlabel="cumulative realised KL per token (Σ over updates)",
        ylabel="held-out pass@1",
        title="pass@1 vs cumulative KL",
    )
    by_kl.set_xscale("symlog", linthresh=1e-3)
    reward.set(
        xlabel="cumulative realised KL per token before the step",
        ylabel="train reward (3-step mean)",
        title="train reward vs cumulative KL (one line per seed)",
    )
    reward.set_xscale("symlog", linthresh=1e-3)
    per_step.set(xlabel="step", ylabel="realised KL per token", yscale="log", title="KL each update moved the policy")
    for axis in (by_step, by_kl, reward, per_step):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def parse_arms(values: list[str], preset: str) -> dict[str, str]:
    if not values:
        return default_arms(preset)
    arms = {}
    for value in values:
        label, sep, overrides = value.partition("=")
        if not sep or not label:
            raise SystemExit(
                f'--arm {value!r}: write LABEL="key=value ...", e.g. dense="optimizer=dense optimizer.lr=1e-5"'
            )
        arms[label] = overrides
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2", help="the +experiment= preset")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--arm", action="append", default=[], help='LABEL="overrides" (repeatable)')
    parser.add_argument("--out", type=Path, default=Path("bench_results/methods"))
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="a run checkpointed at step 10 extends to 20 without redoing it",
    )
    parser.add_argument("--late-window", type=int, default=20, help="steps over which the late gain is measured")
    parser.add_argument("--report-only", action="store_true", help="only summarise the finished runs under OUT")
    args = parser.parse_args()
    arms = parse_arms(args.arm, args.preset)
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        for arm, overrides in arms.items():
            for seed in seeds:
                if not finished(run_dir(args.out, arm, seed), args.steps):
                    launch(args.preset, overrides, args.steps, seed, args.out, arm, args.checkpoint_every)
    summaries = {}
    for arm in arms:
        runs = {
            seed: run_summary(load_run(run_dir(args.out, arm, seed)), args.steps)
            for seed in seeds
            if finished(run_dir(args.out, arm, seed), args.steps)
        }
        summary = arm_summary(runs, args.late_window) if runs else None
        if summary and summary["evals"]:
            summaries[arm] = summary
        elif runs:
            print(f"[bench_methods] {arm}: no eval step logged by every seed with pass@1 and pass@k; left out")
    if not summaries:
        raise SystemExit(f"no finished runs under {args.out / 'runs'}; run without --report-only first")
    at_kl, reward_kl = equal_kl(summaries), reward_at_kl(summaries)
    print_table(summaries, at_kl, reward_kl)
    setup = {"preset": args.preset, "steps": args.steps, "seeds": seeds, "arms": arms}
    result = {
        "setup": setup,
        "pass@1_at_equal_kl": {"kl": at_kl[0], **at_kl[1]},
        "train_reward_at_equal_kl": {"kl": reward_kl[0], **reward_kl[1]},
        "arms": summaries,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "methods.json").write_text(json.dumps(result, indent=2))
    plot(summaries, args.out / "methods.png")
    print(f"wrote {args.out / 'methods.json'} and {args.out / 'methods.png'}")


if __name__ == "__main__":
    main()
