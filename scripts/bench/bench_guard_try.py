#!/usr/bin/env python
"""What one try of the KL guard costs on SmolLM2-135M-Instruct, and what would make it cheaper.

    .venv/bin/python scripts/bench/bench_guard_try.py [--prompt 55] [--lengths 12x6,14x4,20x3,30,40,64] [--out FILE]

One try (`LoGRAOptimizer._measure`) is a forward of the guard's rows with the step merged (`trial`); on the
`smollm2` presets that is 16 rows, right-padded to the longest. The rows here are a prompt of --prompt tokens (the
presets' chat prompts are ~50-60) and responses of --lengths tokens (`12x6`: six of 12; the default is what
`smollm2_arithmetic` generates from step 20 on: mostly 11-20 tokens, one cut at the 64-token limit). Each
variant's forward, without gradients, fp32, median of --repeats:

- padded: the rows as the guard runs them, one forward;
- padded, in trial: the same inside `trial` (each FSDP2 unit's targets merged on entry and restored on exit);
- length chunks / in trial: the rows sorted by length, one forward per chunk of similar length (less padding);
- packed: the rows without their padding, end to end in one sequence whose position ids restart at each row
  (transformers then masks attention within each row): no padding, but a dense attention mask over all tokens;
- prompt once: the forward of one prompt, the part of each row that 4 responses to a prompt share; in trial, what
  is left is the merge and restore of the step that `trial` does around every forward.

The packed forward's hidden states at the rows' own positions must equal the padded forward's (checked, fp32): a
packing that transformers did not mask apart would time the wrong computation.

The update is a real LoGRA step (rank 64, from a backward over two rows). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from logra_rl.logra import LoGRAConfig, LoGRAOptimizer
from logra_rl.models.smollm2 import fetch_smollm2
from logra_rl.utils.timing import timed


def lengths_of(spec: str) -> list[int]:
    """`12x6,30` -> six 12s and a 30."""
    out = []
    for part in spec.split(","):
        length, _, count = part.partition("x")
        out += [int(length)] * int(count or 1)
    return out


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    return statistics.median(timed(run)[1] for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=55)
    parser.add_argument("--lengths", default="12x6,14x4,20x3,30,40,64")
    parser.add_argument("--chunks", type=int, default=3, help="length chunks for the chunked variants")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/guard_try.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(fetch_smollm2(), dtype=torch.float32)
    lengths, prompt = sorted(lengths_of(args.lengths)), args.prompt
    width = prompt + max(lengths)
    ids = torch.randint(100, 40_000, (len(lengths), width))
    for row, length in enumerate(lengths):
        ids[row, prompt + length :] = 0

    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64, update_ratio=3e-4))
    model.train()
    logits = model(input_ids=ids[:2, : prompt + 20]).logits
    logits[:, :-1].log_softmax(-1).gather(-1, ids[:2, 1 : prompt + 20, None]).sum().backward()
    opt.prepare(num_tokens=40)
    model.eval()

    def forward(rows: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return model.model(input_ids=rows, position_ids=positions, use_cache=False).last_hidden_state

    real = [prompt + length for length in lengths]
    packed_ids = torch.cat([ids[row, :length] for row, length in enumerate(real)])[None]
    packed_positions = torch.cat([torch.arange(length) for length in real])[None]

    per_chunk = -(-len(lengths) // args.chunks)
    chunks = [range(start, min(start + per_chunk, len(lengths))) for start in range(0, len(lengths), per_chunk)]

    def chunked() -> None:
        for chunk in chunks:
            forward(ids[list(chunk), : prompt + lengths[chunk[-1]]])

    def in_trial(run: Callable[[], object]) -> Callable[[], None]:
        def tried() -> None:
            with opt.trial(1.0):
                run()

        return tried

    chunked_tokens = sum(len(chunk) * (prompt + lengths[chunk[-1]]) for chunk in chunks)
    variants = {
        "padded": (lambda: forward(ids), len(lengths) * width),
        "padded, in trial": (in_trial(lambda: forward(ids)), len(lengths) * width),
        f"{len(chunks)} length chunks": (chunked, chunked_tokens),
        f"{len(chunks)} length chunks, in trial": (in_trial(chunked), chunked_tokens),
        "packed": (lambda: forward(packed_ids, packed_positions), sum(real)),
        "prompt once": (lambda: forward(ids[:1, :prompt]), prompt),
        "prompt once, in trial": (in_trial(lambda: forward(ids[:1, :prompt])), prompt),
    }
    results = {}
    with torch.no_grad():
        padded, packed = forward(ids), forward(packed_ids, packed_positions)[0].split(real)
        worst = max((padded[row, :length] - packed[row]).abs().max().item() for row, length in enumerate(real))
        if worst > 1e-3:
            raise SystemExit(f"the packed forward is {worst} off the padded one: the rows were not masked apart")
        for name, (run, tokens) in variants.items():
            results[name] = {"seconds": median_seconds(run, args.repeats), "tokens": tokens}
    title = f"One guard try: {len(lengths)} rows, prompt {prompt}, responses {lengths} ({sum(real)} tokens)"
    table = Table(title=title)
    for column in ("variant", "tokens run", "seconds", "vs padded"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    base = results["padded"]["seconds"]
    for name, result in results.items():
        table.add_row(name, str(result["tokens"]), f"{result['seconds']:.3f}", f"{result['seconds'] / base:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"prompt": prompt, "lengths": lengths, "real_tokens": sum(real), "packed_max_abs_difference": worst}
    record["threads"] = torch.get_num_threads()
    args.out.write_text(json.dumps({**record, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
