"""Console scripts. `logra-train` composes the Hydra config and runs the Controller."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


def _train(cfg: DictConfig) -> None:
    from logra_rl.config import RunConfig
    from logra_rl.orchestration.controller import Controller

    try:
        config = RunConfig.from_mapping(cfg)
    except ValueError as error:
        sys.exit(f"logra-train: {error}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    print(f"[logra-train] experiment {config.experiment}, run directory {run_dir}")
    Controller(config, run_dir, resolved).run()


train = hydra.main(config_path="configs", config_name="config", version_base=None)(_train)


def main() -> None:
    train()


if __name__ == "__main__":
    main()
