"""The vLLM worker extension: LoGRA merges inside every vLLM worker (`worker_extension_cls`).

vLLM appends this class to its Worker's bases in each worker process, so `self` is the worker;
methods carry a `logra_` prefix because vLLM refuses names that clash with its own. The engine
calls them through `LLM.collective_rpc` (one call per update, on every TP rank); each answers the
engine's own types (`MergeMode`, `SyncResult`).

Three modes, chosen at start-up:
- in place (GPU): each HF target is a row block of a fused / TP-sharded vLLM parameter
  (`vllm_layout.layer_placements`), checked at start-up against vLLM's own weight loaders;
  payloads are merged straight into the bf16 parameters, with an error-feedback residual.
- shadow (CPU): vLLM's CPU backend repacks linear weights and drops `layer.weight`, so in-place
  edits cannot reach them. The worker keeps HF-layout copies of the targets, merges into those,
  and reloads them into vLLM (`reload_weights`) after every payload.
- resync: targets that are quantized, or whose loaders do not copy the HF tensor as a row block,
  cannot take an in-place merge; every payload is then refused (with the reason, logged once
  at start-up) and the weight sync falls back to a full resync per update.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from logra_rl.logra import (
    MergeTarget,
    PayloadMerger,
    decoder_layers,
    find_targets,
    hf_targets,
    parse_payload,
)
from logra_rl.logra.merge import new_residual
from logra_rl.rollout.base import MergeMode, SyncResult
from logra_rl.rollout.resync import BucketedResync
from logra_rl.rollout.vllm_layout import LayerGeometry, check_placement, layer_placements, loader_placement
from logra_rl.utils.memory import release_free_memory
from logra_rl.utils.state_dict import tied_duplicates
from logra_rl.utils.transfer import TRANSFER_TIMEOUT_S, Layout, TransferAddress, TransferGroup

logger = logging.getLogger(__name__)
SHARD_IDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}


def geometry_of(layer: torch.nn.Module) -> LayerGeometry:
    """Sizes and TP split of one vLLM decoder layer, read from its QKV and gate/up layers."""
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    return LayerGeometry(
        hidden=qkv.input_size,
        intermediate=gate_up.output_sizes[0],
        num_heads=qkv.total_num_heads,
        num_kv_heads=qkv.total_num_kv_heads,
        head_dim=qkv.head_size,
        tp_size=qkv.tp_size,
        tp_rank=qkv.tp_rank,
    )


# The decoder-layer modules the in-place plan maps HF targets onto (Qwen2 / Qwen2.5, Qwen3, Llama, Gemma 3
# and SmolLM2 in vLLM); any other layout fails closed to full resyncs.
FUSED_LAYOUT = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def language_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """vLLM's text model: a multimodal model's (Gemma 3's `language_model`, through vLLM's own
    `get_language_model`), or the model itself."""
    get_language_model = getattr(model, "get_language_model", None)
    return get_language_model() if callable(get_language_model) else model


def vllm_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    return getattr(getattr(language_model_of(model), "model", None), "layers", None)


def layout_refusal(model: torch.nn.Module) -> str:
    """Why `model` is not a layout the in-place (or shadow) merges know, or "" when it is."""
    layers = vllm_layers(model)
    if layers is None or len(layers) == 0:
        return f"{type(model).__name__} has no decoder layers (model.layers): not a layout the in-place merges know"
    modules = dict(layers[0].named_modules())
    missing = [name for name in FUSED_LAYOUT if name not in modules]
    if missing:
        return (
            f"{type(model).__name__} layer 0 has no {missing}: in-place merges are checked for the fused "
            f"{list(FUSED_LAYOUT)} layout (Qwen2, Qwen3, Llama)"
        )
    return ""


def in_place_targets(
    model: torch.nn.Module, residual_dtype: str, target_modules: tuple[str, ...], hf_layers: str = "model.layers"
) -> dict:
    """MergeTargets over vLLM's own parameters, each placement confirmed by a dry run of its loader; keyed by
    HF module name, under `hf_layers` (the HF model's decoder layers: `model.language_model.layers` for Gemma 3)."""
    language_model = language_model_of(model)
    params = dict(language_model.named_parameters())
    residuals: dict[str, torch.Tensor | None] = {}
    targets = {}
    for index, layer in enumerate(language_model.model.layers):
        prefix = f"model.layers.{index}"  # vLLM's name within its text model
        for local_name, placement in layer_placements(prefix, geometry_of(layer)).items():
            leaf = local_name.rsplit(".", 1)[-1]
            if leaf not in target_modules:
                continue
            name = f"{hf_layers}.{index}{local_name.removeprefix(prefix)}"
            param = params[placement.param]
            if param.numel() == 0 or param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(
                    f"{placement.param} is packed or quantized ({param.dtype}, {param.numel()} elements): "
                    "in-place LoGRA merges cannot reach it; use full resyncs for this engine"
                )
            shard = SHARD_IDS.get(leaf)
            found = loader_placement(
                param,
                lambda t, p=param, s=shard: p.weight_loader(p, t, *(() if s is None else (s,))),
                placement.hf_shape,
            )
            check_placement(placement, found, param.shape[0])
            if placement.param not in residuals:
                residuals[placement.param] = new_residual(param.data, residual_dtype)
            residual = residuals[placement.param]
            targets[name] = MergeTarget(
                param.data[placement.dst_rows],
                None if residual is None else residual[placement.dst_rows],
                placement.hf_shape,
                placement.src_rows,
                placement.cols,
            )
    return targets


class LograWorkerExtension:
    """Methods vLLM adds to its Worker; state lives in `logra_*` attributes."""

    def logra_init(
        self, target_modules: list[str], residual: str, chunk_rows: int, adapter_scale: float = 0.0
    ) -> MergeMode:
        model = self.model_runner.get_model()
        twin = _hf_twin(self.model_config.hf_config)
        shapes = {name: tuple(m.weight.shape) for name, m in find_targets(twin, tuple(target_modules))}
        hf_layers = decoder_layers(twin)[0]
        self.logra_refusal, targets = layout_refusal(model), {}
        if self.logra_refusal:
            self.logra_mode = "resync"
        elif _weights_are_packed(model):
            self.logra_mode = "shadow"
            device = next(model.parameters()).device
            weights = {
                name: torch.zeros(shape, dtype=self.model_config.dtype, device=device) for name, shape in shapes.items()
            }
            targets = hf_targets(weights, residual)
        else:
            try:
                targets = in_place_targets(model, residual, tuple(target_modules), hf_layers)
                self.logra_mode = "in_place"
            except ValueError as refusal:
                self.logra_mode, self.logra_refusal = "resync", str(refusal)
        if self.logra_mode == "resync":
            logger.warning("LoGRA in-place merges are off, every update is a full resync: %s", self.logra_refusal)
        self.logra_merger = PayloadMerger(targets, chunk_rows=chunk_rows)
        if adapter_scale:
            self.logra_merger.hold_bases()  # the checkpoint's (a shadow's zeros: not exact, so resynced at start)
        names = twin.state_dict().keys() - tied_duplicates(twin)
        self.logra_resync = BucketedResync(self.logra_merger, names, adapter_scale)
        return MergeMode(self.logra_mode, self.logra_refusal)

    def logra_apply(self, payload: np.ndarray) -> SyncResult:
        """Merge a payload (its bytes, parsed here with one copy into the factors' storage); the merger's
        version gate decides, and a refusal or failure is answered, never raised."""
        if self.logra_mode == "resync":
            return SyncResult(applied=False, version=self.logra_merger.version, reason=self.logra_refusal)
        try:
            with torch.inference_mode():
                self.logra_merger.apply(parse_payload(payload, pin_memory=torch.cuda.is_available()))
            if self.logra_mode == "shadow":
                self._logra_push_shadow()
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            return SyncResult(applied=False, version=self.logra_merger.version, reason=reason)
        finally:
            release_free_memory()
        return SyncResult(applied=True, version=self.logra_merger.version)

    def logra_load(self, state: dict[str, torch.Tensor], version: int, bucket: int, buckets: int) -> SyncResult:
        """Bucket `bucket` of `buckets` of a full resync from the trainer's HF-named fp32 state: its weights,
        then exact residuals; the last bucket sets `version` once every weight has arrived."""
        # Cast here, not in vLLM: its loader warns once per weight on a float32 -> bfloat16 copy (the same
        # round-to-nearest cast); the fp32 values are kept for the exact residuals below.
        dtype = self.vllm_config.model_config.dtype
        state = self.logra_resync.merged(state)  # a LoRA run's: base + s·B·A, its bases kept
        cast = [(name, tensor.to(dtype) if tensor.is_floating_point() else tensor) for name, tensor in state.items()]
        self._logra_reload(cast)  # in shadow mode this also reloads the bucket's targets
        with torch.inference_mode():
            self.logra_resync.receive(state, version, bucket, buckets)
        del cast
        release_free_memory()
        return SyncResult(applied=True, version=self.logra_merger.version)

    def logra_join_transfer(self, address: TransferAddress, first_rank: int) -> None:
        """Join the full resyncs' process group as rank `first_rank` + this worker's TP rank."""
        self.logra_transfer = TransferGroup(address, first_rank + self.rank, TRANSFER_TIMEOUT_S)

    def logra_receive_bucket(self, layout: Layout, version: int, bucket: int, buckets: int) -> SyncResult:
        """A bucket broadcast by train rank 0 (on this worker's device), loaded as `logra_load` loads one."""
        return self.logra_load(self.logra_transfer.receive(layout), version, bucket, buckets)

    def logra_weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Values at HF (rows, cols) of each target held by this rank (NaN where another rank holds them);
        empty in resync mode, where the weights are not readable as HF values."""
        values = {}
        for name, (rows, cols) in coordinates.items():
            target = self.logra_merger.targets.get(name)
            if target is None:
                continue
            row_start, row_stop, _ = target.rows.indices(target.hf_shape[0])
            col_start, col_stop, _ = target.cols.indices(target.hf_shape[1])
            held = (rows >= row_start) & (rows < row_stop) & (cols >= col_start) & (cols < col_stop)
            result = torch.full(rows.shape, float("nan"))
            result[held] = target.weight[rows[held] - row_start, cols[held] - col_start].float().cpu()
            values[name] = result
        return values

    def _logra_push_shadow(self) -> None:
        """Shadow mode: reload the merged HF-layout targets into vLLM's (repacked) layers."""
        weights = [(f"{name}.weight", weight) for name, weight in self.logra_merger.weights.items()]
        self._logra_reload(weights)

    def _logra_reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """`reload_weights` with some of the model's weights (one resync bucket, or the shadow targets).

        vLLM warns "Failed to load weights" for every layer a reload leaves out and lists every weight not
        in it ("Following weights were not loaded"), keeping their tensors; here that is by design
        (BucketedResync checks that every weight arrives), so both warnings are muted.
        """
        with muted(RELOAD_LOGGERS, PARTIAL_RELOAD_WARNINGS):
            self.reload_weights(weights_iterator=iter(weights))


RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
PARTIAL_RELOAD_WARNINGS = ("Failed to load weights", "Following weights were not loaded")


@contextlib.contextmanager
def muted(loggers: tuple[str, ...], messages: tuple[str, ...]) -> Iterator[None]:
    """Drop the records of `loggers` whose message contains one of `messages`, inside the block."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(muted_message in message for muted_message in messages)

    for name in loggers:
        logging.getLogger(name).addFilter(keep)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeFilter(keep)


def _weights_are_packed(model: torch.nn.Module) -> bool:
    layer = vllm_layers(model)[0]
    return layer.self_attn.qkv_proj.weight.numel() == 0


def _hf_twin(hf_config: Any) -> torch.nn.Module:
    """The HF model for vLLM's config on the meta device: the names and shapes of the HF targets."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)
