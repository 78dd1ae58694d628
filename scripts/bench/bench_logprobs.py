#!/usr/bin/env python
"""Peak host memory of sampled-token log-probs and of the KL probe, with full logits and through the LM head
in chunks, at a real vocabulary (issue 14).

    .venv/bin/python scripts/bench/bench_logprobs.py [--tokens 4096] [--layers 2] [--out bench_results/logprobs.json]

The model is Qwen2.5-1.5B's shape (vocab 151,936, hidden 1536, tied embeddings) cut to `--layers` decoder
layers, fp32, random weights: the logits and their gradients are what the comparison is about, and they depend
on the vocabulary and the token count only. Each variant runs once in a fresh subprocess, so its peak RSS is its
own; "above model" is that peak (VmHWM, reset once the model is built) minus the RSS at that point.

- train, full logits: `model(ids).logits` → `rl.token_logprobs` → sum → backward (the path before chunking);
- train, chunked head: decoder hidden states → `rl.head_logprobs` → sum → backward (the train worker's path);
- probe, full logits / chunked head: `logra.jvp_kl` of a rank-64 step on every attention and MLP projection
  (one row at a time), forward returning the logits, or the hidden states with the LM head applied 64 positions
  at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from logra_rl.apps.bench_runs import child_result, print_child_result
from logra_rl.logra import KLRows, jvp_kl
from logra_rl.models.shapes import QWEN25_1P5B
from logra_rl.rl import head_logprobs, token_logprobs
from logra_rl.utils.memory import GIB, peak_rss_since_reset, reset_peak_rss
from logra_rl.utils.timing import timed

VARIANTS = ("train_full", "train_chunked", "probe_full", "probe_chunked")
ROWS = 4


def model_of(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = replace(QWEN25_1P5B, layers=layers)
    return shape.model_class()(shape.hf_config()).float().eval()


def low_rank_step(model: torch.nn.Module, rank: int = 64) -> list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    step = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in leaves:
            d_out, k_in = module.weight.shape
            step.append((module, torch.randn(rank, k_in) / k_in**0.5, torch.randn(d_out, rank) * 1e-4))
    return step


def run_variant(variant: str, tokens: int, layers: int) -> dict:
    torch.set_grad_enabled(variant.startswith("train"))
    model = model_of(layers)
    ids = torch.randint(0, model.config.vocab_size, (ROWS, tokens // ROWS), generator=torch.Generator().manual_seed(1))
    baseline = reset_peak_rss()  # the model's construction is not in the peak
    _, seconds = timed(lambda: run_once(variant, model, ids))
    return {"variant": variant, "peak_above_model_gib": (peak_rss_since_reset() - baseline) / GIB, "seconds": seconds}


def run_once(variant: str, model: torch.nn.Module, ids: torch.Tensor) -> None:
    if variant == "train_full":
        token_logprobs(model(input_ids=ids).logits, ids, 1.0).sum().backward()
    elif variant == "train_chunked":
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        values, _ = head_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), model.lm_head, ids[:, 1:].reshape(-1), 1.0, model.config.vocab_size
        )
        values.sum().backward()
    else:
        mask = torch.ones_like(ids)
        if variant == "probe_full":
            total, _ = jvp_kl(KLRows(lambda x: model(input_ids=x).logits, ids, mask), low_rank_step(model), 1.0)
        else:
            hidden = lambda x: model.model(input_ids=x).last_hidden_state  # noqa: E731
            total, _ = jvp_kl(KLRows(hidden, ids, mask, model.lm_head), low_rank_step(model), 1.0)
        assert torch.isfinite(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench_results/logprobs.json"))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print_child_result(run_variant(args.child, args.tokens, args.layers))
        return
    results = []
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens)]
        results.append(child_result([*command, "--layers", str(args.layers)], variant))
        print(results[-1], flush=True)
    logits_gib = args.tokens * 151936 * 4 / GIB
    shape = f"{args.layers} layers of Qwen2.5-1.5B's shape, fp32"
    table = Table(title=f"vocab 151,936, {args.tokens} tokens ({ROWS} rows), {shape}")
    for column in ("variant", "peak above the model (GiB)", "seconds"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for r in results:
        table.add_row(r["variant"], f"{r['peak_above_model_gib']:.2f}", f"{r['seconds']:.1f}")
    Console().print(table)
    print(f"one fp32 copy of the full logits: {logits_gib:.2f} GiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens": args.tokens, "layers": args.layers, "runs": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
