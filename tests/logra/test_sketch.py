"""Sketch exactness: S = G·Aᵀ without forming G, with and without activation checkpointing."""

import copy
import gc
import weakref

import pytest
import torch

from logra_rl.logra import LoGRAConfig, LoGRAOptimizer
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss

MICROBATCHES = [random_batch(2, 12, seed=s) for s in range(3)]


def _enable_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF only checkpoints in train mode; the tiny model has no dropout


@pytest.mark.parametrize("checkpointed", [False, True])
def test_sketch_equals_dense_gradient_times_projection(checkpointed):
    model = tiny_qwen3(seed=1)
    dense = copy.deepcopy(model)
    keys_before = set(model.state_dict())
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    assert set(model.state_dict()) == keys_before  # no parameters or buffers added
    if checkpointed:
        _enable_checkpointing(model)
        _enable_checkpointing(dense)
    forward_calls = []
    opt.targets[0].module.register_forward_hook(lambda *_: forward_calls.append(1))

    for batch in MICROBATCHES:
        token_sum_loss(model, batch).backward()
        token_sum_loss(dense, batch).backward()

    assert len(forward_calls) == (6 if checkpointed else 3)  # checkpointing really recomputed the forward
    dense_modules = dict(dense.named_modules())
    for target in opt.targets:
        assert target.module.weight.grad is None
        gradient = dense_modules[target.name].weight.grad
        expected = gradient @ target.projection.t()
        torch.testing.assert_close(target.sketch, expected, rtol=1e-5, atol=1e-6)
        assert target.contributions == 3
    assert all(p.grad is None for p in model.parameters())


def test_targeted_linear_keeps_projected_input_not_input():
    """Autograd keeps P = x·Aᵀ (tokens × rank) for a targeted layer, never x (tokens × k_in)."""
    model = tiny_qwen3(seed=1)
    dense = copy.deepcopy(model)
    LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    dense.requires_grad_(True)

    def saved_shapes(net, name):
        module = net.get_submodule(name)
        saved, context = [], {}

        def pre_hook(*_):
            context["hooks"] = torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append((tuple(t.shape), t.data_ptr())) or t, lambda t: t
            )
            context["hooks"].__enter__()

        def post_hook(*_):
            context["hooks"].__exit__(None, None, None)

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        token_sum_loss(net, MICROBATCHES[0])
        return module, saved

    for name in ("model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        module, saved = saved_shapes(model, name)
        tokens = MICROBATCHES[0].numel()
        weight_ptr = module.weight.data_ptr()
        activations = [shape for shape, ptr in saved if ptr != weight_ptr]
        assert activations == [(tokens, 8)], activations  # only P
        _, dense_saved = saved_shapes(dense, name)
        assert (tokens, module.in_features) in [shape for shape, _ in dense_saved]  # the dense layer keeps x


def test_projected_input_is_freed_with_the_graph_and_repeated_backward_adds_twice():
    model = tiny_qwen3(seed=1)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    target = opt.targets[-1]
    projected = []  # weak references to every saved P (tokens × rank)

    def pack(tensor):
        if tuple(tensor.shape) == (MICROBATCHES[0].numel(), 8):
            projected.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = token_sum_loss(model, MICROBATCHES[0])
    assert len(projected) == len(opt.targets)
    loss.backward(retain_graph=True)
    once = target.sketch.clone()
    loss.backward()
    torch.testing.assert_close(target.sketch, 2 * once)
    gc.collect()
    assert loss.requires_grad  # the loss tensor is still referenced ...
    assert all(ref() is None for ref in projected)  # ... yet every saved P was released


def test_no_sketch_without_grad_mode():
    model = tiny_qwen3(seed=1)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, seed=3))
    with torch.no_grad():
        model(input_ids=MICROBATCHES[0])
    assert all(t.contributions == 0 and not t.sketch.any() for t in opt.targets)
    with pytest.raises(RuntimeError, match="no gradient reached the LoGRA sketches"):
        opt.prepare(num_tokens=10)
