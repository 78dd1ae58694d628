"""The step loop end to end through Ray: 2 FSDP2 train workers + 1 HF rollout engine on CPU."""

import math

import pytest
import ray
import torch
from hydra import compose, initialize_config_module

from logra_rl.config import RunConfig
from logra_rl.logra import UpdatePayload, split_master
from logra_rl.orchestration.controller import started
from logra_rl.train.api import LowRankPayloads, NoChange, PayloadRef
from logra_rl.train.batch import pack_batch
from tests.models.test_loading import save_as

REQUIRED = [
    "reward/mean",
    "reward/baseline",
    "reward/grader_timeouts",
    "response_length/mean",
    "response_length/clip_ratio",
    "train/loss",
    "train/is_ratio_mean",
    "logra/alpha",
    "logra/kl_budget",
    "logra/kl_proposed",
    "train/kl_realized",
    "logra/update_ratio",
    "sync/payload_bytes",
    "sync/drift",
    "train/mismatch",
    "memory/train_avg_gib",
    "memory/train_peak_gib",
    "timing_s/rollout",
    "timing_s/reward",
    "timing_s/train",
    "timing_s/forward",
    "timing_s/backward",
    "timing_s/update",
    "timing_s/sync",
    "timing_s/step",
    "perf/updates_per_hour",
]


def run_config(overrides):
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return compose("config", overrides=overrides)


def next_batch(controller, prompts=16, seed=5, advantages=None):
    """One step's rollouts, graded and packed, as the step loop builds them."""
    chosen = controller.sampler.next_batch(prompts)
    completions = controller.rollout.generate([p.token_ids for p in chosen], controller.sampling(), seed=seed)
    rewards, _ = controller.grader.grade(chosen, completions)
    if advantages is None:
        advantages = controller.advantages(rewards, completions)
    return pack_batch(completions, advantages, controller.workload.pad_id)


def target_grid(controller):
    """Every coordinate of every LoGRA target, as drift-check coordinates."""
    grid = {
        name: torch.cartesian_prod(torch.arange(r), torch.arange(c)).T
        for name, (r, c) in controller.weight_sync.targets.items()
    }
    return {name: (g[0], g[1]) for name, g in grid.items()}


def test_steps_through_ray_keep_rollout_weights_equal_to_rounded_master(tmp_path, quickstart_model):
    cfg = run_config(
        [
            "model=hf",
            f"model.path={quickstart_model}",
            "trainer.prompts_per_step=15",  # shards of 8 and 7 rows ...
            "trainer.micro_batch_tokens=20",  # ... one row per microbatch: unequal counts, FSDP must not hang
            "trainer.grader_timeout_s=1",
            "data.reward=tests.orchestration.slow_reward:hangs_on_three",
            "logger.progress=false",
        ]
    )
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        history = [controller.step(step) for step in range(3)]
        evaluation = controller.evaluator.evaluate(3)
        # a duplicated payload is refused by the version gate; the weight sync resyncs and carries on
        result = controller.train.train_step(next_batch(controller), 3)
        [sent] = result.update.payloads  # a reference: the bytes stay in the object store, put by train rank 0
        received = UpdatePayload.from_bytes(ray.get(sent.ref))  # what every engine reads
        duplicate = LowRankPayloads(result.update.payloads * 2)
        duplicate = controller.weight_sync.sync(duplicate, result.policy_version, step=3)
        master = controller.train.full_state()
        grid = target_grid(controller)
        rollout = controller.rollout.weights_at(grid)[0]

    for metrics in history:
        missing = [key for key in REQUIRED if key not in metrics]
        assert not missing, missing
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["sync/drift"] == 0.0
        assert metrics["sync/payload_bytes"] > 0 and metrics["sync/refused"] == 0
        assert metrics["timing_s/step"] < 30  # a hung grader costs at most its timeout
        inside = sum(metrics[f"timing_s/{phase}"] for phase in ("forward", "backward", "update"))
        assert 0 < inside <= metrics["timing_s/train"]  # the worker's phases, timed inside the driver's train
    # logra.kl.estimator=previous predicts from the committed steps: the first update has nothing to predict from
    assert "logra/kl_predicted" not in history[0] and all("logra/kl_predicted" in m for m in history[1:])
    assert sum(m["reward/grader_timeouts"] for m in history) > 0  # answer "3" hangs and was cut off
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0]
    assert set(evaluation) == {"eval/quickstart/pass@1", "eval/quickstart/pass@4", "eval/quickstart/pass@1_stderr"}
    # 10 prompts x 4 samples: each prompt's variance term is at most 1/(4·3), so the error at most 1/(2·√(10·3))
    assert 0 <= evaluation["eval/quickstart/pass@1_stderr"] <= 1 / (2 * 30**0.5)
    assert isinstance(sent, PayloadRef) and (sent.base_version, sent.new_version) == (3, 4)
    assert (received.base_version, received.new_version) == (3, 4) and sent.nbytes > received.factor_bytes
    assert duplicate["sync/refused"] == 1 and duplicate["sync/full_resync_bytes"] > 0
    assert duplicate["sync/drift"] == 0.0
    for name, (rows, cols) in grid.items():
        expected = split_master(master[f"{name}.weight"][rows, cols])[0].float()  # the default tail residual
        assert torch.equal(rollout[name], expected), name


