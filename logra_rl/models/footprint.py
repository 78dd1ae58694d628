"""What a model's memory depends on, read from its config alone (no weight is loaded), and the `Part`s a
process holds of it, which each component names for the memory plan (`orchestration.memory_plan`).

Parameter counts come from the model built on the meta device. The activations a decoder layer keeps for
backward are traced there too: one layer runs on meta tensors under saved-tensor hooks, which see every
tensor autograd saves (their shapes and dtypes, no data), with attention as the fused kernels save it (q, k,
v, the output and the log-sum-exp; no tokens × tokens matrix). So a new architecture needs no table, and the
count is the model's own code: which norms upcast, which products are saved, which weights are frozen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from logra_rl.logra import find_targets

TRACE_TOKENS = 64  # the trace is linear in the token count once attention is fused
# When a process holds a part: for the whole run, or in one phase of the synchronous loop
RESIDENT, LOADING, TRAINING, GENERATING, SYNCING = "resident", "loading", "training", "generating", "syncing"
PHASES = (LOADING, TRAINING, GENERATING, SYNCING)


@dataclass(frozen=True)
class Part:
    """Bytes a process holds for one purpose, for the whole run or in one phase."""

    name: str
    nbytes: float
    phase: str = RESIDENT
    on_host: bool = False  # host memory of a process that computes on a GPU


@dataclass(frozen=True)
class Lengths:
    """Token lengths the plan sizes buffers for: the longest prompt, and prompt plus the longest response."""

    prompt: int
    sequence: int


@dataclass(frozen=True)
class Machine:
    """What the run's devices have: the host's memory the run may use, each GPU's total (None: unknown)."""

    cuda: bool
    host: float | None
    gpu: float | None


@dataclass(frozen=True)
class ModelFootprint:
    """Counts and per-token sizes of one model (bytes are for the given compute dtype)."""

    params: int  # every parameter once (tied weights once)
    layer_params: int  # one decoder layer
    layers: int
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    checkpoint_bytes: int  # bytes per parameter as the checkpoint stores them
    targets: tuple[tuple[int, int], ...]  # (d_out, k_in) of every LoGRA / LoRA target
    saved_frozen: int  # bytes one layer saves for backward per token, every weight frozen (LoGRA, LoRA)
    saved_trainable: int  # the same with every weight trained (dense)
    compute_bytes: int  # bytes per element of the compute dtype the saved sizes are in

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, an untied LM head."""
        return self.params - self.layers * self.layer_params

    @property
    def target_params(self) -> int:
        return sum(d_out * k_in for d_out, k_in in self.targets)

    @property
    def target_rows(self) -> int:
        return sum(d_out for d_out, _ in self.targets)

    @property
    def target_cols(self) -> int:
        return sum(k_in for _, k_in in self.targets)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """Key + value bytes of one token on one tensor-parallel rank (KV heads replicate past their count)."""
        return 2 * self.layers * max(1, self.kv_heads // tensor_parallel) * self.head_dim * dtype_bytes


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (flash, memory-efficient, CPU flash) saves for backward."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


class _FusedAttentionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


def _saved_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, trainable: bool) -> int:
    """Bytes one decoder layer saves for backward per token (its input included, weights excluded)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.requires_grad_(trainable)
    decoder = model.get_decoder()
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:  # a view of a weight costs nothing; shared storage counts once
            saved[storage._cdata] = max(saved.get(storage._cdata, 0), storage.nbytes())
        return tensor

    hidden = torch.empty((1, TRACE_TOKENS, config.hidden_size), dtype=dtype, device="meta", requires_grad=True)
    positions = torch.arange(TRACE_TOKENS, device="meta")[None]
    layer_types = getattr(config, "layer_types", None)
    try:  # Gemma 3 keys its rotary embeddings by layer type
        rotary = decoder.rotary_emb(hidden, positions, layer_types[0]) if layer_types else None
    except TypeError:
        rotary = None
    rotary = rotary if rotary is not None else decoder.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _FusedAttentionMode():
        decoder.layers[0](hidden_states=hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    return -(-sum(saved.values()) // TRACE_TOKENS)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@cache
def model_footprint(model_path: str, target_modules: tuple[str, ...], compute_dtype: str) -> ModelFootprint:
    """The footprint of the model at `model_path` (a directory or hub id with a config.json)."""
    config = AutoConfig.from_pretrained(model_path)
    text = getattr(config, "text_config", config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = model.get_decoder()
    dtype = getattr(torch, compute_dtype)
    stored = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelFootprint(
        params=_params(model),
        layer_params=_params(decoder.layers[0]),
        layers=len(decoder.layers),
        vocab=text.vocab_size,
        hidden=text.hidden_size,
        heads=text.num_attention_heads,
        kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        checkpoint_bytes=torch.finfo(stored).bits // 8,
        targets=tuple((m.out_features, m.in_features) for _, m in find_targets(model, target_modules)),
        saved_frozen=_saved_bytes_per_token(text, dtype, trainable=False),
        saved_trainable=_saved_bytes_per_token(text, dtype, trainable=True),
        compute_bytes=torch.finfo(dtype).bits // 8,
    )
