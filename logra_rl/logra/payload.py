"""The payloads that carry a committed update to the rollout engines, and their byte format.

- `UpdatePayload`: one LoGRA update as `seed + factor`. A receiver rebuilds each projection A from
  (base_seed, projection_update, module name), so the wire carries only the factors U (d_out × rank, in
  the wire dtype) and a small header. The per-module seeds are not stored: they are a function of those
  three values (`projection_seed`), and the projection fingerprint proves the receiver drew the same A.
- `AdapterPayload`: one LoRA update as the adapters after it (B: d_out × r, A: r × k_in, fp32). The
  receiver holds each target's base weight and sets the target to base + scale·B·A (`adapter_change`):
  the weight changed by s·(B'A' − BA), rank ≤ 2r, without a full resync.

Byte layout (no pickle, nothing executable):
    8 bytes   magic: b"LOGRAPL1" (UpdatePayload) or b"LOGRAAD1" (AdapterPayload)
    4 bytes   header length n, little-endian uint32
    n bytes   zlib-compressed UTF-8 JSON header
    rest      the tensors, concatenated row-major in header order, little-endian
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
ADAPTER_MAGIC = b"LOGRAAD1"
WIRE_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
BLOB_KEYS = frozenset({"factor_bytes", "factor_digest", "modules"})  # every header's: the tensors that follow it
HEADER_KEYS = BLOB_KEYS | {"base_version", "new_version", "base_seed", "projection_update", "rank", "distribution"}
HEADER_KEYS |= {"wire_dtype", "fingerprint"}
ADAPTER_HEADER_KEYS = BLOB_KEYS | {"base_version", "new_version", "rank", "scale"}


class PayloadFormatError(ValueError):
    """The bytes are not a valid payload (truncated, corrupted, or another format)."""


def _pack(magic: bytes, header: dict, tensors: list[torch.Tensor]) -> bytearray:
    """`magic`, the header (with the tensors' byte count and digest added) and the tensors, in one
    preallocated buffer (the tensors are copied once, not joined)."""
    if sys.byteorder != "little":
        raise RuntimeError("LoGRA payloads are little-endian; this host is big-endian")
    arrays = [tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy() for tensor in tensors]
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        digest.update(array)
    header = {**header, "factor_bytes": sum(a.nbytes for a in arrays), "factor_digest": digest.hexdigest()}
    packed = zlib.compress(json.dumps(header, separators=(",", ":")).encode("utf-8"), 9)
    start = len(magic) + 4 + len(packed)
    buffer = bytearray(start + header["factor_bytes"])
    buffer[:start] = magic + struct.pack("<I", len(packed)) + packed
    for array in arrays:
        buffer[start : start + array.nbytes] = array.data
        start += array.nbytes
    return buffer


def _unpack(
    data: bytes | bytearray | memoryview | np.ndarray, magic: bytes, keys: frozenset[str], pin_memory: bool
) -> tuple[dict, torch.Tensor]:
    """The verified header and one copy of the tensor bytes (uint8, page-locked with `pin_memory`)."""
    view = memoryview(data)
    if len(view) < 12 or bytes(view[:8]) != magic:
        raise PayloadFormatError(f"not a {magic.decode()} payload (bad magic bytes {bytes(view[:8])!r})")
    (header_length,) = struct.unpack("<I", view[8:12])
    try:
        header = json.loads(zlib.decompress(view[12 : 12 + header_length]))
        missing = keys - header.keys()
        if missing:
            raise KeyError(f"missing {sorted(missing)}")
    except (zlib.error, ValueError, KeyError, TypeError) as error:
        raise PayloadFormatError(f"corrupted LoGRA payload header: {error!r}") from error
    blob = view[12 + header_length :]
    if len(blob) != header["factor_bytes"]:
        said = header["factor_bytes"]
        raise PayloadFormatError(f"LoGRA payload truncated: {len(blob)} factor bytes, header says {said}")
    if hashlib.blake2b(blob, digest_size=16).hexdigest() != header["factor_digest"]:
        raise PayloadFormatError("LoGRA payload factors do not match their digest (corrupted in transit)")
    storage = torch.empty(len(blob), dtype=torch.uint8, pin_memory=pin_memory)  # the one copy
    storage.numpy()[:] = np.frombuffer(blob, dtype=np.uint8)
    return header, storage


def _take(storage: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """A `shape` view of `storage` at byte `offset`, and the offset after it."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    return storage[offset : offset + nbytes].view(dtype).view(shape), offset + nbytes


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
        header = {
            "base_version": self.base_version,
            "new_version": self.new_version,
            "base_seed": self.base_seed,
            "projection_update": self.projection_update,
            "rank": self.rank,
            "distribution": self.distribution,
            "wire_dtype": self.wire_dtype,
            "fingerprint": self.fingerprint,
            "modules": [[entry.name, entry.d_out, entry.k_in] for entry in self.entries],
        }
        return _pack(MAGIC, header, [entry.factor for entry in self.entries])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | np.ndarray, pin_memory: bool = False) -> UpdatePayload:
        """Parse and verify (one digest pass) a payload, from any buffer (a uint8 array read in place from Ray's
        object store); the factors are views of one copy of its bytes, in page-locked memory with `pin_memory`
        (a CUDA receiver: one asynchronous host-to-device copy each)."""
        header, storage = _unpack(data, MAGIC, HEADER_KEYS, pin_memory)
        try:
            dtype, rank = WIRE_TORCH_DTYPES[header["wire_dtype"]], header["rank"]
            entries, offset = [], 0
            for name, d_out, k_in in header["modules"]:
                factor, offset = _take(storage, offset, dtype, (d_out, rank))
                entries.append(PayloadEntry(name=name, d_out=d_out, k_in=k_in, factor=factor))
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
        except (KeyError, ValueError, TypeError, RuntimeError) as error:
            raise PayloadFormatError(f"corrupted LoGRA payload header: {error!r}") from error


