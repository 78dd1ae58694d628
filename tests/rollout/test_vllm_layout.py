"""The fused / tensor-parallel placement of LoGRA updates, checked against an independent emulation of vLLM's layout."""

import pytest
import torch

from logra_rl.logra import MergeTarget, PayloadEntry, PayloadMerger, UpdatePayload, projection_fingerprint
from logra_rl.rollout.vllm_layout import LayerGeometry, layer_placements, loader_placement, local_shapes

PREFIX = "model.layers.0"
LEAVES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
GEOMETRIES = {
    "qwen2-like": dict(hidden=64, intermediate=96, num_heads=8, num_kv_heads=2, head_dim=8),
    "qwen3-like (heads·head_dim ≠ hidden)": dict(hidden=48, intermediate=64, num_heads=8, num_kv_heads=4, head_dim=16),
    "MQA": dict(hidden=32, intermediate=64, num_heads=8, num_kv_heads=1, head_dim=8),
    "no GQA": dict(hidden=32, intermediate=32, num_heads=8, num_kv_heads=8, head_dim=4),
    "SmolLM2-135M (9 / 3 heads)": dict(hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64),
}


def tensor_parallel_sizes(name: str) -> tuple[int, ...]:
    """The TP sizes vLLM accepts for a geometry: the KV heads split evenly (or are replicated) over ranks."""
    heads, kv_heads = GEOMETRIES[name]["num_heads"], GEOMETRIES[name]["num_kv_heads"]
    return tuple(tp for tp in (1, 2, 3, 4, 8) if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0))


def hf_layer(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, i = sizes["hidden"], sizes["intermediate"]
    q, kv = sizes["num_heads"] * sizes["head_dim"], sizes["num_kv_heads"] * sizes["head_dim"]
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}
    return {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}


def emulate_local(hf, sizes, tp, rank):
    """vLLM's local weights on `rank`, re-stated with chunk() — independently of layer_placements."""
    nkv, d = sizes["num_kv_heads"], sizes["head_dim"]
    q = hf["q"].chunk(tp)[rank]
    if tp >= nkv:  # each rank holds one (replicated) KV head
        head = rank // (tp // nkv)
        k, v = (hf[x].view(nkv, d, -1)[head] for x in ("k", "v"))
    else:
        k, v = hf["k"].chunk(tp)[rank], hf["v"].chunk(tp)[rank]
    return {
        "self_attn.qkv_proj.weight": torch.cat([q, k, v]),
        "self_attn.o_proj.weight": hf["o"].chunk(tp, dim=1)[rank].clone(),
        "mlp.gate_up_proj.weight": torch.cat([hf["gate"].chunk(tp)[rank], hf["up"].chunk(tp)[rank]]),
        "mlp.down_proj.weight": hf["down"].chunk(tp, dim=1)[rank].clone(),
    }


