"""Projections A (rank × in_features): seeds, portable generation, fingerprints.

A trainer and a rollout engine that share only `(base_seed, update, module name)` must draw
bit-identical matrices, on whatever device each holds the weight. So: seeds come from a stable
hash of the wrapper-stripped module name and the full (rank, in_features) shape is always drawn.
Rademacher entries come from a counter-based integer hash of (seed, entry index), computed on the
requested device in int64 arithmetic that never overflows: the same ±1/√r bits on any CPU or GPU,
with no host-to-device copy per redraw. Gaussian entries are drawn by a CPU `torch.Generator` in
float64 (float32 normal draws differ between CPU instruction sets), cast, then moved.
"""

from __future__ import annotations

import hashlib
import math

import torch

WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})
SEED_MASK = (1 << 62) - 1
MASK32 = 0xFFFFFFFF


def canonical_name(name: str) -> str:
    """The module name with activation-checkpoint, FSDP1 and torch.compile wrapper components removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def projection_seed(base_seed: int, update: int, name: str) -> int:
    """Seed of the projection for module `name` after `update` completed updates (the reference port's formula)."""
    digest = hashlib.blake2b(canonical_name(name).encode("utf-8"), digest_size=8).digest()
    return (base_seed * 1_000_003 + update * 7_919 + int.from_bytes(digest, "little")) & SEED_MASK


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x · constant) mod 2^32 for int64 x in [0, 2^32), in 16-bit halves so no product passes 2^49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 values in [0, 2^32): every input bit reaches every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _rademacher_signs(rank: int, in_features: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """±1 (bool: True for +1) for each entry: bit b of the hash of (seed, word w) is entry 32·w + b in
    row-major order."""
    seed &= SEED_MASK
    keys = [_mix32(torch.tensor(part, dtype=torch.int64, device=device)) for part in (seed & MASK32, seed >> 32)]
    count = rank * in_features
    word = torch.arange((count + 31) // 32, dtype=torch.int64, device=device)
    hashed = _mix32(_mix32(word ^ keys[0]) ^ keys[1])
    signed = hashed - ((hashed >> 31) << 32)  # the same 32 bits as int32 (two's complement), cast exactly
    octets = signed.to(torch.int32).view(torch.uint8)  # little-endian: octet j holds bits 8j..8j+7
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (octets[:, None] >> shifts) & 1
    return bits.flatten()[:count].bool().view(rank, in_features)


def make_projection(
    rank: int, in_features: int, seed: int, distribution: str = "rademacher", device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Draw A ∈ R^{rank × in_features} (float32, on `device`), entries of variance 1/rank."""
    if rank <= 0 or in_features <= 0:
        raise ValueError(f"projection shape must be positive, got rank={rank}, in_features={in_features}")
    scale = 1.0 / math.sqrt(rank)
    if distribution == "rademacher":
        positive = _rademacher_signs(rank, in_features, seed, device)
        magnitude = torch.tensor(scale, dtype=torch.float32, device=device)
        return torch.where(positive, magnitude, -magnitude)
    if distribution == "gaussian":
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed & SEED_MASK)
        normal = torch.randn((rank, in_features), generator=generator, dtype=torch.float64)
        return normal.mul_(scale).to(device=device, dtype=torch.float32)
    raise ValueError(f"unknown projection distribution {distribution!r}; choose 'rademacher' or 'gaussian'")


def projection_fingerprint(projection: torch.Tensor) -> str:
    """Hash of A's float32 bytes: a receiver that draws a different A refuses the payload."""
    data = projection.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.blake2b(data.view(torch.uint8).numpy(), digest_size=16).hexdigest()
