"""Where a LoGRA update of an HF module lands in vLLM's fused, tensor-parallel weights (pure torch).

vLLM stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (column parallel: each TP
rank holds a block of output rows), and splits o_proj/down_proj by input columns (row parallel).
A low-rank update W ← W − U·A therefore lands as

    column parallel  W_local[dst_rows] −= U[src_rows] · A         (q, k, v, gate, up)
    row parallel     W_local           −= U · A[:, cols]          (o, down)

With more TP ranks than KV heads, each KV head is replicated on tp/num_kv_heads ranks; those
ranks apply identical rows, so the replicas stay bit-identical. The table is
`reference/vllm_sync.md` §2.2; `verify_placements` checks it against vLLM's own loaders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class LayerGeometry:
    """One decoder layer's attention/MLP sizes and the TP split, as vLLM's layers see them."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.tp_size or self.intermediate % self.tp_size:
            raise ValueError(f"tensor parallel size {self.tp_size} must divide the heads and the intermediate size")
        if max(self.tp_size, self.num_kv_heads) % min(self.tp_size, self.num_kv_heads):
            raise ValueError(f"tp size {self.tp_size} and {self.num_kv_heads} KV heads must divide one another")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    @property
    def q_rows(self) -> int:
        return self.num_heads // self.tp_size * self.head_dim

    @property
    def kv_replicas(self) -> int:
        return max(self.tp_size // self.num_kv_heads, 1)

    @property
    def kv_rows(self) -> int:
        return max(self.num_kv_heads // self.tp_size, 1) * self.head_dim

    @property
    def mlp_rows(self) -> int:
        return self.intermediate // self.tp_size


@dataclass(frozen=True)
class Placement:
    """HF module → local vLLM parameter: rows of the parameter it writes, rows of U, columns of A."""

    param: str
    dst_rows: slice
    src_rows: slice
    cols: slice
    hf_shape: tuple[int, int]


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


def layer_placements(prefix: str, g: LayerGeometry) -> dict[str, Placement]:
    """The 7 targets of decoder layer `prefix` (e.g. `model.layers.3`) on TP rank `g.tp_rank`."""
    attention, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    t, all_cols = g.tp_rank, slice(None)
    kv_head_block = t // g.kv_replicas  # replicated KV heads: ranks sharing a head load the same rows
    q_dim, kv_dim = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    q_cols, mlp_cols = g.q_rows, g.mlp_rows  # row-parallel column blocks have the column-parallel widths
    return {
        f"{attention}.q_proj": Placement(
            f"{attention}.qkv_proj.weight",
            _span(0, g.q_rows),
            _span(t * g.q_rows, g.q_rows),
            all_cols,
            (q_dim, g.hidden),
        ),
        f"{attention}.k_proj": Placement(
            f"{attention}.qkv_proj.weight",
            _span(g.q_rows, g.kv_rows),
            _span(kv_head_block * g.kv_rows, g.kv_rows),
            all_cols,
            (kv_dim, g.hidden),
        ),
        f"{attention}.v_proj": Placement(
            f"{attention}.qkv_proj.weight",
            _span(g.q_rows + g.kv_rows, g.kv_rows),
            _span(kv_head_block * g.kv_rows, g.kv_rows),
            all_cols,
            (kv_dim, g.hidden),
        ),
        f"{attention}.o_proj": Placement(
            f"{attention}.o_proj.weight", slice(None), slice(None), _span(t * q_cols, q_cols), (g.hidden, q_dim)
        ),
        f"{mlp}.gate_proj": Placement(
            f"{mlp}.gate_up_proj.weight",
            _span(0, g.mlp_rows),
            _span(t * g.mlp_rows, g.mlp_rows),
            all_cols,
            (g.intermediate, g.hidden),
        ),
        f"{mlp}.up_proj": Placement(
            f"{mlp}.gate_up_proj.weight",
            _span(g.mlp_rows, g.mlp_rows),
            _span(t * g.mlp_rows, g.mlp_rows),
            all_cols,
            (g.intermediate, g.hidden),
        ),
        f"{mlp}.down_proj": Placement(
            f"{mlp}.down_proj.weight",
            slice(None),
            slice(None),
            _span(t * mlp_cols, mlp_cols),
            (g.hidden, g.intermediate),
        ),
    }


def local_shapes(g: LayerGeometry) -> dict[str, tuple[int, int]]:
    """Shapes of the four local vLLM weights of a layer (suffixes after the layer prefix)."""
    return {
        "self_attn.qkv_proj.weight": (g.q_rows + 2 * g.kv_rows, g.hidden),
        "self_attn.o_proj.weight": (g.hidden, g.q_rows),
        "mlp.gate_up_proj.weight": (2 * g.mlp_rows, g.hidden),
        "mlp.down_proj.weight": (g.hidden, g.mlp_rows),
    }


class _RecordCopies(TorchDispatchMode):
    """Records every `copy_` whose source is a view of `probe`, and skips it (a loader dry run)."""

    def __init__(self, probe: torch.Tensor) -> None:
        super().__init__()
        self.probe_storage = probe.untyped_storage().data_ptr()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            destination, source = args[0], args[1]
            if source.untyped_storage().data_ptr() == self.probe_storage:
                self.copies.append((destination, source))
                return destination
        return func(*args, **(kwargs or {}))


def loader_placement(
    param: torch.Tensor, load: Callable[[torch.Tensor], None], hf_shape: tuple[int, int]
) -> tuple[slice, slice, slice]:
    """(dst_rows, src_rows, cols) that `load(hf_tensor)` writes into `param`, found by a dry run.

    Fails closed: a loader that copies through a temporary (quantized, repacked, converted
    weights) has no view of the probe as its source, and the placement cannot be confirmed.
    """
    probe = torch.empty(hf_shape, dtype=param.dtype, device=param.device)
    recorder = _RecordCopies(probe)
    with torch.no_grad(), recorder:
        load(probe)
    if len(recorder.copies) != 1:
        raise ValueError(f"the loader made {len(recorder.copies)} direct copies from the HF tensor, expected 1")
    destination, source = recorder.copies[0]
    rows, columns = source.shape
    if tuple(destination.shape) != (rows, columns) or destination.stride(1) != 1 or source.stride(1) != 1:
        raise ValueError("the loader reshapes or transposes the HF tensor; in-place merges cannot follow it")
    dst_row, dst_col = divmod(destination.storage_offset() - param.storage_offset(), param.stride(0))
    src_row, src_col = divmod(source.storage_offset(), probe.stride(0))
    if dst_col != 0 or columns != param.shape[1]:
        raise ValueError("the loader writes a column block of the parameter; only row blocks are supported")
    return _span(dst_row, rows), _span(src_row, rows), _span(src_col, columns)


def check_placement(placement: Placement, found: tuple[slice, slice, slice], param_rows: int) -> None:
    """Raise ValueError if a dry-run placement differs from the closed-form one."""

    def explicit(span: slice, size: int) -> tuple[int, int]:
        start, stop, _ = span.indices(size)
        return start, stop

    rows, cols = placement.hf_shape
    expected = (
        explicit(placement.dst_rows, param_rows),
        explicit(placement.src_rows, rows),
        explicit(placement.cols, cols),
    )
    actual = (explicit(found[0], param_rows), explicit(found[1], rows), explicit(found[2], cols))
    if expected != actual:
        raise ValueError(
            f"{placement.param}: vLLM's loader places the HF rows/cols at {actual}, the LoGRA plan at {expected}"
        )
