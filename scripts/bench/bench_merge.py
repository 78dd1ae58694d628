#!/usr/bin/env python
"""Time of one payload's way into a rollout copy: parse (`from_bytes`) and merge (`PayloadMerger.apply`), with
the shipped defaults (bf16 weights, the int16 `tail` residual), on one Qwen2.5-7B-shaped decoder layer.

    .venv/bin/python scripts/bench/bench_merge.py [--rank 256] [--chunk-rows 0 256] [--repeats 3] [--out FILE]

`--chunk-rows 0` is the default sizing (`merge_chunk_rows: 0`: about 2^24 elements a chunk); 256 is the old
fixed default. Every variant must leave the same bits (checked against the first). Run it against another
checkout with `PYTHONPATH=OTHER_CHECKOUT` to compare before / after a change. The payload is random factors at
LoGRA's scale; a whole 7B model is 28 such layers, so its per-step merge time is about 28× the table's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from logra_rl.logra import PayloadEntry, PayloadMerger, UpdatePayload, hf_targets, make_projection, projection_seed
from logra_rl.logra.projection import projection_fingerprint
from logra_rl.utils.timing import timed

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query / 4 KV heads of 128
SHAPES = {
    "self_attn.q_proj": (3584, 3584),
    "self_attn.k_proj": (512, 3584),
    "self_attn.v_proj": (512, 3584),
    "self_attn.o_proj": (3584, 3584),
    "mlp.gate_proj": (18944, 3584),
    "mlp.up_proj": (18944, 3584),
    "mlp.down_proj": (3584, 18944),
}


def layer_payload(rank: int, seed: int = 0) -> UpdatePayload:
    generator = torch.Generator().manual_seed(seed)
    entries = tuple(
        PayloadEntry(
            f"model.layers.0.{leaf}",
            d_out,
            k_in,
            (torch.randn(d_out, rank, generator=generator) * 1e-5).to(torch.bfloat16),
        )
        for leaf, (d_out, k_in) in SHAPES.items()
    )
    first = entries[0]
    projection = make_projection(rank, first.k_in, projection_seed(seed, 1, first.name), "rademacher")
    return UpdatePayload(0, 1, seed, 1, rank, "rademacher", "bfloat16", projection_fingerprint(projection), entries)


def weights(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.0.{leaf}": (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for leaf, shape in SHAPES.items()
    }


def run(rank: int, chunk_rows: int, repeats: int) -> tuple[dict, dict[str, torch.Tensor]]:
    wire = layer_payload(rank).to_bytes()
    parse_s, merge_s = [], []
    for _ in range(repeats):
        merger = PayloadMerger(hf_targets(weights(), "tail"), chunk_rows=chunk_rows)
        payload, seconds = timed(lambda: UpdatePayload.from_bytes(wire))
        parse_s.append(seconds)
        merge_s.append(timed(lambda m=merger, p=payload: m.apply(p))[1])
    result = {name: target.weight.clone() for name, target in merger.targets.items()}
    result.update({f"{name}.tail": target.residual.clone() for name, target in merger.targets.items()})
    row = {"rank": rank, "chunk_rows": chunk_rows, "payload_mib": len(wire) / 2**20}
    row.update(parse_s=min(parse_s), merge_s=min(merge_s))
    return row, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--chunk-rows", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/merge.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for rank in args.rank:
        reference = None
        for chunk_rows in args.chunk_rows:
            row, result = run(rank, chunk_rows, args.repeats)
            if reference is None:
                reference = result
            row["same_bits"] = all(torch.equal(result[k], reference[k]) for k in reference)
            rows.append(row)
    table = Table(title=f"one Qwen2.5-7B-shaped layer, bf16 + tail, torch threads {torch.get_num_threads()}")
    for column in ("rank", "chunk rows", "payload MiB", "from_bytes s", "merge s", "same bits"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["rank"]),
            str(row["chunk_rows"] or "auto"),
            f"{row['payload_mib']:.1f}",
            f"{row['parse_s']:.4f}",
            f"{row['merge_s']:.3f}",
            str(row["same_bits"]),
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
