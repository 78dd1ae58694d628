"""Real models' shapes, for benchmarks, the GPU check and memory plans without a hub: the exact architecture,
random weights.

    python -m logra_rl.models.shapes qwen2.5-1.5b /tmp/qwen2.5-1.5b            # config.json only (for logra-plan)
    python -m logra_rl.models.shapes qwen2.5-1.5b /tmp/qwen2.5-1.5b --weights  # + random bf16 weights, a tokenizer

A directory with config.json is all `logra-plan model.path=DIR` needs; with `--weights` it is a model
`logra-train model.path=DIR` trains: random weights (seeded, HF's init) stored in bfloat16 as the real
checkpoints are, and SmolLM2-135M-Instruct's tokenizer and chat template (its 49,152 ids are a subset of the
shape's vocabulary; what memory and speed depend on is the vocabulary's size, which is the real one).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn


@dataclass(frozen=True)
class Shape:
    """A decoder-only model shape; `family` picks the transformers class."""

    name: str
    family: str  # qwen3 | qwen2 | gemma3 (the text model alone) | gemma3-mm (as released: with the vision tower)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def hf_config(self, **extra: object) -> transformers.PretrainedConfig:
        """The transformers config; `extra` are more settings of it (`attn_implementation`, ...)."""
        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied,
        )
        if self.family == "qwen2":  # Qwen2 derives head_dim = hidden / heads (128 for both shapes used)
            assert self.hidden // self.heads == self.head_dim, self
            return transformers.Qwen2Config(max_position_embeddings=32768, **common, **extra)
        if self.family == "gemma3":
            return transformers.Gemma3TextConfig(head_dim=self.head_dim, **common, **extra)
        if self.family == "gemma3-mm":  # the released checkpoints: the decoder under model.language_model
            text = transformers.Gemma3TextConfig(head_dim=self.head_dim, **common)
            return transformers.Gemma3Config(
                text_config=text.to_dict(), vision_config=GEMMA3_VISION, mm_tokens_per_image=256, **extra
            )
        return transformers.Qwen3Config(head_dim=self.head_dim, attention_dropout=0.0, **common, **extra)

    def model_class(self) -> type[nn.Module]:
        classes = {
            "qwen3": transformers.Qwen3ForCausalLM,
            "qwen2": transformers.Qwen2ForCausalLM,
            "gemma3": transformers.Gemma3ForCausalLM,
            "gemma3-mm": transformers.Gemma3ForConditionalGeneration,
        }
        return classes[self.family]


# The training-step model of bench_logra: ~0.37B parameters, hidden 1024, Qwen3 layout, untied embeddings.
TRAIN_SHAPE = Shape("qwen3-0.37B", "qwen3", 1024, 3072, 24, 16, 8, 64, 32768, False)
QUICK_TRAIN_SHAPE = Shape("qwen3-21M", "qwen3", 512, 1536, 4, 8, 4, 64, 8192, False)
QWEN25_1P5B = Shape("Qwen2.5-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True)
QWEN25_7B = Shape("Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False)  # 7B's vocab: 152,064
# The GPU check's CPU smoke run: two small Qwen2 layers.
SMALL_QWEN2 = Shape("qwen2-small", "qwen2", 256, 512, 2, 4, 2, 64, 1024, False)
# Gemma 3 27B as released (`Gemma3ForConditionalGeneration`): its SigLIP vision tower (~0.4B) beside the decoder
GEMMA3_VISION = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896
)
GEMMA3_27B = Shape("Gemma-3-27B", "gemma3-mm", 5376, 21504, 62, 32, 16, 128, 262208, True)
SHAPES = {"qwen2.5-1.5b": QWEN25_1P5B, "qwen2.5-7b": QWEN25_7B, "gemma3-27b": GEMMA3_27B, "qwen3-0.37b": TRAIN_SHAPE}
# Hub ids of released models of these shapes: what `logra-plan` plans from a config alone when model.path is one
# of them and no local directory (logra_rl.models.loading.known_shape); nothing is fetched for a plan.
HUB_SHAPES = {
    "Qwen/Qwen2.5-1.5B": QWEN25_1P5B,
    "Qwen/Qwen2.5-1.5B-Instruct": QWEN25_1P5B,
    "Qwen/Qwen2.5-Math-1.5B": QWEN25_1P5B,
    "Qwen/Qwen2.5-7B": QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
    "Qwen/Qwen2.5-Math-7B": QWEN25_7B,
    "google/gemma-3-27b-it": GEMMA3_27B,
    "google/gemma-3-27b-pt": GEMMA3_27B,
}
# The GPU presets (configs/experiment/; their _dense and _lora variants too) and their model. Each is made for one
# 8×H100-80GB node (4 train + 4 rollout GPUs), which is what `logra-plan` plans them for without CUDA here.
PRESET_MODELS = {
    "dapo_math_1p5b": "Qwen/Qwen2.5-Math-1.5B",
    "dapo_math_7b": "Qwen/Qwen2.5-7B",
    "reasoning_gym_hard_27b": "google/gemma-3-27b-it",
}
PRESET_GPU_GIB = 80.0


def write_model(shape: Shape, out: Path, weights: bool, seed: int = 0) -> Path:
    """`out` with the shape's config.json (dtype bfloat16, as released); with `weights`, random weights and
    SmolLM2's tokenizer."""
    config = shape.hf_config()
    config.dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    if not weights:
        config.save_pretrained(out)
        return out
    from logra_rl.models.smollm2 import fetch_smollm2

    torch.manual_seed(seed)
    model = shape.model_class()(config)
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    smollm2 = fetch_smollm2()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    tokenizer.save_pretrained(out)
    shutil.copy(smollm2 / "generation_config.json", out / "generation_config.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--weights", action="store_true", help="random bf16 weights and a tokenizer, not just config")
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (the widths stay)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, name=f"{shape.name}-{args.layers}L", layers=args.layers)
    print(write_model(shape, args.out, args.weights))


if __name__ == "__main__":
    main()
