"""Merging W ← W − U·A into weights, on the trainer (fp32 master) and on rollout copies (bf16).

bf16 weights cannot absorb LoGRA-sized updates (relative ~1e-4, below half a bf16 ulp): a
plain in-place add rounds most of them away. A rollout copy therefore keeps an error-feedback
residual R per weight: acc = W + R − U·A in fp32, W ← round(acc), R ← acc − W. With an fp32
residual, W + R tracks the trainer's fp32 master exactly, so W equals bf16(master) bit for bit
(given the same U, A and row chunking as the trainer).

The `tail` residual carries the same information in 2 bytes instead of 4: the master's fp32 bit
pattern minus the bf16 weight's, an int16 (`split_master` / `join_master`). bf16 + tail is the
master bit for bit; the weight is bf16(master) except at exact ties (see `split_master`).

A LoRA update (`AdapterPayload`) is not merged into the weight: a target that holds its `base` is set to
base + scale·B·A (`adapter_change`, fp32, one rounding), the value the trainer computes for the same adapters,
so the copy stays at bf16 of the trainer's merged weight with nothing accumulated.

A merge is not idempotent, so payloads are version-gated: a payload applies only on top of
the version it was built for, and is checked completely before the first write. An error
after the first write leaves the copy marked as needing a full resync.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from logra_rl.logra.payload import AdapterPayload, UpdatePayload
from logra_rl.logra.projection import projection_fingerprint

RESIDUAL_DTYPES = {"tail": torch.int16, "float32": torch.float32, "bfloat16": torch.bfloat16, "none": None}
TIE = 0x8000  # a master exactly halfway between two bf16 values: the tail would be +2^15, one past int16
BF16_STEP = 0x10000  # one bf16 step in the fp32 bit pattern
# `merge_chunk_rows: 0` sizes a chunk to about this many elements. On a GPU, 2^24 (a float64 change of 128 MiB):
# a 7B payload in a few hundred chunks, not thousands of small ones each a dozen kernel launches. On a CPU,
# 2^20: the elementwise passes of a chunk stay in cache (larger chunks measured no faster there).
CHUNK_ELEMENTS = {"cuda": 2**24, "cpu": 2**20}


class PayloadRefused(ValueError):
    """The payload cannot be applied to these weights; nothing was written."""


def _value_order(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (int32) as integers in the order of the values (−0 just below +0): negative
    patterns get their magnitude bits flipped. It is its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master as (bf16 weight, int16 tail) with `join_master(weight, tail)` equal to it bit for bit.

    In value order (`_value_order`) floats are consecutive integers, across binade edges, zeros and
    subnormals alike, and bf16 values are every 2^16th; so the master's position minus its nearest bf16's
    lies in [−2^15, 2^15]. At an exact tie round-to-nearest-even may land on the lower neighbour, giving
    +2^15, which int16 cannot hold: there the weight is the other, equally near neighbour (the one toward
    +∞) and the tail −2^15. Everywhere else the weight is bf16(master). Served toward +∞ whatever their
    sign, the tie errors are not aligned with the weights (rounding ties away from zero would scale every
    affected weight up), which matters where ties are common: a float16 checkpoint's values are ties of
    bf16 one time in eight.
    """
    key = _value_order(master.float().view(torch.int32))
    weight = master.to(torch.bfloat16)
    weight_key = _value_order(weight.float().view(torch.int32))
    tail = key - weight_key
    tie = tail == TIE
    if master.is_cuda or bool(tie.any()):  # on a GPU, `any` would wait for the device: always branch-free
        up = _value_order(weight_key + BF16_STEP).view(torch.float32).to(torch.bfloat16)  # exact: a bf16 value
        weight = torch.where(tie, up, weight)
        tail = torch.where(tie, tail - BF16_STEP, tail)
    return weight, tail.to(torch.int16)


