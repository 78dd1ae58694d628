"""The Hydra tree and the config dataclasses stay in step; bad values fail with the key's name."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import logra_rl
from logra_rl.config import RunConfig

CONFIGS = Path(logra_rl.__file__).parent / "configs"


def compose_with(overrides):
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return compose("config", overrides=overrides)


def field_names(cls):
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(CONFIGS) for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "experiment")
)
def test_every_group_option_sets_every_key_of_its_dataclass(path):
    group, option = path.parent.name, path.stem
    cfg = compose_with([f"{group}={option}"])
    node = OmegaConf.to_container(cfg[group])
    cls = {f.name: f for f in dataclasses.fields(RunConfig)}[group].default_factory
    assert set(node) == field_names(cls), f"{path}: keys differ from {cls.__name__}'s fields"
    if group == "logra":
        assert set(node["kl"]) == field_names(type(cls().kl))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment):
    """Every preset validates once its documented overrides (model and data paths) are given."""
    overrides = [f"+experiment={experiment}"]
    cfg = compose_with(overrides)
    if OmegaConf.is_missing(cfg.model, "path"):
        overrides.append("model.path=/models/demo")
    if OmegaConf.is_missing(cfg.data, "train_files"):
        overrides.append("data.train_files=[/data/train.parquet]")
    config = RunConfig.from_mapping(compose_with(overrides))
    assert config.experiment_name == experiment
    assert config.optimizer.name == next((o for o in ("dense", "lora") if experiment.endswith(o)), "logra")
    if not experiment.startswith(("quickstart", "smollm2")):  # the 8-GPU node: 4 training GPUs + 4 rollout GPUs
        assert config.cluster.train_workers == 4
        assert config.rollout.num_engines * config.rollout.gpus_per_engine == 4


def test_the_real_model_preset_and_its_baselines_run_the_same_job():
    """smollm2 and its tuned baselines (smollm2_dense, smollm2_lora) differ only in the update rule, so the
    method comparison compares rules; LoGRA's rank fits every target and each schedule spans the run."""
    config = RunConfig.from_mapping(compose_with(["+experiment=smollm2"]))
    toy = RunConfig.from_mapping(compose_with([]))
    assert config.model.builder == "smollm2" and config.rollout.backend == "vllm"
    assert config.logra.kl.budget < toy.logra.kl.budget and config.logra.update_ratio < toy.logra.update_ratio
    assert config.logra.rank <= 192  # k_proj / v_proj: 3 KV heads x 64
    assert config.logra.kl.schedule_steps == config.trainer.total_steps
    for rule in ("dense", "lora"):
        baseline = RunConfig.from_mapping(compose_with([f"+experiment=smollm2_{rule}"]))
        assert baseline.optimizer.name == rule and baseline.optimizer.schedule_steps == baseline.trainer.total_steps
        same = ("model", "data", "rollout", "algorithm", "trainer", "cluster", "logra")
        assert all(getattr(baseline, part) == getattr(config, part) for part in same)


def test_default_is_the_quickstart():
    config = RunConfig.from_mapping(compose_with([]))
    assert config.experiment_name == config.model.builder == config.data.task == "quickstart"
    assert (config.cluster.train_workers, config.rollout.num_engines, config.optimizer.name) == (2, 1, "logra")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["logra.rank=0"], "config: logra.rank=0 is invalid"),
        (["rollout.top_p=1.5"], "rollout.top_p=1.5 is invalid"),
        (["optimizer.name=sgd"], "optimizer.name='sgd' is invalid"),
        (["cluster.train_workers=0"], "cluster.train_workers=0 is invalid"),
        (["algorithm.epochs=3"], "several epochs need PPO clipping"),
        (["model=hf"], "config: model.path is required by the chosen config"),
        (["algorithm=grpo"], "GRPO compares responses within a group: set rollout.n >= 2"),
        (["algorithm.clip_low=1.5"], "algorithm.clip_low=1.5 is invalid"),
        (["logra.kl.probe_max_tokens=32"], "must exceed data.max_prompt_length (64)"),
        (["trainer.prompts_per_step=1"], "each of the 2 train workers needs at least one response"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_mapping(compose_with(overrides))


def test_unknown_top_level_key():
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['trainr'\]"):
        RunConfig.from_mapping({"trainr": {}})