def payload_for(hf, rank=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    entries = tuple(
        PayloadEntry(f"{PREFIX}.{leaf}", *hf[key].shape, (torch.randn(hf[key].shape[0], rank, generator=g) * 1e-2))
        for key, leaf in LEAVES.items()
    )
    draft = UpdatePayload(0, 1, 7, 0, rank, "rademacher", "float32", "", entries)
    fingerprint = projection_fingerprint(draft.projection(entries[0]))
    return UpdatePayload(0, 1, 7, 0, rank, "rademacher", "float32", fingerprint, entries)


def updated(hf, payload):
    out = dict(hf)
    for key, entry in zip(LEAVES, payload.entries, strict=True):
        out[key] = hf[key] - entry.factor @ payload.projection(entry)
    return out


def targets_on(local, geometry):
    return {
        name: MergeTarget(local[p.param.removeprefix(f"{PREFIX}.")][p.dst_rows], None, p.hf_shape, p.src_rows, p.cols)
        for name, p in layer_placements(PREFIX, geometry).items()
    }


CASES = [(name, tp) for name in GEOMETRIES for tp in tensor_parallel_sizes(name)]


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_in_place_apply_equals_resharding_the_updated_hf_weights(name, tp):
    sizes = GEOMETRIES[name]
    hf = hf_layer(sizes)
    payload = payload_for(hf)
    expected_hf = updated(hf, payload)
    for rank in range(tp):
        geometry = LayerGeometry(**sizes, tp_size=tp, tp_rank=rank)
        local = emulate_local(hf, sizes, tp, rank)
        assert {k: tuple(v.shape) for k, v in local.items()} == local_shapes(geometry)
        PayloadMerger(targets_on(local, geometry)).apply(payload)
        for param, expected in emulate_local(expected_hf, sizes, tp, rank).items():
            torch.testing.assert_close(local[param], expected, rtol=0, atol=1e-6, msg=f"{param} rank {rank}")


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_every_local_row_is_written_once(name, tp):
    sizes = GEOMETRIES[name]
    for rank in range(tp):
        geometry = LayerGeometry(**sizes, tp_size=tp, tp_rank=rank)
        shapes = local_shapes(geometry)
        for fused in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
            covered = torch.zeros(shapes[fused][0], dtype=torch.int)
            for p in layer_placements(PREFIX, geometry).values():
                if p.param.endswith(fused):
                    covered[p.dst_rows] += 1
            assert bool((covered == 1).all()), (fused, rank)


@pytest.mark.parametrize("name", ["qwen2-like", "MQA"])
def test_replicated_kv_heads_stay_identical_and_row_parallel_parts_sum_to_the_full_update(name):
    sizes, tp = GEOMETRIES[name], 8
    hf = hf_layer(sizes)
    payload = payload_for(hf)
    locals_ = []
    for rank in range(tp):
        local = emulate_local(hf, sizes, tp, rank)
        PayloadMerger(targets_on(local, LayerGeometry(**sizes, tp_size=tp, tp_rank=rank))).apply(payload)
        locals_.append(local)
    replicas = tp // sizes["num_kv_heads"]
    for rank in range(tp):
        same_head = (rank // replicas) * replicas
        kv = slice(sizes["num_heads"] // tp * sizes["head_dim"], None)
        assert torch.equal(
            locals_[rank]["self_attn.qkv_proj.weight"][kv], locals_[same_head]["self_attn.qkv_proj.weight"][kv]
        )
    x = torch.randn(5, sizes["intermediate"])
    delta = updated(hf, payload)["down"] - hf["down"]
    parts = [
        x.chunk(tp, dim=1)[rank]
        @ (locals_[rank]["mlp.down_proj.weight"] - emulate_local(hf, sizes, tp, rank)["mlp.down_proj.weight"]).T
        for rank in range(tp)
    ]
    torch.testing.assert_close(sum(parts), x @ delta.T, rtol=1e-5, atol=1e-6)


def test_bf16_shards_with_fp32_residual_equal_the_rounded_master_bit_for_bit():
    sizes, tp = GEOMETRIES["qwen2-like"], 2
    master = hf_layer(sizes)
    mergers, locals_ = [], []
    for rank in range(tp):
        local = {k: v.to(torch.bfloat16) for k, v in emulate_local(master, sizes, tp, rank).items()}
        residual = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in local.items()}
        geometry = LayerGeometry(**sizes, tp_size=tp, tp_rank=rank)
        targets = {
            name: MergeTarget(
                local[key := p.param.removeprefix(f"{PREFIX}.")][p.dst_rows],
                residual[key][p.dst_rows],
                p.hf_shape,
                p.src_rows,
                p.cols,
            )
            for name, p in layer_placements(PREFIX, geometry).items()
        }
        merger = PayloadMerger(targets)
        merger.resync({f"{PREFIX}.{leaf}": master[key] for key, leaf in LEAVES.items()}, version=0)
        mergers.append(merger)
        locals_.append(local)
    for step in range(10):
        payload = payload_for(master, seed=step)
        payload = UpdatePayload(step, step + 1, 7, 0, 4, "rademacher", "float32", payload.fingerprint, payload.entries)
        master = updated(master, payload)
        for merger in mergers:
            merger.apply(payload)
    for rank in range(tp):
        for param, expected in emulate_local(master, sizes, tp, rank).items():
            assert torch.equal(locals_[rank][param], expected.to(torch.bfloat16)), (param, rank)


def test_a_repacking_loader_fails_closed():
    param = torch.zeros(4, 8)

    def repacking(tensor):
        param.copy_(tensor.t().contiguous().t() * 1)  # copies through a temporary, as quantized loaders do

    with pytest.raises(ValueError, match="made 0 direct copies"):
        loader_placement(param, repacking, (4, 8))
