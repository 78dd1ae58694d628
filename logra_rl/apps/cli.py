"""Console scripts: `logra-train` (the Controller), `logra-eval` (the eval driver: pass@k of a model or
checkpoint), `logra-plan` (the memory plan of a run, nothing started), `logra-plot`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from logra_rl.config import RunConfig
    from logra_rl.utils.run_dir import RunLock

CONFIGS = Path(__file__).parents[1] / "configs"


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


# Config groups that became one key: `rollout=vllm` is now `rollout.backend=vllm`.
RENAMED_GROUPS = {"rollout": "rollout.backend"}


def migrate_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """The command line with old key names (RENAMED_KEYS, RENAMED_GROUPS) in the new ones, and a note per change."""
    from logra_rl.utils.renamed_keys import RENAMED_KEYS

    migrated, notes = [], []
    for argument in arguments:
        key, equals, value = argument.partition("=")
        name = key.lstrip("+~")
        if not argument.startswith("-") and equals and name in RENAMED_GROUPS:
            new = f"{RENAMED_GROUPS[name]}={value}"
            notes.append(f"{argument} is now {new}")
            argument = new
        elif not argument.startswith("-") and name in RENAMED_KEYS:
            notes.append(f"{name} is now {RENAMED_KEYS[name]}")
            argument = key.replace(name, RENAMED_KEYS[name]) + equals + value
        migrated.append(argument)
    return migrated, notes


def check_overrides(arguments: list[str]) -> str | None:
    """One line naming a misspelt key, group option or experiment and what exists (Hydra does not list keys)."""
    from logra_rl.config import RunConfig

    groups = [path.name for path in CONFIGS.iterdir() if path.is_dir() and path.name != "__pycache__"]
    for argument in arguments:
        if argument.startswith("-") or "=" not in argument:
            continue
        key, value = argument.split("=", 1)
        if key == "experiment":
            return (
                f"experiment={value} picks a preset, which is added with a +: +experiment={value} "
                f"(to name your own run's directory: experiment_name={value})"
            )
        key = key.lstrip("+~")
        if key in groups:
            if value not in _options(key):
                return f"unknown {key} {value!r}; choose one of {_options(key)}"
            continue
        if key.startswith(("hydra.", "hydra/")):
            continue
        node, path = RunConfig(), []
        for part in key.split("."):
            if not dataclasses.is_dataclass(node):
                break  # free-form mappings (e.g. data.reasoning_gym) accept any key
            names = [field.name for field in dataclasses.fields(node)]
            if part not in names:
                where = ".".join(path) or "the config"
                return f"unknown key {key!r}: {where} has {sorted(names)}"
            node, path = getattr(node, part), [*path, part]
    return None


def _run_setup(
    cfg: DictConfig, program: str, check: Callable[[DictConfig], str | None] | None = None
) -> tuple[RunConfig, Path, dict, bool]:
    """The validated config (one line and exit on a bad value or a `check` problem, leaving no run directory
    behind), the run directory, the resolved mapping, and whether the directory is fresh (it held nothing but
    Hydra's empty log: a run rejected at start-up removes it again)."""
    from logra_rl.config import RunConfig
    from logra_rl.utils.renamed_keys import migrate_keys
    from logra_rl.utils.run_dir import only_logs

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = not run_dir.exists() or only_logs(run_dir)
    try:
        config = RunConfig.from_mapping(cfg)
        problem = check(HydraConfig.get()) if check else None
    except ValueError as error:
        problem = str(error)
    if problem:
        if fresh:
            _discard(run_dir)
        sys.exit(f"{program}: {problem}")
    resolved, notes = migrate_keys(OmegaConf.to_container(cfg, resolve=True))  # old keys in a user's own YAML
    for note in notes:
        print(f"[{program}] {note}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return config, run_dir, resolved, fresh


def _discard(run_dir: Path) -> None:
    """Remove a rejected run's fresh directory, under its lock (a run that holds it keeps it)."""
    from logra_rl.utils.run_dir import RunDirInUse, RunLock, may_remove, remove_unused

    if not may_remove(run_dir):
        return
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except (RunDirInUse, OSError):
        return
    try:
        remove_unused(run_dir, _keep_above or run_dir.parent)
    finally:
        lock.release()


def _train(cfg: DictConfig) -> None:
    from logra_rl.utils.run_dir import write_atomic

    config, run_dir, resolved, fresh = _run_setup(cfg, "logra-train", toy_settings_problem)
    from logra_rl.orchestration.controller import started  # seconds of imports: after the settings are checked

    with _run_lock(run_dir, fresh, "logra-train") as lock:
        _check_resume(run_dir, resolved, config.trainer.resume)  # before anything is written
        lock.announce()
        try:
            write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(resolved))
            print(f"[logra-train] experiment {config.experiment_name}, run directory {run_dir}")
            schedule = lr_schedule_note(config)
            if schedule:
                print(f"[logra-train] {schedule}")
            command = ""
            if HydraConfig.get().mode == RunMode.RUN:  # a sweep's jobs are resumed by rerunning the sweep
                command = resume_command(sys.argv[1:], config.trainer.run_name)
                name = config.trainer.run_name
                print(f"[logra-train] to resume after an interruption, rerun with trainer.run_name={name}")
            with started(config, run_dir, resolved, resume_command=command) as controller:
                controller.run()
        except Exception as error:
            _exit_with_one_line(error)


@contextlib.contextmanager
def _run_lock(run_dir: Path, fresh: bool, program: str) -> Iterator[RunLock]:
    """The run directory's lock for the block (one line and exit when another run holds it, or the directory
    cannot be written); a fresh directory is removed again, still under the lock, when the run ends before it
    recorded anything (a run rejected at start-up)."""
    from logra_rl.utils.run_dir import RunDirInUse, RunLock, remove_unused

    lock = RunLock(run_dir, [argument for argument in sys.argv if not argument.startswith("hydra.job.name=")])
    try:
        lock.acquire()
    except RunDirInUse as error:
        sys.exit(f"{program}: {error}")
    except OSError as error:
        sys.exit(f"{program}: cannot write the run directory {run_dir} ({error.strerror}); set trainer.output_dir")
    try:
        yield lock
    finally:
        if fresh:
            remove_unused(run_dir, _keep_above or run_dir.parent)
        lock.release()


def resume_command(arguments: list[str], run_name: str) -> str:
    """The command line that continues this run: the user's arguments with the run's name pinned (a
    timestamped default would name a new run)."""
    import shlex

    # trainer.resume=never or =<checkpoint> would start again or go back: the default (auto) continues
    kept = [a for a in arguments if not a.startswith(("hydra.job.name=", "trainer.run_name=", "trainer.resume="))]
    return shlex.join(["logra-train", *kept, f"trainer.run_name={run_name}"])


def lr_schedule_note(config: RunConfig) -> str | None:
    """The AdamW schedule of a dense / LoRA run that is shorter than it: such a run never reaches (or never
    leaves) the learning rate it was given, which a user of a short run should hear before it starts."""
    from logra_rl.train.optimizers import dense_lr_factor, update_rule_class

    optimizer, steps = config.optimizer, config.trainer.total_steps
    if not update_rule_class(config).lr_schedule or optimizer.schedule_steps <= steps:
        return None
    return (
        f"optimizer={optimizer.name}: lr {optimizer.lr:g} after {optimizer.warmup_steps} warm-up steps, cosine to "
        f"{optimizer.min_lr_ratio:g}x over optimizer.schedule_steps={optimizer.schedule_steps}, but the run has "
        f"{steps} steps (its last step has lr x{dense_lr_factor(steps - 1, optimizer):.2f}); set "
        f"optimizer.schedule_steps={steps} to fit the schedule to the run"
    )


def toy_settings_problem(hydra_config: DictConfig) -> str | None:
    """Why a run on a real model would silently get the quickstart's toy settings, or None.

    The root config's defaults are the tiny quickstart model's (a LoGRA KL budget hundreds of times a
    pre-trained model's), so a run that swaps in `model=hf` but picks no experiment must choose its settings
    on purpose."""
    choices, overrides = hydra_config.runtime.choices, list(hydra_config.overrides.task)
    if choices.get("experiment") is not None or choices.get("model") == "quickstart":
        return None
    presets = ", ".join(
        f"+experiment={name}" for name in _options("experiment") if name not in ("quickstart", "smollm2")
    )
    if choices.get("logra") == "quickstart" and "logra=quickstart" not in overrides:
        return (
            "a pre-trained model with no experiment would get the CPU quickstart's toy LoGRA settings (logra="
            "quickstart: a KL budget and update ratio sized for a random-init toy, hundreds of times a pre-trained "
            "model's). Pick a preset (+experiment=smollm2 on a CPU; "
            f"{presets}), or the paper's settings with logra=default experiment_name=NAME, or keep the toy's on "
            "purpose with logra=quickstart"
        )
    named = any(override.startswith("experiment_name=") for override in overrides)
    if not named and choices.get("logra") != "quickstart":
        return "name this run's directory (outputs/<experiment_name>/...): add experiment_name=NAME"
    return None


def _check_resume(run_dir: Path, resolved: dict, resume: str) -> None:
    """Refuse, changing nothing, to auto-resume a run directory whose checkpoints were made with another
    configuration, or none of whose checkpoints can be resumed: starting over would replace its history."""
    from logra_rl.utils.checkpoint import Checkpoints, resume_conflicts
    from logra_rl.utils.renamed_keys import migrate_keys

    if resume != "auto":
        return
    checkpoints = Checkpoints(run_dir, keep=1)
    usable, damaged = checkpoints.resumable()
    if usable is None and checkpoints.committed():
        found = "; ".join(line.removesuffix("; skipped") for line in damaged) or (
            f"{len(checkpoints.committed())} checkpoints, none named by checkpoints/latest"
        )
        sys.exit(
            f"logra-train: {run_dir} holds a run that cannot be resumed ({found}); nothing was changed. Start it "
            "over on purpose with trainer.resume=never (its records and checkpoints are replaced), start a new run "
            "with trainer.run_name=NAME, or go back to a checkpoint you trust with trainer.resume=<checkpoint dir>"
        )
    saved = run_dir / "config.yaml"
    if not (checkpoints.root / "latest").exists() or not saved.exists():
        return
    conflicts = resume_conflicts(migrate_keys(OmegaConf.to_container(OmegaConf.load(saved)))[0], resolved)
    if conflicts:
        sys.exit(
            f"logra-train: {run_dir} holds a run made with other settings ({'; '.join(conflicts[:4])}); start a "
            "new run with trainer.run_name=NAME, or continue from its weights with trainer.resume=<checkpoint dir>"
        )


USER_ERRORS = (ValueError, TypeError, FileNotFoundError, OSError)


def _exit_with_one_line(error: Exception, program: str = "logra-train") -> None:
    """A configuration or data problem (also when raised inside a Ray worker) is one line; anything else a traceback."""
    from logra_rl.orchestration.cluster import GroupLost  # faults the run could not heal: one line too
    from logra_rl.orchestration.controller import TrainFailure
    from logra_rl.orchestration.rollout_group import EngineFailure
    from logra_rl.utils.run_dir import no_space

    full = no_space(error)
    if full is not None and not os.environ.get("LOGRA_TRACEBACK"):
        where = f" writing {full.filename}" if full.filename else ""
        sys.exit(
            f"{program}: no space left on the device{where}; what was being written was dropped and the run's "
            "complete checkpoints are kept: free some space (or set trainer.output_dir to another disk) and rerun "
            "the same command to resume"
        )
    cause = getattr(error, "cause", None) if type(error).__name__.startswith("RayTaskError") else error
    faults = (EngineFailure, GroupLost, TrainFailure)
    if isinstance(cause, (*USER_ERRORS, *faults)) and not os.environ.get("LOGRA_TRACEBACK"):
        sys.exit(f"{program}: {type(cause).__name__}: {cause}  (LOGRA_TRACEBACK=1 shows the traceback)")
    raise error


def _eval(cfg: DictConfig) -> None:
    """Evaluate model.path (or eval.checkpoint) on the data's eval split with the configured engines."""
    from logra_rl.utils.run_dir import write_atomic

    config, run_dir, _, fresh = _run_setup(cfg, "logra-eval")
    from logra_rl.orchestration.eval_driver import run_eval  # seconds of imports: after the settings are checked

    with _run_lock(run_dir, fresh, "logra-eval") as lock:
        lock.announce()
        try:
            metrics = run_eval(config, run_dir)
            write_atomic(run_dir / "eval_metrics.json", json.dumps(metrics, indent=2))
        except Exception as error:
            _exit_with_one_line(error, "logra-eval")
    for name, value in sorted(metrics.items()):
        print(f"{name:<50} {value:.4f}")
    print(f"[logra-eval] graded samples: {run_dir / 'eval'}/  metrics: {run_dir / 'eval_metrics.json'}")


def _plan(cfg: DictConfig) -> None:
    """Print the memory plan of a run (as `logra-train` would start it) without starting anything; exit 1 when
    it does not fit. Plan a GPU node from any machine with cluster.device=cuda cluster.gpu_memory_gib=80."""
    import tempfile

    from rich.console import Console

    from logra_rl.config import RunConfig
    from logra_rl.data import load_workload
    from logra_rl.models.loading import known_shape, plan_preset_defaults, planning_model_path
    from logra_rl.orchestration.memory_plan import RUN_ANYWAY, machine_of, memory_problem, plan_memory, plan_table

    unread = None
    try:
        notes = plan_preset_defaults(cfg)
        config = RunConfig.from_mapping(cfg)
        with tempfile.TemporaryDirectory() as scratch:
            model_path = planning_model_path(config, Path(scratch))
            if known_shape(config) is not None:  # a config alone: no weights, no tokenizer to size the prompts with
                notes.append(f"planned from the known shape of {config.model.path}; no weights read")
                prompt_tokens, unread = None, "a known shape has no tokenizer"
            else:
                try:
                    prompt_tokens = load_workload(config.data, model_path).longest_prompt
                except Exception as error:  # a config-only model directory, or data this machine cannot read
                    prompt_tokens, unread = None, f"{type(error).__name__}: {str(error)[:120]}"
            machine = machine_of(config)
            plan = plan_memory(config, model_path, machine, prompt_tokens)
            problem = memory_problem(plan, config, model_path, machine, prompt_tokens)
    except Exception as error:
        _exit_with_one_line(error, "logra-plan")
    console = Console(highlight=False)
    console.print(plan_table(plan, machine))
    if unread:
        length = config.data.max_prompt_length
        console.print(f"- prompts sized at data.max_prompt_length={length}: the data was not read ({unread})")
    for note in [*notes, *plan.notes]:
        console.print(f"- {note}")
    if problem:
        sys.exit(f"logra-plan: {problem}. logra-train stops there ({RUN_ANYWAY})")


train = hydra.main(config_path="../configs", config_name="config", version_base=None)(_train)
evaluate = hydra.main(config_path="../configs", config_name="config", version_base=None)(_eval)
plan_run = hydra.main(config_path="../configs", config_name="config", version_base=None)(_plan)


HELP = {
    "logra-train": """logra-train: RL post-training of LLMs with LoGRA (docs/training.md).

logra-train                                  the CPU quickstart
logra-train +experiment=dapo_math_7b model.path=DIR data.train_files=[F] data.val_files=[F]
logra-train -m trainer.seed=1,2,3            a sweep, one run directory per job
A rerun under the same trainer.run_name resumes from its latest checkpoint; logra-export takes the model away.""",
    "logra-eval": """logra-eval: pass@k of a model or a run's checkpoint on the data's eval split (docs/training.md).

logra-eval model=hf model.path=DIR data=math             a model directory
logra-eval +experiment=smollm2 eval.checkpoint=outputs/smollm2/run/checkpoints/step_20
                                                         a checkpoint, with the trainer's eval seed for its step
Graded samples go to <run directory>/eval/, the metrics to eval_metrics.json beside them.""",
    "logra-plan": """logra-plan: the memory plan of a run, per process, without starting anything.
Exits 1 when the run does not fit.

logra-plan                                         the CPU quickstart on this machine
logra-plan +experiment=dapo_math_7b                a GPU preset, from its model's known shape (no weights needed)
logra-plan +experiment=smollm2 cluster.device=cuda cluster.gpu_memory_gib=80   another machine""",
}


def help_header(command: str) -> str:
    """The `--help` header of `command` (configs/config.yaml reads it by the job's name)."""
    return HELP.get(command, HELP["logra-train"]) + "\n"


def _entry(app, name: str) -> None:
    from omegaconf import OmegaConf

    # transformers' and the hub's progress bars off, as transformers.logging.disable_progress_bar() would turn them,
    # without importing transformers (seconds) in a command that a bad setting stops
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    OmegaConf.register_new_resolver("logra_help", help_header, replace=True)
    sys.argv[1:], notes = migrate_arguments(sys.argv[1:])
    for note in notes:
        print(f"[{name}] {note}")
    problem = check_overrides(sys.argv[1:])
    if name != "logra-plan":  # a plan writes nothing
        problem = problem or output_dir_problem(sys.argv[1:])
    if problem:
        sys.exit(f"{name}: {problem}")
    global _keep_above
    key, directory = output_override(sys.argv[1:])
    if "${" not in directory:
        output = Path(directory).absolute()
        _keep_above = output.parent if key == "hydra.run.dir" or not output.exists() else output
    if not any(argument.startswith("hydra.job.name=") for argument in sys.argv[1:]):
        sys.argv.insert(_override_position(sys.argv), f"hydra.job.name={name}")  # names the help and log file
    app()


def output_override(arguments: list[str]) -> tuple[str, str]:
    """The key that places the run directory (`hydra.run.dir` when given, else `trainer.output_dir`) and its value."""
    values = dict(argument.split("=", 1) for argument in arguments if "=" in argument and not argument.startswith("-"))
    key = "hydra.run.dir" if "hydra.run.dir" in values else "trainer.output_dir"
    return key, values.get(key, "outputs")


# The directory a rejected run's removals stop below (`_discard`, `_run_lock`): `trainer.output_dir` when it existed
# before this process, else its parent (Hydra made it for this run); with `hydra.run.dir`, the run directory's parent.
_keep_above: Path | None = None


def output_dir_problem(arguments: list[str]) -> str | None:
    """Why the run directory could not be made where the overrides put it (Hydra makes it before the config is
    read, and would fail with its own traceback), found by making and removing a directory there."""
    import tempfile

    key, directory = output_override(arguments)
    if "${" in directory:  # an interpolation: Hydra resolves it
        return None
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".logra-write-check-")).rmdir()
    except OSError as error:
        return (
            f"cannot make the run directory under {key}={directory} ({existing}: {error.strerror}); set {key} to "
            "a writable directory"
        )
    return None


def _override_position(argv: list[str]) -> int:
    """Where one more override can go: beside the user's (argparse takes the overrides as one run of
    positionals, so `a=1 --cfg job b=2` is an error), or at the end when there are none."""
    for index, argument in enumerate(argv[1:], start=1):
        if "=" in argument and not argument.startswith("-"):
            return index
    return len(argv)


def main() -> None:
    _entry(train, "logra-train")


def eval_main() -> None:
    _entry(evaluate, "logra-eval")


def plan_main() -> None:
    position = _override_position(sys.argv)  # a plan writes nothing: no run directory, no log file
    sys.argv[position:position] = ["hydra.run.dir=.", "hydra/job_logging=none"]
    _entry(plan_run, "logra-plan")


def plot() -> None:
    from logra_rl.apps.plot import plot_main

    sys.exit(plot_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