def test_engines_that_read_an_exact_checkpoint_start_without_a_resync(tmp_path, quickstart_model, capsys):
    """bf16 engines that read a bf16 checkpoint hold bf16(master) already: no full resync at start, and they
    sample exactly what they sample after one."""
    model = save_as(quickstart_model, tmp_path / "bf16", torch.bfloat16)
    cfg = run_config(["model=hf", f"model.path={model}", "trainer.prompts_per_step=8", "logger.progress=false"])
    with started(RunConfig.from_mapping(cfg), tmp_path / "run", {}) as controller:
        said = capsys.readouterr().out
        prompts = [p.token_ids for p in controller.sampler.next_batch(8)]
        before = controller.rollout.generate(prompts, controller.sampling(), seed=3)
        controller.weight_sync.full_resync(controller.policy_version)
        after = controller.rollout.generate(prompts, controller.sampling(), seed=3)
        first = controller.step(0)
    assert "no resync at start" in said
    assert [(c.token_ids, c.logprobs) for c in after] == [(c.token_ids, c.logprobs) for c in before]
    assert first["sync/drift"] == 0.0 and first["sync/payload_bytes"] > 0


def test_dense_and_ppo_epochs_sync_through_the_same_loop(tmp_path, quickstart_model):
    """optimizer=dense resyncs full weights every step; GRPO with 2 PPO epochs commits 2 LoGRA payloads a step."""
    common = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    grpo = ["algorithm=grpo", "rollout.n=4", "algorithm.epochs=2"]
    for overrides, per_step in ((["optimizer=dense", "optimizer.lr=1e-3"], 1), (grpo, 2)):
        config = RunConfig.from_mapping(run_config(common + overrides))
        with started(config, tmp_path / str(per_step), {}) as controller:
            history = [controller.step(step) for step in range(2)]
        assert [m["policy/version"] for m in history] == [per_step, 2 * per_step]
        for metrics in history:
            assert metrics["sync/drift"] == 0.0 and math.isfinite(metrics["train/loss"])
            if per_step == 1:  # dense: no payload, a full resync of bf16(master) instead
                assert metrics["sync/payload_bytes"] == 0 and metrics["sync/full_resync_bytes"] > 0
                assert metrics["train/lr"] > 0
            else:
                assert metrics["sync/payload_bytes"] > 0 and metrics["sync/full_resync_bytes"] == 0


def test_lora_baseline_sends_its_adapters_and_the_engines_hold_the_merged_weights_exactly(tmp_path, quickstart_model):
    """optimizer=lora: peft adapters under FSDP2. The engines get the adapters of each update (no full resync after
    the start, whose buckets carry the bases with their adapters), and hold bf16 of the trainer's merged
    W + s·B·A at every coordinate of every target, also after a forced full resync (step 1) and the payload
    that follows it (step 2), which sets the targets from the bases that resync delivered."""
    overrides = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    overrides += ["optimizer=lora", "optimizer.lr=1e-2", "optimizer.lora_rank=4", "sync.resync_every=2"]
    overrides += ["sync.bucket_mb=0.05"]  # ~50 kB: the base weights and adapters stream in several buckets
    with started(RunConfig.from_mapping(run_config(overrides)), tmp_path, {}) as controller:
        assert len(controller.weight_sync.buckets) > 2
        history = [controller.step(step) for step in range(3)]
        master = controller.train.full_state()
        (engine,) = controller.rollout.weights_at(target_grid(controller))
    assert "model.layers.0.self_attn.q_proj.weight" in master and not any("lora" in k for k in master)
    assert [m["sync/full_resync_bytes"] > 0 for m in history] == [False, True, False]
    for metrics in history:
        assert metrics["sync/payload_bytes"] > 0 and metrics["sync/refused"] == 0
        assert metrics["sync/drift"] == 0.0  # engines hold bf16 of the merged weights
        assert metrics["train/grad_norm"] > 0 and metrics["train/skipped"] == 0
    for name, values in engine.items():
        expected = split_master(master[f"{name}.weight"])[0].float().flatten()
        assert torch.equal(values, expected), name
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(quickstart_model).state_dict()
    moved = (
        master["model.layers.0.self_attn.q_proj.weight"] - original["model.layers.0.self_attn.q_proj.weight"]
    ).abs()
    assert float(moved.max()) > 0  # the adapters moved the merged weight ...
    assert torch.equal(master["model.embed_tokens.weight"], original["model.embed_tokens.weight"])  # ... only there


