"""The applications: the console scripts (`[project.scripts]` in pyproject.toml) and the benchmarks' helpers.

The top floor of the package (docs/architecture.md, "Floors"): code here may import any part of `logra_rl`, and
no part imports it. Nothing is imported here: `logra-gpu-check` runs without Hydra, OmegaConf or Ray."""
