"""The Hydra tree and the config dataclasses stay in step; bad values fail with the key's name."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import logra_rl
from logra_rl.apps.cli import _check_resume, migrate_arguments
from logra_rl.config import RunConfig, defaults_mapping
from logra_rl.logra import KLController
from logra_rl.utils.renamed_keys import migrate_keys
from logra_rl.utils.structs import flatten

CONFIGS = Path(logra_rl.__file__).parent / "configs"


def compose_with(overrides):
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return compose("config", overrides=overrides)


def yaml_body(path):
    """A config file's keys as the root config sees them (its group's package, or the root with _global_)."""
    text = path.read_text()
    body = yaml.safe_load(text) or {}
    defaults = body.pop("defaults", [])
    if "# @package _global_" not in text:
        body = {path.parent.name: body}
    return flatten(body), defaults


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(CONFIGS) for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "experiment")
)
def test_no_group_option_restates_a_default(path):
    """Group options hold only what differs from the dataclasses' defaults, and only keys that exist."""
    body, defaults = yaml_body(CONFIGS / path)
    known = flatten(defaults_mapping())
    assert not defaults
    assert {k: v for k, v in body.items() if known.get(k, v) == v and k in known} == {}
    assert all(k in known or k.startswith("data.reasoning_gym.") for k in body), sorted(set(body) - set(known))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")))
def test_no_experiment_restates_what_it_overrides(experiment):
    """An experiment's own keys each change the config its defaults list (parent preset, group options) gives."""
    body, defaults = yaml_body(CONFIGS / "experiment" / f"{experiment}.yaml")
    overrides = []
    for entry in defaults:
        if isinstance(entry, str):
            overrides.append(f"+experiment={entry}")
        else:
            ((key, option),) = entry.items()
            overrides.append(f"{key.removeprefix('override /')}={option}")
    base = flatten(OmegaConf.to_container(compose_with(overrides), resolve=False))
    assert {k: v for k, v in body.items() if base.get(k) == v} == {}


def test_the_composed_config_is_the_whole_config():
    """`--cfg job` shows every key: the composed root config has exactly the dataclasses' keys."""
    cfg = OmegaConf.to_container(compose_with([]), resolve=False)
    assert set(flatten(cfg)) == set(flatten(defaults_mapping()))
    assert RunConfig.from_mapping(compose_with([])).logra.seed == 1  # the value the quickstart has always used


