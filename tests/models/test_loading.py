"""What the driver reads from a checkpoint before any actor starts, and what a plan reads instead of one."""

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from transformers import AutoConfig, AutoModelForCausalLM

from logra_rl.config import RunConfig
from logra_rl.models.loading import converts_exactly, known_shape, plan_preset_defaults, planning_model_path
from logra_rl.models.shapes import QWEN25_7B


def save_as(source: str, destination, dtype: torch.dtype) -> str:
    """The model at `source` (tokenizer and all) re-saved with its weights in `dtype`."""
    shutil.copytree(source, destination)
    AutoModelForCausalLM.from_pretrained(source, dtype=dtype).save_pretrained(destination)
    return str(destination)


def test_a_checkpoint_converts_exactly_to_its_own_dtype_and_to_float32(tmp_path, quickstart_model):
    bf16 = save_as(quickstart_model, tmp_path / "bf16", torch.bfloat16)
    assert converts_exactly(bf16, "bfloat16") and converts_exactly(bf16, "float32")
    assert not converts_exactly(bf16, "float16")  # bf16's range and float16's precision differ
    fp32 = save_as(quickstart_model, tmp_path / "fp32", torch.float32)
    assert converts_exactly(fp32, "float32") and not converts_exactly(fp32, "bfloat16")
    assert not converts_exactly(str(tmp_path), "float32")  # no safetensors: it cannot tell


def composed(*overrides: str):
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return compose("config", overrides=list(overrides))


def test_a_hub_id_of_known_shape_is_planned_from_its_config_alone(tmp_path):
    config = RunConfig.from_mapping(composed("+experiment=dapo_math_7b", "model.path=qwen/QWEN2.5-7b"))
    assert known_shape(config) is QWEN25_7B  # hub ids are case-insensitive
    path = Path(planning_model_path(config, tmp_path))
    assert path.parent == tmp_path and not list(path.glob("*.safetensors"))  # a config, no weights
    hf = AutoConfig.from_pretrained(path)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.vocab_size) == (3584, 28, 152064)


def test_a_local_directory_is_planned_as_it_is_and_anything_else_is_named(tmp_path, quickstart_model):
    local = RunConfig.from_mapping(composed("+experiment=dapo_math_7b", f"model.path={quickstart_model}"))
    assert known_shape(local) is None and planning_model_path(local, tmp_path) == quickstart_model
    unknown = RunConfig.from_mapping(composed("+experiment=dapo_math_7b", "model.path=nobody/none"))
    with pytest.raises(ValueError, match=r"model.path=nobody/none is neither a local directory nor .*Qwen/Qwen2.5-7B"):
        planning_model_path(unknown, tmp_path)


def test_a_gpu_preset_is_planned_with_its_model_on_its_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    variant = composed("+experiment=dapo_math_7b_lora")
    [note] = plan_preset_defaults(variant)
    assert note.startswith("planned for the GPU node dapo_math_7b is made for (no CUDA here)")
    model, cluster = variant.model, variant.cluster
    assert (model.path, cluster.device, cluster.gpu_memory_gib) == ("Qwen/Qwen2.5-7B", "cuda", 80)
    own = composed("+experiment=reasoning_gym_hard_27b", "model.path=/models/mine", "cluster.device=cpu")
    assert plan_preset_defaults(own) == [] and (own.model.path, own.cluster.device) == ("/models/mine", "cpu")
    quickstart = composed()
    assert plan_preset_defaults(quickstart) == [] and quickstart.cluster.device == "auto"
