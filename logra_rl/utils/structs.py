"""Config dataclasses: one set of validation helpers, one builder, one flattening. Pure Python, so the
pure-torch `logra` library uses them too; callers turn OmegaConf nodes into plain containers first.

Every error names the dotted key a user types as a Hydra override: `config: logra.rank=0 is invalid; ...`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def check(condition: bool, key: str, value: Any, rule: str) -> None:
    if not condition:
        raise ValueError(f"config: {key}={value!r} is invalid; {rule}")


def check_required(condition: bool, key: str, because: str) -> None:
    """A key the chosen config needs and leaves unset (`model=hf` without `model.path`)."""
    if not condition:
        raise ValueError(f"config: {key} is required by the chosen config ({because}); set it, e.g. {key}=...")


def check_positive_int(key: str, value: Any) -> None:
    check(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value, "give a positive integer")


def check_non_negative_int(key: str, value: Any, zero: str) -> None:
    """`zero` says what 0 means (e.g. "0: never")."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    check(ok, key, value, f"give an integer >= 0 ({zero})")


def check_positive(key: str, value: Any) -> None:
    check(isinstance(value, int | float) and math.isfinite(value) and value > 0, key, value, "must be > 0")


def check_fraction(key: str, value: Any) -> None:
    check(isinstance(value, int | float) and 0 < value <= 1, key, value, "must be in (0, 1]")


def check_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    check(value in choices, key, value, f"choose one of {list(choices)}")


def check_bool(key: str, value: Any) -> None:
    check(isinstance(value, bool), key, value, "must be true or false")


def check_module_names(key: str, value: Any) -> None:
    """A non-empty list of module leaf names (`q_proj`, ...), not one bare string."""
    ok = not isinstance(value, str) and bool(value) and all(isinstance(name, str) and name for name in value)
    check(ok, key, value, "give a non-empty list of module leaf names, e.g. [q_proj, v_proj]")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, prefix: str) -> T:
    """`cls(**values)` after checking every key is a field; the error names the dotted key and the valid ones."""
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ValueError(f"config: {prefix.rstrip('.')} must be a mapping, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        valid = sorted(prefix + k for k in known)
        raise ValueError(f"config: unknown key(s) {[prefix + k for k in unknown]}; valid keys are {valid}")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        check_type(prefix + key, value, hints[key])
    return cls(**values)


SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_type(key: str, value: Any, hint: Any) -> None:
    """A scalar field's value has its type (`trainer.seed=abc` names the key before anything reads it); an int is
    a float, a number a string, a bool not an int; `X | None` also takes null. Other types are left to the
    dataclass' checks."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    scalars = [option for option in options if option in SCALARS]
    if not scalars or (value is None and type(None) in options):
        return
    for option in scalars:
        # an int is a float; a number is a string (Hydra reads `trainer.run_name=7` as 7), which the field's own
        # check may still refuse
        if option in (float, str) and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if isinstance(value, option) and (option is bool or not isinstance(value, bool)):
            return
    wanted = " or ".join(SCALARS[option] for option in scalars) + (" or null" if type(None) in options else "")
    raise ValueError(f"config: {key}={value!r} is invalid; give {wanted}")


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists become tuples, so a list and a tuple compare equal."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat
