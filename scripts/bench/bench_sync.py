"""Bytes and time to bring a rollout copy up to date after one training step, three ways.

    .venv/bin/python scripts/bench/bench_sync.py [--out bench_results/sync_bench.json]

- LoGRA payload: `seed + factor` (Σ d_out·r·2 bytes), serialised, parsed and merged in place
  into a bf16 copy with an fp32 residual.
- full bf16 weights: the trainer casts its fp32 masters to bf16, the engine copies them in.
- exact sparse bf16 delta: only the bf16 elements that changed (int32 index + bf16 value each),
  found by comparing bf16(master) before and after, written with index_put (what verl's
  delta_sharded and NeMo-RL's sparse refit send).

Cases: the quickstart model after one real LoGRA step (its own config), and the 7 targets of one
Qwen2.5-7B-shaped decoder layer after one update at LoGRA's default ratio (6e-5, rank 64).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.data import quickstart
from logra_rl.logra import (
    LoGRAConfig,
    LoGRAOptimizer,
    PayloadEntry,
    PayloadMerger,
    UpdatePayload,
    hf_targets,
    make_projection,
    merge_low_rank_,
    projection_fingerprint,
    projection_seed,
)
from logra_rl.models.tiny import build_quickstart_model
from logra_rl.utils.timing import timed

MIB = 2**20


def sparse_delta(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """(flat indices, new bf16 values) of the elements whose bf16 value changed."""
    delta = {}
    for name, old in before.items():
        new = after[name]
        index = (old.view(torch.int16) != new.view(torch.int16)).flatten().nonzero().flatten().to(torch.int32)
        delta[name] = (index, new.flatten()[index.long()])
    return delta


def compare(
    master_before: dict[str, torch.Tensor], master_after: dict[str, torch.Tensor], payload: UpdatePayload
) -> dict:
    """The three ways of taking a bf16 copy from bf16(master_before) to bf16(master_after)."""
    before = {name: w.to(torch.bfloat16) for name, w in master_before.items()}
    after = {name: w.to(torch.bfloat16) for name, w in master_after.items()}
    total_params = sum(w.numel() for w in before.values())

    # LoGRA: serialise, parse, merge into the targeted weights of a bf16 copy (fp32 residual)
    copy = {name: w.clone() for name, w in before.items()}
    key = {
        entry.name: f"{entry.name}.weight" if f"{entry.name}.weight" in copy else entry.name
        for entry in payload.entries
    }
    merger = PayloadMerger(hf_targets({name: copy[k] for name, k in key.items()}))
    merger.resync({name: master_before[k] for name, k in key.items()}, version=payload.base_version)
    wire = payload.to_bytes()
    logra_s = timed(payload.to_bytes)[1] + timed(lambda: merger.apply(UpdatePayload.from_bytes(wire)))[1]
    assert all(torch.equal(copy[k], after[k]) for k in key.values())  # the merge lands exactly on bf16(master)

    # full bf16 weights
    engine = {name: w.clone() for name, w in before.items()}
    _, full_s = timed(lambda: [engine[n].copy_(master_after[n].to(torch.bfloat16)) for n in engine])

    # exact sparse bf16 delta: the trainer diffs, the engine scatters
    delta, diff_s = timed(lambda: sparse_delta(before, after))
    sparse_engine = {name: w.clone() for name, w in before.items()}
    _, apply_s = timed(lambda: [sparse_engine[n].view(-1).index_put_((i.long(),), v) for n, (i, v) in delta.items()])
    changed = sum(len(i) for i, _ in delta.values())
    assert all(torch.equal(sparse_engine[n], after[n]) for n in after)
    return {
        "params": total_params,
        "logra_bytes": len(wire),
        "logra_s": logra_s,
        "full_bf16_bytes": 2 * total_params,
        "full_bf16_s": full_s,
        "sparse_changed_fraction": changed / total_params,
        "sparse_bytes": 6 * changed,
        "sparse_s": diff_s + apply_s,
    }


def quickstart_case() -> dict:
    """One real LoGRA step of the quickstart model with the quickstart's LoGRA settings."""
    with tempfile.TemporaryDirectory() as directory:
        path = build_quickstart_model(Path(directory) / "model")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    examples = [quickstart.example(a, reward="exact_match") for a in range(10)]
    prompts = [
        tokenizer.apply_chat_template(list(e.messages), add_generation_prompt=True)["input_ids"]
        + tokenizer.convert_tokens_to_ids([e.answer])
        for e in examples
    ]
    ids = torch.tensor(prompts * 26)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=32, update_ratio=3e-2))
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, -2], ids[:, -1], reduction="sum")
    loss.backward()
    opt.prepare(num_tokens=len(ids))
    payload = opt.commit(alpha=1.0)
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"case": "quickstart model (all weights, r=32, ratio 3e-2)", **compare(before, after, payload)}


def layer_case(rank: int = 64, ratio: float = 6e-5) -> dict:
    """The 7 targets of one Qwen2.5-7B-shaped layer after one update at LoGRA's default ratio."""
    h, i, kv = 3584, 18944, 4 * 128
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    generator = torch.Generator().manual_seed(0)
    master = {f"model.layers.0.{k}": torch.randn(s, generator=generator) * 0.02 for k, s in shapes.items()}
    factors = {name: torch.randn(w.shape[0], rank, generator=generator) for name, w in master.items()}
    projections = {name: make_projection(rank, w.shape[1], projection_seed(1, 0, name)) for name, w in master.items()}
    update_sq = sum(float((factors[n] @ projections[n]).square().sum()) for n in master)
    scale = ratio * (sum(float(w.square().sum()) for w in master.values()) / update_sq) ** 0.5
    entries = tuple(
        PayloadEntry(name, *w.shape, (scale * factors[name]).to(torch.bfloat16)) for name, w in master.items()
    )
    payload = UpdatePayload(
        0, 1, 1, 0, rank, "rademacher", "bfloat16", projection_fingerprint(projections[entries[0].name]), entries
    )
    after = {name: w.clone() for name, w in master.items()}
    for entry in entries:
        merge_low_rank_(after[entry.name], entry.factor, projections[entry.name])
    return {"case": f"Qwen2.5-7B layer, 7 targets (r={rank}, ratio {ratio:g})", **compare(master, after, payload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_results/sync_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [quickstart_case(), layer_case()]
    table = Table(title="Sync after one step: bytes and CPU time (serialise/diff + apply)")
    for column in ("case", "params", "LoGRA payload", "full bf16", "sparse bf16 delta (changed)"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["case"],
            f"{r['params'] / 1e6:.1f}M",
            f"{r['logra_bytes'] / MIB:.2f} MiB, {r['logra_s']:.3f} s",
            f"{r['full_bf16_bytes'] / MIB:.2f} MiB, {r['full_bf16_s']:.3f} s",
            f"{r['sparse_bytes'] / MIB:.2f} MiB ({100 * r['sparse_changed_fraction']:.1f}%), {r['sparse_s']:.3f} s",
        )
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
