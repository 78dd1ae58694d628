"""Which modules LoGRA trains: nn.Linear layers picked by the last component of their name."""

from __future__ import annotations

from torch import nn


def find_targets(model: nn.Module, target_modules: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """Modules whose last name component is in `target_modules`; they must be nn.Linear."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in target_modules:
            if not isinstance(module, nn.Linear):
                raise TypeError(f"LoGRA target {name!r} is a {type(module).__name__}, not an nn.Linear")
            found.append((name, module))
    if not found:
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(
            f"LoGRA target_modules {list(target_modules)} matched no modules; the model's linear layers "
            f"include {linears[:6]}; set target_modules to their last name components"
        )
    return found


def check_rank(modules: list[tuple[str, nn.Linear]], rank: int) -> None:
    """The rank must not exceed min(d_out, k_in) of any target."""
    for name, module in modules:
        if rank > min(module.out_features, module.in_features):
            raise ValueError(
                f"LoGRA rank {rank} exceeds min(d_out, k_in) = "
                f"{min(module.out_features, module.in_features)} of {name!r}; lower logra.rank"
            )