def test_a_skipped_logra_update_changes_and_sends_nothing(tmp_path, quickstart_model):
    """Non-finite advantages make a non-finite sketch: the update is skipped (NoChange), no payload and no
    resync reach the engines, whose weights and versions stay as they were; the next step goes on."""
    overrides = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    with started(RunConfig.from_mapping(run_config(overrides)), tmp_path, {}) as controller:
        controller.step(0)
        grid = target_grid(controller)
        versions, before = list(controller.weight_sync.engine_versions), controller.rollout.weights_at(grid)
        master_before = controller.train.weights_at(grid)
        batch = next_batch(controller, prompts=8, advantages=torch.full((8,), float("nan")))
        result = controller.train.train_step(batch, 1)
        sync = controller.weight_sync.sync(result.update, result.policy_version, step=1)
        after, master_after = controller.rollout.weights_at(grid), controller.train.weights_at(grid)
        versions_after = list(controller.weight_sync.engine_versions)
        following = controller.step(2)
    assert isinstance(result.update, NoChange) and "NaN or Inf" in result.update.reason
    assert result.policy_version == 1 and result.metrics["train/skipped"] == 1.0
    assert "logra/alpha" not in result.metrics
    assert sync["sync/payload_bytes"] == 0 and sync["sync/full_resync_bytes"] == 0 and sync["sync/refused"] == 0
    assert sync["sync/drift"] == 0.0
    assert versions == versions_after == [1]
    for name in grid:
        assert torch.equal(before[0][name], after[0][name]), name
        assert torch.equal(master_before[name], master_after[name]), name
    assert following["policy/version"] == 2.0 and following["sync/payload_bytes"] > 0
    assert following["sync/drift"] == 0.0


def test_a_step_with_every_advantage_zero_trains_and_sends_nothing(tmp_path, quickstart_model):
    """GRPO groups with no reward spread carry no gradient: no train step runs, no weight moves, no payload or
    resync is sent, the policy version stays, and the metrics say the step's update was skipped."""
    overrides = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=4", "logger.progress=false"]
    overrides += ["algorithm=grpo", "rollout.n=4", "data.reward=tests.orchestration.fixed_reward:always_zero"]
    with started(RunConfig.from_mapping(run_config(overrides)), tmp_path, {}) as controller:
        grid = target_grid(controller)
        before, master_before = controller.rollout.weights_at(grid), controller.train.weights_at(grid)
        history = [controller.step(step) for step in range(2)]
        after, master_after = controller.rollout.weights_at(grid), controller.train.weights_at(grid)
        versions = list(controller.weight_sync.engine_versions)
    for metrics in history:
        assert metrics["reward/mean"] == 0.0 and metrics["train/skipped"] == 1.0
        assert metrics["policy/version"] == 0.0 and versions == [0]
        assert metrics["sync/payload_bytes"] == 0 and metrics["sync/full_resync_bytes"] == 0
        assert not any(key.startswith(("logra/", "train/loss")) for key in metrics)
    for name in grid:
        assert torch.equal(before[0][name], after[0][name]), name
        assert torch.equal(master_before[name], master_after[name]), name


def test_a_gemma3_checkpoint_trains_its_nested_decoder_and_merges_in_place(tmp_path):
    """The official Gemma 3 checkpoints are `Gemma3ForConditionalGeneration`, their decoder under
    `model.language_model`: the train group shards and trains those layers, the engine merges the payloads in
    place, and the vision tower (with `q_proj`s of its own) is neither trained nor sent."""
    from logra_rl.data import quickstart
    from logra_rl.models.tiny import char_tokenizer
    from tests.tiny_models import tiny_gemma3_multimodal

    tokenizer = char_tokenizer(quickstart.ALPHABET)
    model = tiny_gemma3_multimodal(tokenizer)
    model.save_pretrained(tmp_path / "gemma3")
    tokenizer.save_pretrained(tmp_path / "gemma3")
    original = model.state_dict()
    overrides = ["model=hf", f"model.path={tmp_path / 'gemma3'}", "trainer.prompts_per_step=8"]
    overrides += ["logger.progress=false", "data.reward=tests.orchestration.fixed_reward:response_length"]
    with started(RunConfig.from_mapping(run_config(overrides)), tmp_path / "run", {}) as controller:
        history = [controller.step(step) for step in range(2)]
        master = controller.train.full_state()
        grid = target_grid(controller)
        rollout = controller.rollout.weights_at(grid)[0]
    assert len(controller.targets) == 14 and all(
        n.startswith("model.language_model.layers.") for n in controller.targets
    )
    for metrics in history:
        assert metrics["sync/payload_bytes"] > 0 and metrics["sync/refused"] == 0
        assert metrics["sync/full_resync_bytes"] == 0 and metrics["sync/drift"] == 0.0
    assert history[-1]["policy/version"] == 2
    moved = [k for k in master if not torch.equal(master[k], original[k])]
    assert moved and all(k.startswith("model.language_model.layers.") for k in moved)
    for name, (rows, cols) in grid.items():
        expected = split_master(master[f"{name}.weight"][rows, cols])[0].float()
        assert torch.equal(rollout[name], expected), name


