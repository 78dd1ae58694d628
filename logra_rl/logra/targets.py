"""Which modules LoGRA trains: nn.Linear layers picked by the last component of their name."""

from __future__ import annotations

from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder, found the way transformers exposes it (`get_decoder()`): a causal LM's `.model`, a
    multimodal model's language model (Gemma 3's `model.language_model`), a PEFT model's base's; a model
    without `get_decoder` is its own decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) else model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's layers and their name in `model` (`model.layers`, `model.language_model.layers`)."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}'s decoder ({type(decoder).__name__}) has no `layers`")
    name = next(name for name, module in model.named_modules() if module is layers)
    return name, layers


def beside_decoder(model: nn.Module) -> set[int]:
    """ids of the modules of the model's body that are not its text decoder: a multimodal model's vision tower
    and projector (empty for a causal LM, whose body is its decoder)."""
    body, decoder = getattr(model, "base_model", model), decoder_of(model)
    if not isinstance(body, nn.Module) or body is decoder:
        return set()
    return {id(module) for module in body.modules()} - {id(module) for module in decoder.modules()}


def find_targets(model: nn.Module, target_modules: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """Modules whose last name component is in `target_modules`; they must be nn.Linear.

    A multimodal model's vision tower is left out: it has `q_proj`s of its own, which text-only RL never
    trains and the rollout engines do not merge into."""
    beside = beside_decoder(model)
    found = []
    for name, module in model.named_modules():
        if id(module) not in beside and name.rsplit(".", 1)[-1] in target_modules:
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
