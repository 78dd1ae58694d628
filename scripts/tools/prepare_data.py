#!/usr/bin/env python
"""Write a task's examples to parquet in verl's schema, to train from local files (e.g. on a node without internet).

    python scripts/tools/prepare_data.py --task dapo_math --out data/dapo_math/train.parquet
    python scripts/tools/prepare_data.py --task math500 --out data/math500/test.parquet
    python scripts/tools/prepare_data.py --task reasoning_gym_hard --split train --size 20000 \\
        --out data/rg_hard/train.parquet
    python scripts/tools/prepare_data.py --task reasoning_gym_hard --split eval --size 400 \\
        --out data/rg_hard/test.parquet
    python scripts/tools/prepare_data.py --task reasoning_gym --set reasoning_gym.datasets=[gcd,lcm] \\
        --out data/gcd.parquet

Tasks: `dapo_math` (train split of --source, default BytedTsinghua-SIA/DAPO-Math-17k), `math500` (eval split of
--source, default HuggingFaceH4/MATH-500), `reasoning_gym_hard` (the hard Reasoning-Gym mixture), or any registered
task, configured with `--set key=value` (data config keys, Hydra-style values). --source may be a hub id, a local
directory or a parquet/jsonl file. Each row: `data_source`, `prompt` (chat messages), `ability`,
`reward_model: {style: rule, ground_truth}`, `extra_info: {split, index, reward, metadata}` where `metadata` is the
example's grader metadata as a JSON string. Load the file back with `data.task=files data.train_files=[...]`: every
row grades with its own reward, as the original task did.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from logra_rl.data import DataConfig, Example, load_task
from logra_rl.data.math import DAPO_MATH, MATH_500, load_math_examples

MATH_PRESETS = {"dapo_math": (DAPO_MATH, "train"), "math500": (MATH_500, "eval")}
ABILITY = {"math": "math", "math_verify": "math", "reasoning_gym": "reasoning"}


def examples(args: argparse.Namespace) -> list[Example]:
    """The examples of `--task`/`--split`, at most `--size` of them."""
    base: dict[str, Any] = {"task": args.task, "seed": args.seed}
    if args.task in MATH_PRESETS:
        base["task"] = "math"
    elif args.task == "reasoning_gym_hard":
        base |= {"task": "reasoning_gym", "reasoning_gym": {"datasets": "hard"}}
    if args.size is not None and args.task not in MATH_PRESETS:
        base |= {"train_size": args.size, "eval_size": args.size}
    values = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_dotlist(args.set)))
    config = DataConfig.from_dict(values)
    if args.task in MATH_PRESETS:
        default_source, default_split = MATH_PRESETS[args.task]
        source, split = args.source or default_source, args.split or default_split
        return load_math_examples(source, split, config, config.reward or "math")[: args.size]
    if args.source:
        raise SystemExit(f"--source is for {sorted(MATH_PRESETS)}; for task {args.task!r} use --set train_files=[...]")
    task = load_task(config)
    return (task.eval if args.split == "eval" else task.train)[: args.size]


def verl_row(example: Example, split: str, index: int, task: str) -> dict[str, Any]:
    """One row of verl's schema; `extra_info` keeps the reward and its metadata so the `files` task grades alike."""
    return {
        "data_source": example.metadata.get("data_source", task),
        "prompt": list(example.messages),
        "ability": ABILITY.get(example.reward, example.reward),
        "reward_model": {"style": "rule", "ground_truth": example.answer},
        "extra_info": {
            "split": split,
            "index": index,
            "reward": example.reward,
            "metadata": json.dumps(example.metadata),
        },
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="dapo_math, math500, reasoning_gym_hard or a registered task")
    parser.add_argument("--out", required=True, help="the parquet file to write")
    parser.add_argument("--split", choices=["train", "eval"], help="default: eval for math500, else train")
    parser.add_argument("--size", type=int, help="at most this many examples (default: all, or the task's default)")
    parser.add_argument("--source", help="dapo_math / math500: a hub id, a local directory or a parquet/jsonl file")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a data config value")
    args = parser.parse_args(argv)
    found = examples(args)
    if not found:
        raise SystemExit(f"task {args.task!r} has no {args.split or 'train'} examples; nothing written")
    split = args.split or MATH_PRESETS.get(args.task, (None, "train"))[1]
    rows = [verl_row(example, split, index, args.task) for index, example in enumerate(found)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {len(rows)} {args.task} {split} examples to {out}")
    return out


if __name__ == "__main__":
    main()
