"""Projections A (rank × in_features): seeds, portable generation, fingerprints.

A trainer and a rollout engine that share only `(base_seed, update, module name)` must draw
bit-identical matrices. So: seeds come from a stable hash of the wrapper-stripped module
name, the generator is always a CPU `torch.Generator`, the full (rank, in_features) shape is
always drawn, Rademacher entries come from integer draws and Gaussian entries are drawn in
float64 (float32 normal draws differ between CPU instruction sets) and then cast.
"""

from __future__ import annotations

import hashlib
import math

import torch

WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})
SEED_MASK = (1 << 62) - 1


def canonical_name(name: str) -> str:
    """The module name with activation-checkpoint, FSDP1 and torch.compile wrapper components removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def projection_seed(base_seed: int, update: int, name: str) -> int:
    """Seed of the projection for module `name` after `update` completed updates (reference §1.2)."""
    digest = hashlib.blake2b(canonical_name(name).encode("utf-8"), digest_size=8).digest()
    return (base_seed * 1_000_003 + update * 7_919 + int.from_bytes(digest, "little")) & SEED_MASK


def make_projection(rank: int, in_features: int, seed: int, distribution: str = "rademacher") -> torch.Tensor:
    """Draw A ∈ R^{rank × in_features} (float32, CPU), entries of variance 1/rank."""
    if rank <= 0 or in_features <= 0:
        raise ValueError(f"projection shape must be positive, got rank={rank}, in_features={in_features}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed & SEED_MASK)
    scale = 1.0 / math.sqrt(rank)
    if distribution == "rademacher":
        bits = torch.randint(0, 2, (rank, in_features), generator=generator, dtype=torch.uint8)
        return bits.to(torch.float32).mul_(2).sub_(1).mul_(scale)
    if distribution == "gaussian":
        normal = torch.randn((rank, in_features), generator=generator, dtype=torch.float64)
        return normal.mul_(scale).to(torch.float32)
    raise ValueError(f"unknown projection distribution {distribution!r}; choose 'rademacher' or 'gaussian'")


def projection_fingerprint(projection: torch.Tensor) -> str:
    """Hash of A's float32 bytes: a receiver that draws a different A refuses the payload."""
    data = projection.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.blake2b(data.view(torch.uint8).numpy(), digest_size=16).hexdigest()