def test_a_misspelt_key_fails():
    with pytest.raises(ConfigCompositionException, match=r"trainer\.total_stepz"):
        compose_with(["trainer.total_stepz=3"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sync.bucket'\]"):
        RunConfig.from_mapping({"sync": {"bucket": 64}})


def test_run_config_gives_logra_the_models_targets_and_the_sync_chunking():
    config = RunConfig.from_mapping(compose_with(["model.target_modules=[q_proj,v_proj]", "sync.merge_chunk_rows=64"]))
    assert config.logra.target_modules == config.model.target_modules == ("q_proj", "v_proj")
    assert config.logra.merge_chunk_rows == 64


OLD_SAVED_CONFIG = {
    "experiment_name": "old",
    "rollout": {"eval_top_p": 0.7, "eval_samples": 8, "residual": "float32", "resync_bucket_mb": 64},
    "trainer": {"eval_every": 7},
    "logra": {"target_modules": ["q_proj", "v_proj"], "merge_chunk_rows": 256},
    "optimizer": {"lora_targets": ["q_proj", "v_proj"]},
}


def test_a_config_saved_under_the_old_key_names_reads_back(tmp_path):
    """A run's config.yaml from before the keys moved (what resume, logra-eval's export and logra-plot read)."""
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(OLD_SAVED_CONFIG))
    migrated, notes = migrate_keys(OmegaConf.to_container(OmegaConf.load(saved)))
    assert "rollout.eval_top_p is now eval.top_p" in notes and len(notes) == 8
    assert migrated["rollout"] == {} and migrated["trainer"] == {}
    config = RunConfig.from_mapping(OmegaConf.load(saved))
    assert (config.eval.top_p, config.eval.samples, config.eval.every) == (0.7, 8, 7)
    assert (config.sync.residual, config.sync.bucket_mb, config.sync.merge_chunk_rows) == ("float32", 64, 256)
    assert config.model.target_modules == config.logra.target_modules == ("q_proj", "v_proj")


def test_a_run_saved_under_the_old_key_names_resumes(tmp_path):
    """Resume compares the saved config.yaml, read in the new names, with the current one: no false conflict."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_2")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(OLD_SAVED_CONFIG))
    current, _ = migrate_keys(OLD_SAVED_CONFIG)
    _check_resume(tmp_path, current, "auto")  # exits on a conflict
    current["sync"]["residual"] = "tail"
    with pytest.raises(SystemExit, match=r"sync\.residual: 'float32' → 'tail'"):
        _check_resume(tmp_path, current, "auto")


@pytest.mark.parametrize(("rule", "read"), [("logra", ["q_proj"]), ("dense", ["q_proj"]), ("lora", ["v_proj"])])
def test_a_saved_run_reads_the_target_list_its_update_rule_read(rule, read):
    """Every run saved before the rename held both lists; where they differ, the one its rule trained wins."""
    values = {"logra": {"target_modules": ["q_proj"]}, "optimizer": {"name": rule, "lora_targets": ["v_proj"]}}
    migrated, notes = migrate_keys(values)
    assert migrated["model"]["target_modules"] == read
    assert "lora_targets" not in migrated["optimizer"] and "target_modules" not in migrated["logra"]
    assert any("differ" in note for note in notes)


def test_a_saved_run_named_by_the_old_experiment_key_loads():
    config = RunConfig.from_mapping({"experiment": "old_run"})
    assert config.experiment_name == "old_run"


def test_old_keys_on_the_command_line_are_rewritten():
    arguments = ["rollout=vllm", "trainer.eval_every=3", "++rollout.eval_top_p=0.5", "logra.rank=8", "--cfg", "job"]
    migrated, notes = migrate_arguments(arguments)
    assert migrated == ["rollout.backend=vllm", "eval.every=3", "++eval.top_p=0.5", "logra.rank=8", "--cfg", "job"]
    assert notes == [
        "rollout=vllm is now rollout.backend=vllm",
        "trainer.eval_every is now eval.every",
        "rollout.eval_top_p is now eval.top_p",
    ]
    config = RunConfig.from_mapping(compose_with(migrated[:4]))
    assert (config.rollout.backend, config.eval.every, config.eval.top_p) == ("vllm", 3, 0.5)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment):
    """Every preset validates once its documented overrides (model and data paths) are given."""
    overrides = [f"+experiment={experiment}"]
    cfg = compose_with(overrides)
    if cfg.model.path is None and cfg.model.builder is None:
        overrides.append("model.path=/models/demo")
    if cfg.data.task == "files" and not cfg.data.train_files:
        overrides.append("data.train_files=[/data/train.parquet]")
    config = RunConfig.from_mapping(compose_with(overrides))
    assert config.experiment_name == experiment
    assert config.optimizer.name == next((o for o in ("dense", "lora") if experiment.endswith(o)), "logra")
    if not experiment.startswith(("quickstart", "smollm2")):  # the 8-GPU node: 4 training GPUs + 4 rollout GPUs
        assert config.cluster.train_workers == 4
        assert config.rollout.num_engines * config.rollout.gpus_per_engine == 4


@pytest.mark.parametrize("preset", ["smollm2", "smollm2_arithmetic"])
def test_the_real_model_preset_and_its_baselines_run_the_same_job(preset):
    """A real-model preset and its tuned baselines (<preset>_dense, <preset>_lora) differ only in the update rule,
    so the method comparison compares rules; LoGRA's rank fits every target and each schedule spans the run."""
    config = RunConfig.from_mapping(compose_with([f"+experiment={preset}"]))
    toy = RunConfig.from_mapping(compose_with([]))
    assert config.model.builder == "smollm2" and config.rollout.backend == "vllm"
    assert config.logra.kl.budget < toy.logra.kl.budget and config.logra.update_ratio < toy.logra.update_ratio
    assert config.logra.rank <= 192  # k_proj / v_proj: 3 KV heads x 64
    assert config.logra.kl.schedule_steps == config.trainer.total_steps
    for rule in ("dense", "lora"):
        baseline = RunConfig.from_mapping(compose_with([f"+experiment={preset}_{rule}"]))
        assert baseline.optimizer.name == rule and baseline.optimizer.schedule_steps == baseline.trainer.total_steps
        same = ("model", "data", "rollout", "trainer", "cluster", "logra")
        assert all(getattr(baseline, part) == getattr(config, part) for part in same)
        assert baseline.algorithm == config.algorithm


def test_the_arithmetic_preset_is_smollm2_on_unseen_questions():
    """smollm2_arithmetic keeps smollm2's engine, batch and LoGRA rank and changes the task: sums and differences
    of numbers up to 100, its eval only questions its train set does not ask, over 60 steps."""
    smollm2 = RunConfig.from_mapping(compose_with(["+experiment=smollm2"]))
    config = RunConfig.from_mapping(compose_with(["+experiment=smollm2_arithmetic"]))
    assert config.data.reasoning_gym["datasets"] == ["basic_arithmetic"]
    assert set(config.data.reasoning_gym["config"]) == {"basic_arithmetic"}  # nothing merged in from smollm2
    assert config.data.eval_unseen and config.trainer.total_steps == 60
    assert (config.model, config.rollout, config.algorithm, config.eval) == (
        smollm2.model,
        smollm2.rollout,
        smollm2.algorithm,
        smollm2.eval,
    )
    kl = dataclasses.replace(  # its own sweep; the bf16 engine's mismatch is a large share of this smaller budget
        smollm2.logra.kl, budget=1e-2, final_budget=2.5e-3, schedule_steps=60, mismatch_subtraction=False
    )
    assert config.logra == dataclasses.replace(smollm2.logra, kl=kl)


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
        (
            ["model=hf", "model.path=/models/any", "model.quickstart_copy_share=0.5"],
            "model.quickstart_copy_share=0.5 is invalid; it shapes only the quickstart's own base model",
        ),
        (["model=smollm2", "model.quickstart_format_steps=600"], "this run loads model.builder=smollm2"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_mapping(compose_with(overrides))


def test_unknown_top_level_key():
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['trainr'\]"):
        RunConfig.from_mapping({"trainr": {}})


@pytest.mark.parametrize("preset", ["dapo_math_1p5b", "dapo_math_7b", "reasoning_gym_hard_27b"])
def test_the_gpu_presets_one_step_off_bound_staleness_above_their_bf16_numerics(preset):
    """Composed with algorithm.max_staleness=1 each GPU preset starts, and its default bound sits above 3× the bf16
    trainer-vs-vLLM KL (~2e-3 per token, docs/benchmarks.md) from step 0 to the budget schedule's end, where a bound
    tied to the initial budget (6e-4 / 4.5e-4 before) would have refused every stale batch."""
    overrides = [f"+experiment={preset}", "algorithm.max_staleness=1", "model.path=/models/any"]
    config = RunConfig.from_mapping(compose_with(overrides))
    assert config.algorithm.staleness_kl is None
    controller = KLController(config.logra.kl)
    controller.observe_numerics(2e-3)  # step 0's behaviour KL: the numerics alone
    for update in (1, config.logra.kl.schedule_steps or 1, 10 * config.trainer.total_steps):
        assert controller.staleness_bound(update, config.algorithm.epochs) > 3 * 2e-3


def test_a_staleness_bound_set_below_the_updates_or_the_measured_numerics_is_refused():
    """algorithm.staleness_kl null: the bound follows the budget and the measured numerics (KLController); a bound a
    LoGRA run sets below what the updates a batch is behind may move the policy would sample every stale batch
    again: refused at once; one below twice the behaviour KL measured at step 0 (the engines' numerics alone): refused
    then, naming the measurement. max_staleness is 0 or 1."""
    quickstart = RunConfig.from_mapping(compose_with(["algorithm.max_staleness=1"]))
    assert quickstart.algorithm.staleness_kl is None
    with pytest.raises(ValueError, match=r"algorithm.staleness_kl=0.1 .* raise it to at least 0.15"):
        RunConfig.from_mapping(compose_with(["algorithm.max_staleness=1", "algorithm.staleness_kl=0.1"]))
    dense = ["optimizer=dense", "algorithm.max_staleness=1", "algorithm.staleness_kl=0.01"]
    algorithm = RunConfig.from_mapping(compose_with(dense)).algorithm
    assert algorithm.staleness_kl == 0.01  # no KL budget to check against
    algorithm.check_staleness_bound(0.005)
    with pytest.raises(ValueError, match=r"staleness_kl=0.01 is below twice .* at step 0 \(0.006 per token.* 0.024"):
        algorithm.check_staleness_bound(0.006)
    dataclasses.replace(algorithm, max_staleness=0).check_staleness_bound(1.0)  # synchronous: never read
    for value in (-1, 2):
        with pytest.raises(ValueError, match=r"algorithm\.max_staleness=.* give 0 .* or 1"):
            RunConfig.from_mapping(compose_with([f"algorithm.max_staleness={value}"]))