@dataclass(frozen=True)
class AdapterEntry:
    """One LoRA module after an update: its target becomes base + scale·B·A."""

    name: str  # HF module name of the adapted linear
    d_out: int
    k_in: int
    b: torch.Tensor  # (d_out, rank) float32
    a: torch.Tensor  # (rank, k_in) float32


@dataclass(frozen=True)
class AdapterPayload:
    """A LoRA update as its adapters: exact, because the receiver recomputes the merged weight from the base
    it holds (no accumulated rounding), and small (r·(d_out + k_in) values per module)."""

    base_version: int
    new_version: int
    rank: int
    scale: float  # peft's lora_alpha / r
    entries: tuple[AdapterEntry, ...]

    def __post_init__(self) -> None:
        for entry in self.entries:
            shapes = (tuple(entry.b.shape), tuple(entry.a.shape))
            expected = ((entry.d_out, self.rank), (self.rank, entry.k_in))
            if entry.b.dtype != torch.float32 or entry.a.dtype != torch.float32 or shapes != expected:
                raise ValueError(
                    f"adapters of {entry.name!r} are {entry.b.dtype} {shapes[0]} and {entry.a.dtype} {shapes[1]}, "
                    f"expected float32 {expected[0]} and {expected[1]}: they must be exactly what the trainer holds"
                )

    def to_bytes(self) -> bytearray:
        header = {
            "base_version": self.base_version,
            "new_version": self.new_version,
            "rank": self.rank,
            "scale": self.scale,
            "modules": [[entry.name, entry.d_out, entry.k_in] for entry in self.entries],
        }
        return _pack(ADAPTER_MAGIC, header, [t for entry in self.entries for t in (entry.b, entry.a)])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | np.ndarray, pin_memory: bool = False) -> AdapterPayload:
        header, storage = _unpack(data, ADAPTER_MAGIC, ADAPTER_HEADER_KEYS, pin_memory)
        try:
            rank, entries, offset = header["rank"], [], 0
            for name, d_out, k_in in header["modules"]:
                b, offset = _take(storage, offset, torch.float32, (d_out, rank))
                a, offset = _take(storage, offset, torch.float32, (rank, k_in))
                entries.append(AdapterEntry(name=name, d_out=d_out, k_in=k_in, b=b, a=a))
            return cls(header["base_version"], header["new_version"], rank, float(header["scale"]), tuple(entries))
        except (KeyError, ValueError, TypeError, RuntimeError) as error:
            raise PayloadFormatError(f"corrupted LoRA adapter payload header: {error!r}") from error


Payload = UpdatePayload | AdapterPayload  # what an update rule commits for the engines to merge


def parse_payload(data: bytes | bytearray | memoryview | np.ndarray, pin_memory: bool = False) -> Payload:
    """Either payload, told apart by its magic bytes."""
    if bytes(memoryview(data)[:8]) == ADAPTER_MAGIC:
        return AdapterPayload.from_bytes(data, pin_memory)
    return UpdatePayload.from_bytes(data, pin_memory)
