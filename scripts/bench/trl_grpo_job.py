"""TRL's GRPOTrainer on the comparison job of scripts/bench/bench_trl.py; runs in TRL's own environment.

    <trl-venv>/bin/python scripts/bench/trl_grpo_job.py --model DIR --prompts prompts.jsonl --out trl.json [--lora]

Imports nothing from logra_rl (the environment has TRL, not the project). Writes the seconds from the
process's start to the first optimizer step, each step's seconds, its generation seconds (completions
and rewards: `_generate_and_score_completions`), and the mean reward.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import psutil
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_match(completions, answer, **_) -> list[float]:
    """1 when the last \\boxed{} holds the reference answer (the timing does not depend on the grader)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        boxes = BOXED.findall(text)
        rewards.append(float(bool(boxes) and boxes[-1].strip() == gold.strip()))
    return rewards


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(time.time())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL of {prompt: chat messages, answer}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 (alpha 32) on the 7 linears")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()

    records = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list(records)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_output"),
        per_device_train_batch_size=args.prompts_per_step,  # completions per microbatch
        gradient_accumulation_steps=args.n,  # 4 x 8 = 32 completions = 8 prompts x 4 per step
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        beta=0.0,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    generation_seconds: list[float] = []

    class TimedTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.time()
            out = super()._generate_and_score_completions(inputs)
            generation_seconds.append(time.time() - start)
            return out

    clock = StepClock()
    trainer = TimedTrainer(
        model=model,
        reward_funcs=boxed_match,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS) if args.lora else None,
        callbacks=[clock],
    )
    trainer.train()
    rewards = [float(logs["reward"]) for logs in trainer.state.log_history if "reward" in logs]
    steps = [end - begin for begin, end in zip(clock.begins, clock.ends, strict=True)]
    result = {
        "startup_s": clock.begins[0] - psutil.Process().create_time(),
        "step_s": steps,
        "generation_s": generation_seconds,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "gradient_checkpointing": config.gradient_checkpointing,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
