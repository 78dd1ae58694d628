"""The payloads (LoGRA's UpdatePayload, LoRA's AdapterPayload): byte format, size, integrity."""

import dataclasses

import numpy as np
import pytest
import torch

from logra_rl.logra import (
    AdapterEntry,
    AdapterPayload,
    LoGRAConfig,
    LoGRAOptimizer,
    PayloadEntry,
    PayloadFormatError,
    UpdatePayload,
    parse_payload,
)
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss

QWEN25_15B = {"hidden": 1536, "intermediate": 8960, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128}


def committed_payload(wire_dtype="bfloat16"):
    model = tiny_qwen3(seed=3)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=9, wire_dtype=wire_dtype))
    batch = random_batch(2, 16)
    token_sum_loss(model, batch).backward()
    opt.prepare(num_tokens=30)
    return opt.commit(0.8)


def layer_shapes(shape):
    """(name, d_out, k_in) of the 7 targets of every decoder layer."""
    h, i = shape["hidden"], shape["intermediate"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    per_layer = [
        ("self_attn.q_proj", q, h),
        ("self_attn.k_proj", kv, h),
        ("self_attn.v_proj", kv, h),
        ("self_attn.o_proj", h, q),
        ("mlp.gate_proj", i, h),
        ("mlp.up_proj", i, h),
        ("mlp.down_proj", h, i),
    ]
    return [(f"model.layers.{n}.{leaf}", d, k) for n in range(shape["layers"]) for leaf, d, k in per_layer]


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float32"])
def test_byte_round_trip(wire_dtype):
    payload = committed_payload(wire_dtype)
    data = payload.to_bytes()
    assert b"\x80\x04" not in data[:16]  # not a pickle stream
    restored = UpdatePayload.from_bytes(data)
    for field in dataclasses.fields(UpdatePayload):
        if field.name != "entries":
            assert getattr(restored, field.name) == getattr(payload, field.name), field.name
    assert len(restored.entries) == len(payload.entries) == 14
    for a, b in zip(payload.entries, restored.entries, strict=True):
        assert (a.name, a.d_out, a.k_in) == (b.name, b.d_out, b.k_in)
        assert b.factor.dtype == a.factor.dtype and torch.equal(a.factor, b.factor)
        assert restored.seed(b) == payload.seed(a)
        assert torch.equal(restored.projection(b), payload.projection(a))
    restored.entries[0].factor.add_(1)  # factors are writable and do not alias the input bytes
    assert UpdatePayload.from_bytes(data).entries[0].factor.equal(payload.entries[0].factor)


def test_size_is_factors_plus_small_metadata_for_a_28_layer_model():
    rank = 4
    entries = tuple(
        PayloadEntry(name, d, k, torch.randn(d, rank).to(torch.bfloat16)) for name, d, k in layer_shapes(QWEN25_15B)
    )
    payload = UpdatePayload(
        base_version=1234,
        new_version=1235,
        base_seed=42,
        projection_update=1234,
        rank=rank,
        distribution="rademacher",
        wire_dtype="bfloat16",
        fingerprint="0" * 32,
        entries=entries,
    )
    factor_bytes = sum(d * rank * 2 for _, d, _ in layer_shapes(QWEN25_15B))
    size = len(payload.to_bytes())
    assert payload.factor_bytes == factor_bytes
    assert 0 < size - factor_bytes < 4096, size - factor_bytes  # measured: ~1 KiB
    assert len(entries) == 196


def test_corrupted_or_foreign_bytes_are_rejected():
    data = committed_payload().to_bytes()
    with pytest.raises(PayloadFormatError, match="magic"):
        UpdatePayload.from_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(PayloadFormatError, match="truncated"):
        UpdatePayload.from_bytes(data[:-10])
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    with pytest.raises(PayloadFormatError, match="digest"):
        UpdatePayload.from_bytes(bytes(flipped))
    header_hit = bytearray(data)
    header_hit[20] ^= 0xFF
    with pytest.raises(PayloadFormatError):
        UpdatePayload.from_bytes(bytes(header_hit))


def test_factors_must_be_in_the_wire_dtype():
    entry = PayloadEntry("model.layers.0.self_attn.q_proj", 4, 8, torch.zeros(4, 2))  # fp32, wire says bf16
    with pytest.raises(ValueError, match="factors must be exactly what the trainer merged"):
        UpdatePayload(0, 1, 42, 0, 2, "rademacher", "bfloat16", "0" * 32, (entry,))


def adapter_payload_of(base_version=3):
    entries = (
        AdapterEntry("model.layers.0.self_attn.q_proj", 6, 5, torch.randn(6, 2), torch.randn(2, 5)),
        AdapterEntry("model.layers.0.mlp.down_proj", 5, 7, torch.randn(5, 2), torch.randn(2, 7)),
    )
    return AdapterPayload(base_version, base_version + 1, 2, 0.5, entries)


def test_adapter_payloads_round_trip_bit_for_bit_and_are_told_apart_by_their_magic():
    payload = adapter_payload_of()
    data = np.frombuffer(bytes(payload.to_bytes()), dtype=np.uint8)  # as Ray delivers it: a read-only array
    parsed = parse_payload(data)
    assert isinstance(parsed, AdapterPayload)
    assert (parsed.base_version, parsed.new_version, parsed.rank, parsed.scale) == (3, 4, 2, 0.5)
    for got, sent in zip(parsed.entries, payload.entries, strict=True):
        assert (got.name, got.d_out, got.k_in) == (sent.name, sent.d_out, sent.k_in)
        assert torch.equal(got.b, sent.b) and torch.equal(got.a, sent.a)
    assert isinstance(parse_payload(committed_payload().to_bytes()), UpdatePayload)
    with pytest.raises(PayloadFormatError, match="magic"):
        UpdatePayload.from_bytes(payload.to_bytes())  # one format is never read as the other
    flipped = bytearray(payload.to_bytes())
    flipped[-3] ^= 0x10
    with pytest.raises(PayloadFormatError, match="digest"):
        parse_payload(bytes(flipped))


def test_adapters_must_be_the_trainers_fp32_values():
    entry = AdapterEntry("model.layers.0.self_attn.q_proj", 6, 5, torch.zeros(6, 2).bfloat16(), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="exactly what the trainer holds"):
        AdapterPayload(0, 1, 2, 1.0, (entry,))
