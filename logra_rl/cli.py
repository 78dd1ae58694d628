"""Console scripts: `logra-train` (the Controller), `logra-eval` (the eval driver: pass@k of a model or
checkpoint), `logra-plot`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from logra_rl.config import RunConfig

CONFIGS = Path(__file__).parent / "configs"


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def check_overrides(arguments: list[str]) -> str | None:
    """One line naming a misspelt key, group option or experiment and what exists (Hydra does not list keys)."""
    from logra_rl.config import RunConfig

    groups = [path.name for path in CONFIGS.iterdir() if path.is_dir() and path.name != "__pycache__"]
    for argument in arguments:
        if argument.startswith("-") or "=" not in argument:
            continue
        key, value = argument.split("=", 1)
        key = key.lstrip("+~")
        if key in groups:
            if value not in _options(key):
                return f"unknown {key} {value!r}; choose one of {_options(key)}"
            continue
        if key.startswith("hydra.") or key == "experiment":
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


def _run_setup(cfg: DictConfig, program: str) -> tuple[RunConfig, Path, dict]:
    """The validated config (one line and exit on a bad value), the run directory, the resolved mapping."""
    from logra_rl.config import RunConfig

    try:
        config = RunConfig.from_mapping(cfg)
    except ValueError as error:
        sys.exit(f"{program}: {error}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return config, run_dir, OmegaConf.to_container(cfg, resolve=True)


def _train(cfg: DictConfig) -> None:
    from logra_rl.orchestration.controller import Controller

    config, run_dir, resolved = _run_setup(cfg, "logra-train")
    _check_resume(run_dir, resolved, config.trainer.resume)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    print(f"[logra-train] experiment {config.experiment}, run directory {run_dir}")
    if HydraConfig.get().mode == RunMode.RUN:  # a sweep's jobs are resumed by rerunning the sweep
        print(f"[logra-train] to resume after an interruption, rerun with trainer.run_name={config.trainer.run_name}")
    try:
        Controller(config, run_dir, resolved).run()
    except Exception as error:
        _exit_with_one_line(error)


def _check_resume(run_dir: Path, resolved: dict, resume: str) -> None:
    """Refuse to auto-resume a run directory whose checkpoints were made with another configuration."""
    from logra_rl.utils.checkpoint import resume_conflicts

    saved = run_dir / "config.yaml"
    if resume != "auto" or not (run_dir / "checkpoints" / "latest").exists() or not saved.exists():
        return
    conflicts = resume_conflicts(OmegaConf.to_container(OmegaConf.load(saved)), resolved)
    if conflicts:
        sys.exit(
            f"logra-train: {run_dir} holds a run made with other settings ({'; '.join(conflicts[:4])}); start a "
            "new run with trainer.run_name=NAME, or continue from its weights with trainer.resume=<checkpoint dir>"
        )


USER_ERRORS = (ValueError, TypeError, FileNotFoundError, OSError)


def _exit_with_one_line(error: Exception, program: str = "logra-train") -> None:
    """A configuration or data problem (also when raised inside a Ray worker) is one line; anything else a traceback."""
    cause = getattr(error, "cause", None) if type(error).__name__.startswith("RayTaskError") else error
    if isinstance(cause, USER_ERRORS) and not os.environ.get("LOGRA_TRACEBACK"):
        sys.exit(f"{program}: {type(cause).__name__}: {cause}  (LOGRA_TRACEBACK=1 shows the traceback)")
    raise error


def _eval(cfg: DictConfig) -> None:
    """Evaluate model.path (or eval.checkpoint) on the data's eval split with the configured engines."""
    from logra_rl.orchestration.eval_driver import evaluate

    config, run_dir, _ = _run_setup(cfg, "logra-eval")
    try:
        metrics = evaluate(config, run_dir)
    except Exception as error:
        _exit_with_one_line(error, "logra-eval")
    (run_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    for name, value in sorted(metrics.items()):
        print(f"{name:<50} {value:.4f}")
    print(f"[logra-eval] graded samples: {run_dir / 'eval'}/  metrics: {run_dir / 'eval_metrics.json'}")


train = hydra.main(config_path="configs", config_name="config", version_base=None)(_train)
evaluate = hydra.main(config_path="configs", config_name="config", version_base=None)(_eval)


def _entry(app, name: str) -> None:
    import transformers

    transformers.logging.disable_progress_bar()
    problem = check_overrides(sys.argv[1:])
    if problem:
        sys.exit(f"{name}: {problem}")
    if not any(argument.startswith("hydra.job.name=") for argument in sys.argv[1:]):
        sys.argv.append(f"hydra.job.name={name}")  # names the help text and the run's log file
    app()


def main() -> None:
    _entry(train, "logra-train")


def eval_main() -> None:
    _entry(evaluate, "logra-eval")


def plot() -> None:
    from logra_rl.utils.plot import plot_main

    sys.exit(plot_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
