"""Hydra's config tree. Every key's default comes from the dataclasses in `logra_rl.config`, registered here as
`run_defaults`, the first entry of config.yaml's defaults list; the YAML files hold only what differs from it."""

from hydra.core.config_store import ConfigStore

from logra_rl.config import defaults_mapping

ConfigStore.instance().store(name="run_defaults", node=defaults_mapping())
