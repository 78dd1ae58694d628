"""Build frozen config dataclasses from plain mappings (Hydra nodes), rejecting unknown keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import OmegaConf

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any] | Any, prefix: str) -> T:
    """`cls(**values)` after checking every key is a field; the error names the dotted key and the valid ones."""
    if OmegaConf.is_config(values):
        values = OmegaConf.to_container(values, resolve=True)
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ValueError(f"config: {prefix.rstrip('.')} must be a mapping, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        valid = sorted(prefix + k for k in known)
        raise ValueError(f"config: unknown key(s) {[prefix + k for k in unknown]}; valid keys are {valid}")
    return cls(**values)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists become tuples, so a list and a tuple compare equal."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat
