"""The one set of config helpers: errors name the dotted key a user types; flattening compares lists and tuples."""

from dataclasses import dataclass, field

import pytest

from logra_rl.utils.structs import check_choice, check_positive_int, flatten, from_mapping


@dataclass(frozen=True)
class Inner:
    budget: float = 1.0


@dataclass(frozen=True)
class Outer:
    rank: int = 4
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        check_positive_int("outer.rank", self.rank)
        if isinstance(self.inner, dict):
            object.__setattr__(self, "inner", from_mapping(Inner, self.inner, "outer.inner."))


def test_from_mapping_names_unknown_keys_with_their_prefix():
    assert from_mapping(Outer, {"rank": 2, "inner": {"budget": 3.0}}, "outer.") == Outer(2, Inner(3.0))
    assert from_mapping(Outer, None, "outer.") == Outer()
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['outer.rnak'\]; valid keys are \['outer.inner', 'outer.rank'\]"
    ):
        from_mapping(Outer, {"rnak": 2}, "outer.")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['outer.inner.budjet'\]"):
        from_mapping(Outer, {"inner": {"budjet": 2}}, "outer.")
    with pytest.raises(ValueError, match=r"config: outer must be a mapping, got 3"):
        from_mapping(Outer, 3, "outer.")


def test_checks_name_the_key_and_the_rule():
    with pytest.raises(ValueError, match=r"^config: outer.rank=0 is invalid; give a positive integer$"):
        Outer(rank=0)
    with pytest.raises(ValueError, match=r"outer.rank=True is invalid"):  # a bool is not a count
        Outer(rank=True)
    with pytest.raises(ValueError, match=r"config: a.b='x' is invalid; choose one of \['y', 'z'\]"):
        check_choice("a.b", "x", ("y", "z"))


def test_flatten_uses_dotted_keys_and_treats_lists_as_tuples():
    nested = {"logra": {"rank": 8, "target_modules": ["q_proj", "v_proj"], "kl": {"budget": 1e-4}}, "seed": 1}
    assert flatten(nested) == {
        "logra.rank": 8,
        "logra.target_modules": ("q_proj", "v_proj"),
        "logra.kl.budget": 1e-4,
        "seed": 1,
    }
    assert flatten({"a": ["x"]}) == flatten({"a": ("x",)})
