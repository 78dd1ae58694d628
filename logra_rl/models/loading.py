"""Where a run's policy comes from, and what LoGRA will train in it, known before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from logra_rl.config import RunConfig
from logra_rl.logra import LoGRAConfig, check_rank, find_targets
from logra_rl.models.shapes import HUB_SHAPES, PRESET_GPU_GIB, PRESET_MODELS, Shape, write_model
from logra_rl.models.smollm2 import fetch_smollm2
from logra_rl.models.tiny import build_quickstart_model
from logra_rl.utils.run_dir import staged_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig


def resolve_model_path(config: RunConfig, run_dir: Path) -> str:
    """`model.path`, the quickstart's tiny model built (once, seeded) into `<run_dir>/base_model`, or
    SmolLM2-135M-Instruct fetched (once) into the cache."""
    model = config.model
    if model.builder == "smollm2":
        return str(fetch_smollm2())
    if model.builder == "quickstart":
        path = Path(run_dir) / "base_model"
        if not (path / "model.safetensors").exists():  # written whole or not at all (a full disk leaves nothing)
            with staged_dir(path) as staging:
                build_quickstart_model(
                    staging,
                    seed=config.trainer.seed,
                    format_steps=model.quickstart_format_steps,
                    copy_share=model.quickstart_copy_share,
                )
        return str(path)
    return model.path


def check_model_dir(path: str) -> None:
    """Stop, naming the fix, on a model.path that cannot be loaded: a local path that does not exist (a hub id,
    `org/name`, is left to transformers), a directory without config.json or weights, or a safetensors file cut
    short (a copy or download that stopped), found from its header, before anything reads the weights."""
    directory = Path(path).expanduser()
    if not directory.exists():
        if path.startswith(("/", ".", "~")) or path.count("/") != 1:
            raise FileNotFoundError(
                f"model.path={path}: no such directory; set model.path to a local HF model directory"
            )
        return
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path} has no config.json: give a Hugging Face model directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files and not any(directory.glob("*.bin")):
        raise FileNotFoundError(f"model.path={path} holds no weights (*.safetensors or *.bin)")
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as stream:
            header = stream.read(8)
            length = int.from_bytes(header, "little") if len(header) == 8 else -1
            try:
                tensors = json.loads(stream.read(length)) if 0 < length <= size - 8 else None
            except ValueError:
                tensors = None
        if tensors is None:
            raise ValueError(f"model.path={path}: {file.name} is not a readable safetensors file; copy it again")
        end = max((entry["data_offsets"][1] for key, entry in tensors.items() if key != "__metadata__"), default=0)
        if size < 8 + length + end:
            raise ValueError(
                f"model.path={path}: {file.name} is cut short ({size} of {8 + length + end} bytes): a copy or download "
                "that stopped; copy it again"
            )


def planning_model_path(config: RunConfig, scratch: Path) -> str:
    """A directory with the run's model config, for a memory plan: the quickstart's model built untrained
    into `scratch` (its shape is what matters), a hub id of known shape as that shape's config.json in `scratch`
    (`known_shape`), any other as `resolve_model_path` finds it."""
    if config.model.builder == "quickstart":
        return str(build_quickstart_model(Path(scratch) / "base_model", seed=config.trainer.seed, format_steps=0))
    shape = known_shape(config)
    if shape is not None:
        return str(write_model(shape, Path(scratch) / shape.name, weights=False))
    return resolve_model_path(config, scratch)


def known_shape(config: RunConfig) -> Shape | None:
    """The shape a plan reads for a model.path that is no local directory (models.shapes.HUB_SHAPES): a plan
    fetches nothing, and a config is all it needs. None for a local directory or a builder's model; raises
    naming the fix for anything else."""
    path = config.model.path
    if path is None or Path(path).is_dir():
        return None
    shape = next((shape for hub_id, shape in HUB_SHAPES.items() if hub_id.lower() == path.lower()), None)
    if shape is None:
        raise ValueError(
            f"model.path={path} is neither a local directory nor a model of known shape ({', '.join(HUB_SHAPES)}); "
            "set model.path to a local HF model directory (its config.json is enough for a plan)"
        )
    return shape


def plan_preset_defaults(cfg: DictConfig) -> list[str]:
    """What a plan takes for a GPU preset (models.shapes.PRESET_MODELS, by experiment_name) where the preset
    leaves it to the user or the machine: an unset model.path is the preset's model, and cluster.device=auto
    without CUDA here is the node the preset is made for (CUDA, 80 GiB GPUs), not this machine's CPUs, which
    cannot run it. Sets them in `cfg`; returns a note on the node when it was assumed."""
    name = cfg.experiment_name
    preset = next((p for p in PRESET_MODELS if name == p or name.startswith(f"{p}_")), None)
    if preset is None:
        return []
    if cfg.model.path is None and cfg.model.builder is None:
        cfg.model.path = PRESET_MODELS[preset]
    if cfg.cluster.device != "auto" or torch.cuda.is_available():
        return []
    cfg.cluster.device = "cuda"
    if cfg.cluster.gpu_memory_gib is None:
        cfg.cluster.gpu_memory_gib = PRESET_GPU_GIB
    return [
        f"planned for the GPU node {preset} is made for (no CUDA here): cluster.device=cuda "
        f"cluster.gpu_memory_gib={cfg.cluster.gpu_memory_gib:g}; cluster.device=cpu plans this machine"
    ]


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