def test_a_logra_run_whose_engines_cannot_merge_in_place_stops_unless_full_resyncs_are_allowed(capsys):
    """Every update of such a run would be a full fp32 resync (minutes a step at 7B): it must not start
    silently, and the error names the engine's reason and the way out."""
    from logra_rl.orchestration.weight_sync import InPlaceMergeRefused, check_in_place
    from logra_rl.rollout import MergeMode

    refused = [MergeMode("in_place"), MergeMode("resync", "Phi3ForCausalLM layer 0 has no ['mlp.gate_up_proj']")]
    with pytest.raises(InPlaceMergeRefused, match=r"Phi3ForCausalLM.*sync.allow_resync_fallback=true"):
        check_in_place(refused, allow_resync_fallback=False)
    check_in_place(refused, allow_resync_fallback=True)
    assert "every update is a full resync (sync.allow_resync_fallback)" in capsys.readouterr().out
    check_in_place([MergeMode("in_place"), MergeMode("shadow")], allow_resync_fallback=False)
    assert "merge into the engines: in_place, shadow" in capsys.readouterr().out


def test_engine_weights_that_drift_from_the_master_are_resynced_the_same_step(tmp_path, quickstart_model, capsys):
    """No periodic resync by default: the drift check is the check. Engines whose weights differ from
    bf16(master) where the tail residual makes merges exact are resynced at once, and the run says so."""
    cfg = run_config(["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8"])
    with started(RunConfig.from_mapping(cfg), tmp_path, {}) as controller:
        state = controller.train.full_state()
        name = next(iter(controller.targets))
        state[f"{name}.weight"] = state[f"{name}.weight"] + 0.05  # an engine that missed an update, say
        controller.rollout.load_weights(ray.put(state), controller.policy_version, 0, 1)
        quiet = controller.weight_sync.sync(NoChange("nothing to send"), controller.policy_version, step=0)
        after = controller.weight_sync.drift(step=1)
    assert controller.config.sync.resync_every == 0
    assert quiet["sync/drift"] > 0.01 and quiet["sync/full_resync_bytes"] > 0
    assert after == 0.0
    assert "differ from bf16(master)" in capsys.readouterr().out


def test_a_full_resync_through_the_process_group_leaves_the_host_paths_bits(tmp_path, quickstart_model):
    """sync.resync_route=process_group: train rank 0 broadcasts each bucket to the engine in a gloo group of their
    own (the start-up resync too: the fp32 checkpoint is not bf16). After a step, a resync that way and one through
    the object store leave the same engine weights at every coordinate and sample the same tokens."""
    overrides = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    overrides += ["sync.resync_route=process_group", "sync.bucket_mb=0.05"]  # several buckets
    after = {}
    with started(RunConfig.from_mapping(run_config(overrides)), tmp_path, {}) as controller:
        sync = controller.weight_sync
        assert sync.transfer_generation == 1 and len(sync.buckets) > 2  # formed for the start-up resync
        first = controller.step(0)
        prompts = [p.token_ids for p in controller.sampler.next_batch(8)]
        for route in ("process_group", "object_store"):
            sync.route = route
            moved = sync.full_resync(controller.policy_version)
            weights = controller.rollout.weights_at(target_grid(controller))[0]
            tokens = [(c.token_ids, c.logprobs) for c in controller.rollout.generate(prompts, controller.sampling(), 3)]
            after[route] = (moved, weights, tokens, sync.drift(step=1))
        master = controller.train.full_state()
    assert first["sync/drift"] == 0.0 and first["sync/payload_bytes"] > 0
    by_group, by_store = after["process_group"], after["object_store"]
    assert by_group[0] == by_store[0] > 0  # the same bytes
    assert all(torch.equal(by_group[1][name], by_store[1][name]) for name in by_store[1])
    for name, values in by_group[1].items():
        assert torch.equal(values, split_master(master[f"{name}.weight"])[0].float().flatten()), name
    assert by_group[2] == by_store[2] and by_group[3] == by_store[3] == 0.0