def join_master(weight: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` turned into (weight, tail)."""
    key = _value_order(weight.float().view(torch.int32)) + tail.to(torch.int32)
    return _value_order(key).view(torch.float32)


def master_of(weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The fp32 master a low-precision weight and its residual hold (exact for an fp32 or tail residual)."""
    if residual is not None and residual.dtype == torch.int16:
        return join_master(weight, residual)
    master = weight.to(torch.float32, copy=True)
    return master if residual is None else master.add_(residual)


def store_master(weight: torch.Tensor, residual: torch.Tensor | None, master: torch.Tensor) -> None:
    """weight ← round(master) and the residual ← what rounding left (exact for an fp32 or tail residual)."""
    if residual is not None and residual.dtype == torch.int16:
        rounded, tail = split_master(master)
        weight.copy_(rounded)
        residual.copy_(tail)
        return
    weight.copy_(master)
    if residual is not None:
        residual.copy_(master.float() - weight.float())


def residual_torch_dtype(residual_dtype: str) -> torch.dtype | None:
    if residual_dtype not in RESIDUAL_DTYPES:
        raise ValueError(f"residual_dtype={residual_dtype!r}; choose one of {sorted(RESIDUAL_DTYPES)}")
    return RESIDUAL_DTYPES[residual_dtype]


def residual_bytes(residual_dtype: str, weight_dtype: str) -> int:
    """Bytes per targeted weight of the residual `new_residual` gives a `weight_dtype` copy (fp32 weights need
    no tail: they are their own master)."""
    dtype = residual_torch_dtype(residual_dtype)
    return 0 if dtype is None or (dtype == torch.int16 and weight_dtype == "float32") else dtype.itemsize


def new_residual(weight: torch.Tensor, residual_dtype: str) -> torch.Tensor | None:
    """A zero residual for `weight` (W alone is the master until the first merge), or None."""
    dtype = residual_torch_dtype(residual_dtype)
    if dtype == torch.int16 and weight.dtype != torch.bfloat16:
        if weight.dtype == torch.float32:
            return None  # fp32 weights are their own master: merges are exact in place
        raise ValueError(
            f"residual=tail is exact for bfloat16 weights, not {weight.dtype}; use residual=float32 for these"
        )
    return None if dtype is None else torch.zeros_like(weight, dtype=dtype)


def chunk_rows_for(chunk_rows: int, k_in: int, device: torch.device) -> int:
    """Rows per merge chunk: `chunk_rows`, or for 0 about `CHUNK_ELEMENTS` elements of a module with `k_in`
    columns (its full HF width, so every holder of a row, sharded or not, cuts the same chunks)."""
    return chunk_rows if chunk_rows > 0 else max(1, CHUNK_ELEMENTS.get(device.type, 2**20) // k_in)


def row_chunks(rows: int, chunk_rows: int, row_offset: int = 0) -> list[slice]:
    """Local row slices whose global boundaries are multiples of `chunk_rows`."""
    first = (-row_offset) % chunk_rows or chunk_rows  # local rows before the next global boundary
    starts = [0, *range(first, rows, chunk_rows)]
    return [slice(start, stop) for start, stop in zip(starts, [*starts[1:], rows], strict=True)]


def low_rank_change(
    factor: torch.Tensor, projection: torch.Tensor, signs: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """factor·projection as fp32, with one value per element whatever the chunk shape, shard layout or
    GEMM kernel (whose reduction order varies with the shape, on GPUs especially).

    U is bf16 (8 significant bits) and a Rademacher A is ±c: `signs` = A / c. U·sign(A) is then a sum of
    ±U entries, exact in float64 in any order (unless a row of U spans more than 2^37 in magnitude), scaled
    by c and rounded to fp32 once: trainer and engines get the same bits. Without `signs` (a Gaussian A)
    the product runs in float64: exact products, sums accurate to ~1e-16 before the one rounding.
    `scale` (c as float64) may be passed in by a caller that merges many chunks with the same A.
    """
    if signs is None:
        return (factor.double() @ projection.double()).float()
    if scale is None:
        scale = projection.abs().amax().double()
    return ((factor.double() @ signs) * scale).float()


def adapter_change(b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    """scale·B·A as fp32: the products in float64 (exact for fp32 factors), summed over the rank and rounded
    once, so the trainer's merged weight and every engine's (chunked, sharded) copy agree."""
    return ((b.double() @ a.double()) * scale).float()


def merge_adapters(state: Mapping[str, torch.Tensor], scale: float) -> tuple[dict[str, torch.Tensor], dict]:
    """A LoRA run's weights as a resync sends them (HF names, each adapted module's base weight under its own name
    and its adapters as `{module}.lora_A` / `{module}.lora_B`) → (HF names with every adapter merged:
    base + adapter_change(B, A, scale), the bases by module name)."""
    merged, bases = {}, {}
    for name, value in state.items():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.lora_A" in state:
            bases[module] = value
            value = value.float() + adapter_change(state[f"{module}.lora_B"], state[f"{module}.lora_A"], scale)
        merged[name] = value
    return merged, bases


def rademacher_signs(projection: torch.Tensor) -> torch.Tensor | None:
    """A / c in float64 when every entry of A is ±c (a Rademacher projection), else None."""
    magnitude = projection.abs()
    scale = magnitude.amax()
    if scale == 0 or not bool((magnitude == scale).all()):
        return None
    return (projection / scale).double()


def merge_low_rank_(
    weight: torch.Tensor,
    factor: torch.Tensor,
    projection: torch.Tensor,
    residual: torch.Tensor | None = None,
    chunk_rows: int = 0,
    row_offset: int = 0,
    k_in: int | None = None,
) -> None:
    """weight ← weight − factor·projection in place, in row chunks, rounding once per element.

    `factor` holds the rows of U matching `weight`'s rows; no full ΔW is ever materialised.
    `residual` (same shape as weight) carries the rounding error of low-precision weights: an fp32 or
    bf16 difference, or an int16 tail (`split_master`).
    Each element's change comes from `low_rank_change`, which does not depend on the chunking, so
    holders of a row with different shard or tensor-parallel layouts compute the same bits;
    `row_offset` (the global index of weight's first row) still aligns chunks to global multiples
    of `chunk_rows` (0: sized by `chunk_rows_for` from `k_in`, the module's full width, default the
    projection's).

    Made for a GPU as much as a CPU: the factor moves to the device once (asynchronously when it is pinned),
    A's signs and scale are found once, and no chunk waits for the device.
    """
    projection = projection.to(device=weight.device, dtype=torch.float32)
    signs = rademacher_signs(projection)
    scale = None if signs is None else projection.abs().amax().double()
    factor = factor.to(weight.device, non_blocking=True)
    chunk_rows = chunk_rows_for(chunk_rows, k_in or projection.shape[1], weight.device)
    exact_in_place = weight.dtype == torch.float32 and residual is None
    with torch.no_grad():
        for rows in row_chunks(weight.shape[0], chunk_rows, row_offset):
            change = low_rank_change(factor[rows], projection, signs, scale)
            if exact_in_place:
                weight[rows].sub_(change)
                continue
            part = None if residual is None else residual[rows]
            store_master(weight[rows], part, master_of(weight[rows], part) - change)


@dataclass
class MergeTarget:
    """Where one HF module's update lands: a weight (or a row block of a fused / sharded one), its
    residual, and which rows of U and columns of A it takes (all of them in HF layout); `base`: the fp32
    base weight of a LoRA run's target (`PayloadMerger.hold_bases`), which adapter payloads are added to."""

    weight: torch.Tensor
    residual: torch.Tensor | None
    hf_shape: tuple[int, int]
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))
    base: torch.Tensor | None = None

    def store(self, rows: slice, master: torch.Tensor) -> None:
        """`store_master` into `rows` of the weight and its residual."""
        store_master(self.weight[rows], None if self.residual is None else self.residual[rows], master)


def hf_targets(weights: Mapping[str, torch.Tensor], residual_dtype: str = "tail") -> dict[str, MergeTarget]:
    """Targets for HF-layout weights (name → (d_out, k_in) tensor), each with a fresh zero residual."""
    residual_torch_dtype(residual_dtype)  # checked even when there are no weights
    return {
        name: MergeTarget(weight, new_residual(weight, residual_dtype), tuple(weight.shape))
        for name, weight in weights.items()
    }


def _check_update(payload: UpdatePayload | AdapterPayload, targets: Mapping[str, MergeTarget], version: int) -> None:
    """What every payload must be: the next version of these weights, with entries that fit the targets."""
    if payload.new_version != payload.base_version + 1:
        raise PayloadRefused(f"malformed payload: version {payload.base_version} -> {payload.new_version}")
    if payload.base_version != version:
        kind = "duplicate or stale" if payload.new_version <= version else "out-of-order"
        raise PayloadRefused(
            f"{kind} payload: it updates version {payload.base_version} -> {payload.new_version}, "
            f"these weights are at version {version}; resync if versions diverged"
        )
    if not payload.entries:
        raise PayloadRefused("payload has no entries")
    for entry in payload.entries:
        target = targets.get(entry.name)
        if target is None:
            raise PayloadRefused(f"payload updates {entry.name!r}, which these weights do not hold")
        if target.hf_shape != (entry.d_out, entry.k_in):
            raise PayloadRefused(
                f"{entry.name!r}: payload shape {(entry.d_out, entry.k_in)} != weight shape {target.hf_shape}"
            )


def check_payload(payload: UpdatePayload, targets: Mapping[str, MergeTarget], version: int) -> None:
    """Raise PayloadRefused unless `payload` applies cleanly on top of `version` to `targets`."""
    _check_update(payload, targets, version)
    first = payload.projection(payload.entries[0])
    if projection_fingerprint(first) != payload.fingerprint:
        raise PayloadRefused(
            "projection fingerprint mismatch: this process draws a different A than the trainer "
            "(torch version or generator differs); a full resync is needed"
        )


def check_adapters(payload: AdapterPayload, targets: Mapping[str, MergeTarget], version: int) -> None:
    """Raise PayloadRefused unless `payload` sets adapted `targets` that hold their bases, on top of `version`."""
    _check_update(payload, targets, version)
    for entry in payload.entries:
        if targets[entry.name].base is None:
            raise PayloadRefused(
                f"{entry.name!r} holds no base weight: the engine was not started for LoRA adapters (adapter_scale)"
            )


def _set_adapters(payload: AdapterPayload, targets: Mapping[str, MergeTarget], chunk_rows: int) -> None:
    """Every entry's target ← base + scale·B·A, in row chunks (no full fp64 product materialised)."""
    for entry in payload.entries:
        target = targets[entry.name]
        b = entry.b[target.rows].to(target.weight.device, non_blocking=True)
        a = entry.a[:, target.cols].to(target.weight.device, non_blocking=True)
        for rows in row_chunks(target.weight.shape[0], chunk_rows_for(chunk_rows, entry.k_in, target.weight.device)):
            target.store(rows, target.base[rows] + adapter_change(b[rows], a, payload.scale))


def _merge_entries(payload: UpdatePayload, targets: Mapping[str, MergeTarget], chunk_rows: int) -> None:
    for entry in payload.entries:
        target = targets[entry.name]
        merge_low_rank_(
            target.weight,
            entry.factor[target.rows],
            payload.projection(entry, target.weight.device)[:, target.cols],
            target.residual,
            chunk_rows,
            row_offset=target.rows.start or 0,
            k_in=entry.k_in,
        )


class PayloadMerger:
    """A rollout-side copy of the targeted weights: where each update lands, the version, the resync state.

    `PayloadMerger(hf_targets(weights))` holds HF-layout weights; an engine with fused or sharded
    weights passes its own `MergeTarget`s (see `logra_rl.rollout.vllm_layout`).
    """

    def __init__(self, targets: Mapping[str, MergeTarget], version: int = 0, chunk_rows: int = 0) -> None:
        self.targets = dict(targets)
        self.version = version
        self.chunk_rows = chunk_rows
        self.needs_resync = False
        self._loaded: set[str] = set()  # targets loaded since the current resync began

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return {name: target.weight for name, target in self.targets.items()}

    def apply(self, payload: UpdatePayload | AdapterPayload) -> None:
        """Apply one payload; refused payloads change nothing, a failed write demands a resync."""
        if self.needs_resync:
            raise PayloadRefused("these weights need a full resync before the next payload")
        adapters = isinstance(payload, AdapterPayload)
        (check_adapters if adapters else check_payload)(payload, self.targets, self.version)
        try:
            with torch.no_grad():
                (_set_adapters if adapters else _merge_entries)(payload, self.targets, self.chunk_rows)
        except Exception:
            self.needs_resync = True
            raise
        self.version = payload.new_version

    def resync(self, master: Mapping[str, torch.Tensor], version: int) -> None:
        """A full resync in one part (`begin_resync`, `load`, `finish_resync`): the GPU check's and the
        benchmarks' rollout copies, which hold every target in one process."""
        self.begin_resync()
        self.load(master)
        self.finish_resync(version)

    def begin_resync(self) -> None:
        """Start a full resync delivered in parts (`load` per part): payloads are refused until it finishes."""
        self.needs_resync = True
        self._loaded = set()

    def hold_bases(self) -> None:
        """Keep an fp32 base of every target, from the weights as they are (a LoRA run's engines, whose adapters
        start at zero): adapter payloads set each target to base + scale·B·A."""
        for target in self.targets.values():
            target.base = target.weight.float().clone()

    def load(self, master: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor] | None = None) -> None:
        """Load the targets present in `master` (one part of a resync; other names are ignored): W ← round(master),
        R ← master − W (exact for an fp32 or tail R); and the `bases` of a LoRA run's targets."""
        with torch.no_grad():
            for name in self.targets.keys() & master.keys():
                target = self.targets[name]
                target.store(slice(None), master[name][target.rows, target.cols].to(device=target.weight.device))
                if target.base is not None:
                    if bases is None or name not in bases:
                        raise KeyError(f"a LoRA run's resync sent {name!r} without its base weight")
                    target.base.copy_(bases[name][target.rows, target.cols])
                self._loaded.add(name)

    def finish_resync(self, version: int) -> None:
        """End the resync at `version` once every target has been loaded since `begin_resync`."""
        missing = sorted(set(self.targets) - self._loaded)
        if missing:
            raise ValueError(f"resync is missing weights {missing[:4]}")
        self.version = version
        self.needs_resync = False
