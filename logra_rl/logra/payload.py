"""UpdatePayload: one committed LoGRA update as `seed + factor`, and its byte format.

A receiver rebuilds each projection A from (base_seed, projection_update, module name), so
the wire carries only the factors U (d_out × rank, in the wire dtype) and a small header.
The per-module seeds are not stored: they are a function of those three values
(`projection_seed`), and the projection fingerprint proves the receiver drew the same A.

Byte layout (no pickle, nothing executable):
    8 bytes   magic b"LOGRAPL1"
    4 bytes   header length n, little-endian uint32
    n bytes   zlib-compressed UTF-8 JSON header
    rest      the factors, concatenated row-major in header order, little-endian
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from logra_rl.logra.projection import make_projection, projection_seed

MAGIC = b"LOGRAPL1"
WIRE_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
HEADER_KEYS = frozenset(
    {"base_version", "new_version", "base_seed", "projection_update", "rank", "distribution", "wire_dtype"}
    | {"fingerprint", "factor_bytes", "factor_digest", "modules"}
)


class PayloadFormatError(ValueError):
    """The bytes are not a valid LoGRA payload (truncated, corrupted, or another format)."""


@dataclass(frozen=True)
class PayloadEntry:
    """The update of one module: W ← W − factor · A(seed), with A of shape (rank, k_in)."""

    name: str  # HF module name, wrapper components stripped (e.g. model.layers.0.self_attn.q_proj)
    d_out: int
    k_in: int
    factor: torch.Tensor  # (d_out, rank), wire dtype


@dataclass(frozen=True)
class UpdatePayload:
    base_version: int  # the policy version the update applies to
    new_version: int  # the version after applying it
    base_seed: int
    projection_update: int  # the update index the projections were drawn for
    rank: int
    distribution: str
    wire_dtype: str
    fingerprint: str  # projection_fingerprint of the first entry's A
    entries: tuple[PayloadEntry, ...]

    def seed(self, entry: PayloadEntry) -> int:
        return projection_seed(self.base_seed, self.projection_update, entry.name)

    def projection(self, entry: PayloadEntry, device: torch.device | str = "cpu") -> torch.Tensor:
        """The entry's A, drawn exactly as the trainer drew it (float32), on `device`."""
        return make_projection(self.rank, entry.k_in, self.seed(entry), self.distribution, device)

    @property
    def factor_bytes(self) -> int:
        return sum(entry.factor.numel() * entry.factor.element_size() for entry in self.entries)

    def __post_init__(self) -> None:
        dtype = WIRE_TORCH_DTYPES.get(self.wire_dtype)
        if dtype is None:
            raise ValueError(f"wire_dtype={self.wire_dtype!r}; choose one of {sorted(WIRE_TORCH_DTYPES)}")
        for entry in self.entries:
            if entry.factor.dtype != dtype or tuple(entry.factor.shape) != (entry.d_out, self.rank):
                raise ValueError(
                    f"payload factor of {entry.name!r} is {entry.factor.dtype} {tuple(entry.factor.shape)}, expected "
                    f"{dtype} {(entry.d_out, self.rank)}: factors must be exactly what the trainer merged"
                )

    def to_bytes(self) -> bytearray:
        """Serialise into one preallocated buffer (the factors are copied once, not joined)."""
        if sys.byteorder != "little":
            raise RuntimeError("LoGRA payloads are little-endian; this host is big-endian")
        factors = [entry.factor.detach().to("cpu").contiguous().view(torch.uint8).numpy() for entry in self.entries]
        digest = hashlib.blake2b(digest_size=16)
        for factor in factors:
            digest.update(factor)
        header = {
            "base_version": self.base_version,
            "new_version": self.new_version,
            "base_seed": self.base_seed,
            "projection_update": self.projection_update,
            "rank": self.rank,
            "distribution": self.distribution,
            "wire_dtype": self.wire_dtype,
            "fingerprint": self.fingerprint,
            "factor_bytes": self.factor_bytes,
            "factor_digest": digest.hexdigest(),
            "modules": [[entry.name, entry.d_out, entry.k_in] for entry in self.entries],
        }
        packed = zlib.compress(json.dumps(header, separators=(",", ":")).encode("utf-8"), 9)
        start = len(MAGIC) + 4 + len(packed)
        buffer = bytearray(start + self.factor_bytes)
        buffer[:start] = MAGIC + struct.pack("<I", len(packed)) + packed
        for factor in factors:
            buffer[start : start + factor.nbytes] = factor.data
            start += factor.nbytes
        return buffer

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | np.ndarray, pin_memory: bool = False) -> UpdatePayload:
        """Parse and verify (one digest pass) a payload, from any buffer (a uint8 array read in place from Ray's
        object store); the factors are views of one copy of its bytes, in page-locked memory with `pin_memory`
        (a CUDA receiver: one asynchronous host-to-device copy each)."""
        view = memoryview(data)
        if len(view) < 12 or bytes(view[:8]) != MAGIC:
            raise PayloadFormatError("not a LoGRA payload (bad magic bytes)")
        (header_length,) = struct.unpack("<I", view[8:12])
        try:
            header = json.loads(zlib.decompress(view[12 : 12 + header_length]))
            missing = HEADER_KEYS - header.keys()
            if missing:
                raise KeyError(f"missing {sorted(missing)}")
            dtype = WIRE_TORCH_DTYPES[header["wire_dtype"]]
            rank, modules, factor_bytes = header["rank"], header["modules"], header["factor_bytes"]
        except (zlib.error, ValueError, KeyError, TypeError) as error:
            raise PayloadFormatError(f"corrupted LoGRA payload header: {error!r}") from error
        blob = view[12 + header_length :]
        if len(blob) != factor_bytes:
            raise PayloadFormatError(f"LoGRA payload truncated: {len(blob)} factor bytes, header says {factor_bytes}")
        if hashlib.blake2b(blob, digest_size=16).hexdigest() != header["factor_digest"]:
            raise PayloadFormatError("LoGRA payload factors do not match their digest (corrupted in transit)")
        storage = torch.empty(len(blob), dtype=torch.uint8, pin_memory=pin_memory)  # the one copy
        storage.numpy()[:] = np.frombuffer(blob, dtype=np.uint8)
        entries, offset = [], 0
        for name, d_out, k_in in modules:
            nbytes = d_out * rank * dtype.itemsize
            factor = storage[offset : offset + nbytes].view(dtype).view(d_out, rank)
            entries.append(PayloadEntry(name=name, d_out=d_out, k_in=k_in, factor=factor))
            offset += nbytes
        return cls(
            base_version=header["base_version"],
            new_version=header["new_version"],
            base_seed=header["base_seed"],
            projection_update=header["projection_update"],
            rank=rank,
            distribution=header["distribution"],
            wire_dtype=header["wire_dtype"],
            fingerprint=header["fingerprint"],
            entries=tuple(entries),
        )
