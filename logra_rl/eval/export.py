"""A run's checkpoint as a Hugging Face model directory that transformers and vLLM load (LoRA adapters merged, the
base model's config, generation config, tokenizer and chat template): what `logra-export` (`apps.export`) writes,
and what `logra-eval` gives its engines for `eval.checkpoint`.

A checkpoint holds the trainer's fp32 masters (torch.distributed.checkpoint shards, under `model.` + the names of
the model it trains: HF names, or peft's `base_model.model.` + HF name beside the adapters in a LoRA run)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.config import RunConfig
from logra_rl.models.loading import resolve_model_path
from logra_rl.models.smollm2 import COMPLETE, default_model_dir
from logra_rl.train.lora import PEFT_PREFIX, merged_state
from logra_rl.utils.checkpoint import Checkpoints, verify
from logra_rl.utils.run_dir import staged_dir

BASE_MODEL_FIX = "pass --base-model DIR (the HF model directory or hub id the run started from)"


def find_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """The checkpoint `path` names, verified: `path` itself (a run's `checkpoints/step_N`), or a run directory's
    newest checkpoint that verifies (`checkpoints/latest` unless it is damaged), as a resume would take it; and a
    line for each damaged one passed over."""
    path = Path(path)
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"{path} {problem}; give a run directory or one of its checkpoints/step_N")
    if (path / "controller.json").exists() or (path / "model").is_dir():
        problem = verify(path)
        if problem:
            raise ValueError(
                f"checkpoint {path} is damaged ({problem}); export another checkpoint of the run, or the run "
                "directory for its newest intact one"
            )
        return path, []
    if not (path / "checkpoints").is_dir():
        held = sorted(child.name for child in path.iterdir())
        raise FileNotFoundError(
            f"{path} is neither a run directory (no checkpoints/) nor a checkpoint (no model/), it holds "
            f"{held[:8] or 'nothing'}; give a run directory (outputs/<experiment>/<run>) or its checkpoints/step_N"
        )
    checkpoint, skipped = Checkpoints(path, keep=1).resumable()
    if checkpoint is None and skipped:
        damaged = "; ".join(line.removesuffix("; skipped") for line in skipped)
        raise ValueError(f"{path} has no intact checkpoint ({damaged}); resume the run to write a new one")
    if checkpoint is None:
        held = sorted(child.name for child in (path / "checkpoints").iterdir())
        raise FileNotFoundError(
            f"{path} has no checkpoint (its checkpoints/ holds {held or 'nothing'}); a run writes one every "
            "trainer.checkpoint_every steps and when stopped by SIGTERM"
        )
    return checkpoint, skipped


def run_config(run_dir: Path) -> RunConfig:
    """The run's own config, as it ran: it names the base model and the LoRA scale."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise FileNotFoundError(
            f"{saved} is missing (it names the run's base model and LoRA scale); export a checkpoint inside the run "
            f"directory that wrote it, or {BASE_MODEL_FIX}"
        )
    return RunConfig.from_mapping(OmegaConf.load(saved))


def run_base_model(run_dir: Path) -> str:
    """The model the run started from, where `resolve_model_path` found it; built or downloaded only by the run
    itself (a model built again here need not be the run's)."""
    config = run_config(run_dir)
    built = {"quickstart": run_dir / "base_model" / "model.safetensors", "smollm2": default_model_dir() / COMPLETE}
    marker = built.get(config.model.builder)
    if marker is not None and not marker.exists():
        raise FileNotFoundError(f"the run's base model {marker.parent} is missing; {BASE_MODEL_FIX}")
    return resolve_model_path(config, run_dir)


def read_state(directory: Path) -> dict[str, torch.Tensor]:
    """The full state dict a train group saved with `dcp.save({"model": ...})`, read in this one process."""
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    state = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype) for key, m in stored.items()}
    with warnings.catch_warnings():  # one process is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=directory, no_dist=True)
    return state


def one_line(error: BaseException, limit: int = 300) -> str:
    return " ".join(str(error).split())[:limit]


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, dtype: str = "bfloat16", base_model: str | None = None, force: bool = False
) -> Path:
    """Write the (verified) `checkpoint` as an HF model directory at `out`, its weights the fp32 masters rounded to
    `dtype`, whole or not at all: it is written beside `out` under a temporary name and renamed into place, and
    replaces an `out` that holds anything only with `force`. `base_model` (default: the run's own) gives the
    architecture and tokenizer."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose another OUT_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; choose another OUT_DIR, or pass --force to replace it")
    if out.resolve() in (checkpoint.resolve(), *checkpoint.resolve().parents):
        raise FileExistsError(f"{out} holds the checkpoint itself (--force would replace it); choose another OUT_DIR")
    run_dir = checkpoint.resolve().parents[1]  # <run>/checkpoints/step_N
    base_model = base_model or run_base_model(run_dir)
    if Path(base_model).is_absolute() and not Path(base_model).exists():  # not a hub id either
        raise FileNotFoundError(f"the base model {base_model} is missing; {BASE_MODEL_FIX}")
    state = read_state(checkpoint / "model")
    if any(key.startswith(PEFT_PREFIX) for key in state):  # a LoRA run: merge with the run's own scale
        state = merged_state(state, run_config(run_dir).optimizer.lora_scaling)
    try:
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=getattr(torch, dtype))  # config.dtype too
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as error:  # no model there, or no model transformers knows
        raise FileNotFoundError(
            f"cannot load the base model {base_model} ({one_line(error)}); {BASE_MODEL_FIX}"
        ) from error
    try:
        model.load_state_dict(state, strict=True)  # copied into `dtype`: each fp32 master rounded to nearest even
    except RuntimeError as error:
        raise ValueError(
            f"the checkpoint does not fit the base model {base_model} ({one_line(error)}); {BASE_MODEL_FIX}"
        ) from error
    with staged_dir(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for file in staging.iterdir():  # safetensors writes its file owner-only: a server run by another user
            file.chmod(0o644)  # (`vllm serve`) must read it
    return out
