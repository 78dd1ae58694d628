#!/usr/bin/env python
"""The KL probe's and guard's memory at long rows, measured against the memory plan's part for them.

    .venv/bin/python scripts/bench/bench_probe_memory.py [--tokens 4096] [--out bench_results/probe_memory.json]

A narrow model with many heads (Qwen3: hidden 256, 32 query heads of 32 dimensions, 8 KV heads, 4 layers, vocab
8,192, fp32 on the CPU) prepares one LoGRA update (rank 32) from a backward over its rows; then each measurement
runs in a fresh process, its peak private memory (VmHWM, reset once the update is prepared) above the memory at
that point:

- jvp: the proposal, `LoGRAOptimizer.probe_kl` with the JVP on `probe_responses` (2) rows of --tokens tokens, one
  row at a time, attention in blocks of `ATTENTION_BLOCK` scores;
- guard: the guard on one step (`LoGRAOptimizer.guarded_step`, every try it takes) on `guard_responses` (8) rows:
  the unstepped forward, the stepped forwards inside `trial`, the KL of every row against the unstepped side's
  log-probs it keeps for the later tries (`KLReference`);
- jvp_math_kernel: the JVP as it ran before (SDPA's math kernel: all scores of a layer at once), at --math-tokens
  (its rows × heads × tokens² fp32 scores do not fit this machine at 4,096), for comparison.

The plan's part is `LoGRAUpdate.memory(...)`'s "KL probe and guard" for the same model, rows and length (the JVP's
figure for jvp, the guard's for guard: the part is their larger). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen3Config, Qwen3ForCausalLM

import logra_rl.logra.kl as kl
from logra_rl.apps.bench_runs import child_result, print_child_result
from logra_rl.config import RunConfig
from logra_rl.logra import KLConfig, KLRows, LoGRAConfig, LoGRAOptimizer
from logra_rl.models.footprint import model_footprint
from logra_rl.train.optimizers import LoGRAUpdate
from logra_rl.utils.memory import GIB, peak_rss_since_reset, reset_peak_rss
from logra_rl.utils.timing import timed

MEASUREMENTS = ("jvp", "guard", "jvp_math_kernel")
PROBE_ROWS, GUARD_ROWS, RANK = 2, 8, 32
GUARD_BUDGET = 1e-3  # KL per token the guarded step is held to (the proposal starts at α = 1: a few tries)
SHAPE = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def logra_config(estimator: str, tokens: int) -> LoGRAConfig:
    kl_config = KLConfig(
        estimator=estimator, probe_responses=PROBE_ROWS, guard_responses=GUARD_ROWS, probe_max_tokens=tokens
    )
    return LoGRAConfig(rank=RANK, update_ratio=1e-3, kl=kl_config)


def planned(tokens: int) -> dict[str, float]:
    """The plan's probe part with the JVP proposal and with no proposal (the guard alone), one train rank."""
    with tempfile.TemporaryDirectory() as directory:
        Qwen3Config(**SHAPE).save_pretrained(directory)
        footprint = model_footprint(directory, LoGRAConfig().target_modules, "float32")
    parts = {}
    for name, estimator in (("jvp", "jvp"), ("guard", "previous")):
        config = RunConfig.from_mapping(
            {
                "logra": dataclasses.asdict(logra_config(estimator, tokens)),
                "trainer": {"prompts_per_step": GUARD_ROWS},
                "cluster": {"train_workers": 1},
                "data": {"max_response_length": tokens},
            }
        )
        (part,) = LoGRAUpdate.memory(config, footprint, tokens, cuda=False).probe
        parts[name] = part.nbytes
    return parts


def run(measurement: str, tokens: int) -> dict:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE)).float().eval()
    rows = PROBE_ROWS if measurement.startswith("jvp") else GUARD_ROWS
    ids = torch.randint(0, SHAPE["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    mask[:, tokens // 4 :] = 1  # a quarter prompt, three quarters response
    opt = LoGRAOptimizer(model, logra_config("previous" if measurement == "guard" else "jvp", tokens))
    model.train()
    for row in ids[:1, :256]:  # a short backward: the update only has to exist
        logits = model(input_ids=row[None]).logits
        logits[0, :-1].log_softmax(-1).gather(-1, row[1:, None]).sum().backward()
    opt.prepare(num_tokens=255)
    model.eval()
    hidden = KLRows(lambda x: model.model(input_ids=x).last_hidden_state, ids, mask, model.lm_head)
    baseline = reset_peak_rss()
    if measurement == "guard":
        step, seconds = timed(lambda: opt.guarded_step(hidden, 1.0, GUARD_BUDGET))
        result, extra = step.kl, {"tries": step.tries}
    else:
        math_kernel = measurement == "jvp_math_kernel"
        if math_kernel:  # the JVP as it was: attention through SDPA's math kernel, all of a layer's scores at once
            kl.ChunkedAttention = contextlib.nullcontext
        with sdpa_kernel([SDPBackend.MATH]) if math_kernel else contextlib.nullcontext():
            result, seconds = timed(lambda: opt.probe_kl(hidden, 1.0))
        extra = {}
    assert result > 0
    return {
        "measurement": measurement,
        "rows": rows,
        "tokens": tokens,
        "peak_gib": (peak_rss_since_reset() - baseline) / GIB,
        "seconds": seconds,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--math-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("bench_results/probe_memory.json"))
    parser.add_argument("--child", choices=MEASUREMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tokens = args.math_tokens if args.child == "jvp_math_kernel" else args.tokens
        print_child_result(run(args.child, tokens))
        return
    plans = {args.tokens: planned(args.tokens), args.math_tokens: planned(args.math_tokens)}
    results = []
    for measurement in MEASUREMENTS:
        command = [sys.executable, __file__, "--child", measurement, "--tokens", str(args.tokens)]
        command += ["--math-tokens", str(args.math_tokens)]
        result = child_result(command, measurement)
        result["plan_gib"] = plans[result["tokens"]]["guard" if measurement == "guard" else "jvp"] / GIB
        results.append(result)
        print(result, flush=True)
    table = Table(title=f"KL probe memory: hidden 256, 32 heads, 4 layers, vocab 8,192, fp32 (rank {RANK})")
    for column in ("measurement", "rows × tokens", "measured peak (GiB)", "plan (GiB)", "measured / plan", "s"):
        table.add_column(column, justify="left" if column == "measurement" else "right")
    for r in results:
        ratio = r["peak_gib"] / r["plan_gib"]
        table.add_row(
            r["measurement"],
            f"{r['rows']} × {r['tokens']}",
            f"{r['peak_gib']:.2f}",
            f"{r['plan_gib']:.2f}",
            f"{ratio:.2f}",
            f"{r['seconds']:.1f}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": SHAPE, "rank": RANK, "runs": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
