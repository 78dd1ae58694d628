"""The base model's pass@k on candidate Reasoning-Gym tasks and answer formats, to pick a preset's task.

An RL run can only learn where the base model sometimes succeeds: this samples k responses per prompt with
vLLM (the same prompts, chat template and graders as a run) and prints pass@1, pass@k and the share of
prompts with mixed outcomes (where GRPO has a signal). Run it in the vLLM environment:

    .venv-vllm/bin/python scripts/bench/smollm2_base_passk.py [--prompts 48] [--k 8] [--out bench_results]
        [--only "a +- b in 0..100, boxed" ...] [--temperature 0.7] [--model HF_DIR]

SmolLM2-135M-Instruct by default; `--model` measures another HF directory the same way.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from logra_rl.utils.timing import timed

# (name, dataset, generator kwargs, answer format, reward)
CANDIDATES = [
    ("sums, tags", "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]},
     "tags", "reasoning_gym"),
    ("sums, boxed", "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]},
     "boxed", "math"),
    ("2-digit sums, boxed", "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"]},
     "boxed", "math"),
    ("products, boxed", "products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
     "boxed", "math"),
    # question spaces of thousands: held-out prompts the train prompts do not contain
    ("2+2-digit sums, boxed", "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
     "boxed", "math"),
    ("3 one-digit terms +-, boxed", "chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
     "boxed", "math"),
    ("1-2-digit products, boxed", "products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
     "boxed", "math"),
    ("gcd up to 100, boxed", "gcd", {"min_value": 1, "max_value": 100}, "boxed", "math"),
    ("a +- b in 0..10 or 0..100, boxed", "basic_arithmetic",
     {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_negation": False,
      "allow_parentheses": False}, "boxed", "math"),
    ("a +- b in 0..100, boxed", "basic_arithmetic",
     {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+", "-"],
      "allow_negation": False, "allow_parentheses": False}, "boxed", "math"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--only", nargs="*", help="candidates to measure, by name (default: all)")
    parser.add_argument("--model", help="an HF model directory (default: SmolLM2-135M-Instruct from the cache)")
    args = parser.parse_args()
    candidates = [c for c in CANDIDATES if not args.only or c[0] in args.only]
    if not candidates:
        parser.error(f"--only matched no candidate; candidates are {[c[0] for c in CANDIDATES]}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from logra_rl.data.config import DataConfig
    from logra_rl.data.prompts import load_workload
    from logra_rl.models.smollm2 import fetch_smollm2
    from logra_rl.rewards import get_reward_function

    model = args.model or str(fetch_smollm2())
    # chunked prefill off: vLLM cannot rewind a seeded CPU generator (see rollout/vllm_engine.py)
    llm = LLM(model, dtype="bfloat16", max_model_len=512, seed=0, enforce_eager=True, enable_chunked_prefill=False)
    sampling = SamplingParams(n=args.k, temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    rows = []
    for name, dataset, kwargs, answer_format, reward in candidates:
        spec = {"datasets": [dataset], "config": {dataset: kwargs}, "answer_format": answer_format}
        data = DataConfig(task="reasoning_gym", reward=reward, train_size=1, eval_size=args.prompts, reasoning_gym=spec)
        prompts = load_workload(data, model).eval
        requests = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts]
        outputs, seconds = timed(lambda r=requests: llm.generate(r, sampling, use_tqdm=False))
        grade = get_reward_function(reward)
        scores = [
            [grade(sample.text, p.example.answer, p.example.metadata) >= 1.0 for sample in output.outputs]
            for p, output in zip(prompts, outputs, strict=True)
        ]
        lengths = [len(sample.token_ids) for output in outputs for sample in output.outputs]
        rows.append(
            {
                "candidate": name,
                "pass@1": sum(map(sum, scores)) / (len(scores) * args.k),
                f"pass@{args.k}": sum(map(any, scores)) / len(scores),
                "mixed": sum(0 < sum(s) < args.k for s in scores) / len(scores),
                "mean tokens": sum(lengths) / len(lengths),
                "generate s": seconds,
            }
        )
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": model, "prompts": args.prompts, "k": args.k, "temperature": args.temperature, "rows": rows}
    (args.out / "smollm2_base_passk.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'smollm2_base_passk.json'}")


if __name__ == "__main__":
    main()
