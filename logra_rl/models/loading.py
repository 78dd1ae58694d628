"""Where a run's policy comes from, and what LoGRA will train in it, known before any actor starts."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from logra_rl.config import RunConfig
from logra_rl.logra import LoGRAConfig, check_rank, find_targets
from logra_rl.models.smollm2 import fetch_smollm2
from logra_rl.models.tiny import build_quickstart_model


def resolve_model_path(config: RunConfig, run_dir: Path) -> str:
    """`model.path`, the quickstart's tiny model built (once, seeded) into `<run_dir>/base_model`, or
    SmolLM2-135M-Instruct fetched (once) into the cache."""
    model = config.model
    if model.builder == "smollm2":
        return str(fetch_smollm2())
    if model.builder == "quickstart":
        path = Path(run_dir) / "base_model"
        if not (path / "config.json").exists():
            build_quickstart_model(path, seed=config.trainer.seed)
        return str(path)
    return model.path


def planning_model_path(config: RunConfig, scratch: Path) -> str:
    """A directory with the run's model config, for a memory plan: the quickstart's model built untrained
    into `scratch` (its shape is what matters), any other as `resolve_model_path` finds it."""
    if config.model.builder == "quickstart":
        return str(build_quickstart_model(Path(scratch) / "base_model", seed=config.trainer.seed, format_steps=0))
    return resolve_model_path(config, scratch)


def target_shapes(model_path: str, config: LoGRAConfig) -> dict[str, tuple[int, int]]:
    """HF names and (d_out, k_in) of the LoGRA targets, read from the model config without loading weights;
    raises on no match or a rank above a target's size, so the run stops before anything starts."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    modules = find_targets(model, config.target_modules)
    check_rank(modules, config.rank)
    return {name: tuple(m.weight.shape) for name, m in modules}


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # each converts exactly to float32


def converts_exactly(model_path: str, dtype: str) -> bool:
    """Whether every floating tensor of the checkpoint at `model_path` (safetensors) converts exactly to
    `dtype`: it is stored in `dtype`, or `dtype` is float32. Then an engine that reads the checkpoint holds
    what a full resync from the trainer's fp32 masters, read from the same files, would send it (the rounding
    of an exact value is the value, and its residual is zero). False when it cannot tell (no safetensors)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            names = checkpoint.keys()
            for name in names:
                stored = checkpoint.get_slice(name).get_dtype()
                if stored.startswith(("I", "U", "BOOL")):  # integer tensors are not weights the sync sends
                    continue
                if stored not in SAFETENSORS_DTYPES or dtype not in ("float32", SAFETENSORS_DTYPES[stored]):
                    return False
    return bool(files)
