#!/usr/bin/env python
"""What one try of the KL guard costs on SmolLM2-135M-Instruct, per part, under each `logra.kl.trial_merge`.

    .venv/bin/python scripts/bench/bench_guard_try.py [--prompt 55] [--prompts 8] [--lengths 12x6,14x4,20x3,30,40,64]

One try (`LoGRAOptimizer._measure`) runs the guard's rows with the step merged (`trial`), then the LM head and the
exact KL at their generated positions; on the `smollm2` presets that is 16 rows, right-padded to the longest. The
rows here are --prompts distinct prompts of --prompt tokens, taken in turn (the presets' chat prompts are ~50-60
tokens; the guard's 16 rows, drawn from a batch of 8 prompts × 4 responses, hold ~7.5 distinct prompts), and
responses of --lengths tokens (`12x6`: six of 12; the default is what `smollm2_arithmetic` generates from step 20 on:
mostly 11-20 tokens, one cut at the 64-token limit). fp32, the fastest of --repeats, the variants taken in turn
within each repeat so that the machine's drift falls on all of them alike (its noise is one-sided: other work only
slows a run down):

- a try, per_unit: the step merged into each target around every forward, the rows in as few forwards as fit
  (`logra.kl.forward_tokens`: one, padded to the longest row);
- a try, per_try: the step merged into every target once, the rows in forwards of similar length under it
  (`kl.length_chunks`, one forward costing the longest row's tokens); what `auto` picks on a CPU;
- the same with prompts once: each distinct prompt runs once and the rows only their responses after it, from its
  keys and values (`KLRows.prefill`, as the train worker measures);
- the same with the reference kept: the unstepped side's log-probs from the step's first try (`KLReference`, as
  `guarded_step` measures), so a try runs the LM head on its stepped side only;
- its parts: the padded forward, the forwards of similar length, the merge and restore of the step alone, the LM
  heads and the exact KL on both sides, and on the stepped side alone with the reference kept; beside them the rows
  packed end to end in one sequence whose position ids restart at each row (transformers then masks attention
  within each row): no padding, but a dense attention mask over all tokens.

All tries must measure the same KL, and the packed forward's hidden states at the rows' own positions must equal
the padded forward's (checked, fp32). The update is a real LoGRA step (rank 64, from a backward over two rows).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from logra_rl.logra import REFERENCE_BYTES, KLReference, KLRows, LoGRAConfig, LoGRAOptimizer
from logra_rl.logra.kl import features, kl_estimate, length_chunks, masked_logits, row_kl, row_lengths
from logra_rl.models.prefill import prompt_prefill
from logra_rl.models.smollm2 import fetch_smollm2
from logra_rl.utils.timing import timed

TEMPERATURE = 1.0


def lengths_of(spec: str) -> list[int]:
    """`12x6,30` -> six 12s and a 30."""
    out = []
    for part in spec.split(","):
        length, _, count = part.partition("x")
        out += [int(length)] * int(count or 1)
    return out


def fastest_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The fastest of `repeats` timings of each run, the runs interleaved (after one warm-up each)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(timed(run)[1])
    return {name: min(seconds) for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=55)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts among the rows")
    parser.add_argument("--lengths", default="12x6,14x4,20x3,30,40,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench_results/guard_try.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(fetch_smollm2(), dtype=torch.float32)
    lengths, prompt = sorted(lengths_of(args.lengths)), args.prompt
    width = prompt + max(lengths)
    ids = torch.randint(100, 40_000, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :prompt] = ids[row % args.prompts, :prompt]
        ids[row, prompt + length :] = 0
        mask[row, prompt : prompt + length] = 1

    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64, update_ratio=3e-4))
    model.train()
    logits = model(input_ids=ids[:2, : prompt + 20]).logits
    logits[:, :-1].log_softmax(-1).gather(-1, ids[:2, 1 : prompt + 20, None]).sum().backward()
    opt.prepare(num_tokens=40)
    model.eval()

    def forward(rows: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return model.model(input_ids=rows, position_ids=positions, use_cache=False).last_hidden_state

    def cached_forward(
        rows: torch.Tensor, attention_mask: torch.Tensor | None = None, **cached: object
    ) -> torch.Tensor:
        return model.model(input_ids=rows, attention_mask=attention_mask, use_cache=False, **cached).last_hidden_state

    rows = KLRows(forward=forward, input_ids=ids, loss_mask=mask, head=model.lm_head)
    shared = dataclasses.replace(rows, prefill=prompt_prefill(cached_forward, model.config))
    real = row_lengths(mask)
    packed_ids = torch.cat([ids[row, :length] for row, length in enumerate(real)])[None]
    packed_positions = torch.cat([torch.arange(length) for length in real])[None]
    chunks = length_chunks(real, overhead=width)

    def a_try(mode: str, measured: KLRows = rows, keep: bool = False) -> Callable[[], float]:
        before = KLReference(base, mask, model.lm_head, TEMPERATURE, REFERENCE_BYTES if keep else 0)

        def run() -> float:
            return opt._measure(measured, before, 1.0, 0.9, per_try=mode == "per_try").mean

        return run

    def merge_alone() -> None:
        with opt.trial(1.0, per_try=True):
            pass

    def head_and_kl(before: KLReference) -> Callable[[], float]:
        def run() -> float:
            after = masked_logits(stepped, mask, model.lm_head)
            return kl_estimate(*row_kl(before, after, len(rows), base.device), 0.9, None).mean

        return run

    with torch.no_grad():
        base = features(rows)
        with opt.trial(1.0, per_try=True):
            stepped = features(rows, overhead=width)
    kept = KLReference(base, mask, model.lm_head, TEMPERATURE, REFERENCE_BYTES)
    tokens_chunked = sum(len(chunk) * max(real[row] for row in chunk) for chunk in chunks)
    responses = length_chunks(lengths, overhead=width)
    tokens_shared = min(args.prompts, len(lengths)) * prompt + sum(
        len(chunk) * max(lengths[row] for row in chunk) for chunk in responses
    )
    variants = {
        "a try, per_unit": (a_try("per_unit"), len(lengths) * width),
        "a try, per_try": (a_try("per_try"), tokens_chunked),
        "a try, per_try, prompts once": (a_try("per_try", shared), tokens_shared),
        "a try, per_try, prompts once, reference kept": (a_try("per_try", shared, keep=True), tokens_shared),
        "  padded forward": (lambda: forward(ids), len(lengths) * width),
        f"  {len(chunks)} forwards of similar length": (lambda: features(rows, overhead=width), tokens_chunked),
        "  merge and restore of the step": (merge_alone, 0),
        "  LM heads and KL": (head_and_kl(KLReference(base, mask, model.lm_head, TEMPERATURE)), sum(real)),
        "  stepped LM head and KL, reference kept": (head_and_kl(kept), sum(real)),
        "packed (one sequence, masked apart)": (lambda: forward(packed_ids, packed_positions), sum(real)),
    }
    results = {}
    with torch.no_grad():
        padded, packed = forward(ids), forward(packed_ids, packed_positions)[0].split(real)
        worst = max((padded[row, :length] - packed[row]).abs().max().item() for row, length in enumerate(real))
        if worst > 1e-3:
            raise SystemExit(f"the packed forward is {worst} off the padded one: the rows were not masked apart")
        per_unit, per_try, prompts_once = a_try("per_unit")(), a_try("per_try")(), a_try("per_try", shared, True)()
        if max(abs(per_unit - per_try), abs(per_unit - prompts_once)) > 1e-4 * per_unit:
            raise SystemExit(
                f"the tries disagree: KL {per_unit} per_unit, {per_try} per_try, {prompts_once} prompts once"
            )
        fastest = fastest_seconds({name: run for name, (run, _) in variants.items()}, args.repeats)
        for name, (_, tokens) in variants.items():
            results[name.strip()] = {"seconds": fastest[name], "tokens": tokens}
    title = f"One guard try: {len(lengths)} rows, prompt {prompt}, responses {lengths} ({sum(real)} tokens)"
    table = Table(title=title)
    for column in ("variant", "tokens run", "seconds", "vs a try per_unit"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    first = results["a try, per_unit"]["seconds"]
    for name, (_, tokens) in variants.items():
        seconds = results[name.strip()]["seconds"]
        table.add_row(name, str(tokens), f"{seconds:.3f}", f"{seconds / first:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"prompt": prompt, "lengths": lengths, "real_tokens": sum(real), "packed_max_abs_difference": worst}
    record |= {"kl_per_unit": per_unit, "kl_per_try": per_try, "kl_prompts_once": prompts_once, "chunks": chunks}
    record |= {"prompts": args.prompts, "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({**record, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
