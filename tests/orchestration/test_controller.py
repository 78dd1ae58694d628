"""The step loop end to end through Ray: 2 FSDP2 train workers + 1 HF rollout engine on CPU."""

import math

import torch
from hydra import compose, initialize_config_module

from logra_rl.config import RunConfig
from logra_rl.orchestration.controller import Controller

REQUIRED = [
    "reward/mean",
    "reward/baseline",
    "reward/grader_timeouts",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/loss",
    "actor/is_ratio_mean",
    "logra/alpha",
    "logra/kl_budget",
    "logra/kl_predicted",
    "logra/kl_realized",
    "logra/update_ratio",
    "sync/payload_bytes",
    "sync/weight_max_abs_diff",
    "rollout/logprob_diff_mean",
    "memory/train_avg_gib",
    "memory/train_peak_gib",
    "timing_s/rollout",
    "timing_s/reward",
    "timing_s/train",
    "timing_s/sync",
    "timing_s/step",
    "perf/updates_per_hour",
]


def run_config(overrides):
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return compose("config", overrides=overrides)


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
    controller = Controller(RunConfig.from_mapping(cfg), tmp_path, {})
    controller.setup()
    try:
        history = [controller.step(step) for step in range(3)]
        evaluation = controller.evaluate(3)
        # a duplicated payload is refused by the version gate; the controller resyncs and carries on
        prompts = controller.sampler.next_batch(16)
        completions = controller.generate(prompts, controller.sampling(), seed=5)
        rewards, _ = controller.grade(prompts, completions)
        _, payloads = controller.train_on(controller.pack(completions, controller.advantages(rewards, completions)), 3)
        duplicate = controller.sync(payloads + payloads, step=3)
        master = next(s for s in controller.train.call("full_state") if s is not None)
        grid = {
            name: torch.cartesian_prod(torch.arange(r), torch.arange(c)).T
            for name, (r, c) in controller.targets.items()
        }
        rollout = controller.rollout.call("weights_at", {name: (g[0], g[1]) for name, g in grid.items()})[0]
    finally:
        controller.teardown()

    for metrics in history:
        missing = [key for key in REQUIRED if key not in metrics]
        assert not missing, missing
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["sync/weight_max_abs_diff"] == 0.0
        assert metrics["sync/payload_bytes"] > 0 and metrics["sync/refused"] == 0
        assert metrics["timing_s/step"] < 30  # a hung grader costs at most its timeout
    assert sum(m["reward/grader_timeouts"] for m in history) > 0  # answer "3" hangs and was cut off
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0]
    assert set(evaluation) == {"eval/quickstart/pass@1", "eval/quickstart/pass@4"}
    assert duplicate["sync/refused"] == 1 and duplicate["sync/full_resync_bytes"] > 0
    assert duplicate["sync/weight_max_abs_diff"] == 0.0
    for name, (rows, cols) in ((n, (g[0], g[1])) for n, g in grid.items()):
        expected = master[f"{name}.weight"][rows, cols].to(torch.bfloat16).float()
        assert torch.equal(rollout[name], expected), name


def test_dense_and_ppo_epochs_sync_through_the_same_loop(tmp_path, quickstart_model):
    """optimizer=dense resyncs full weights every step; GRPO with 2 PPO epochs commits 2 LoGRA payloads a step."""
    common = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    grpo = ["algorithm=grpo", "rollout.n=4", "algorithm.epochs=2"]
    for overrides, per_step in ((["optimizer=dense", "optimizer.lr=1e-3"], 1), (grpo, 2)):
        controller = Controller(RunConfig.from_mapping(run_config(common + overrides)), tmp_path / str(per_step), {})
        controller.setup()
        try:
            history = [controller.step(step) for step in range(2)]
        finally:
            controller.teardown()
        assert [m["policy/version"] for m in history] == [per_step, 2 * per_step]
        for metrics in history:
            assert metrics["sync/weight_max_abs_diff"] == 0.0 and math.isfinite(metrics["actor/loss"])
            if per_step == 1:  # dense: no payload, a full resync of bf16(master) instead
                assert metrics["sync/payload_bytes"] == 0 and metrics["sync/full_resync_bytes"] > 0
                assert metrics["actor/lr"] > 0
            else:
                assert metrics["sync/payload_bytes"] > 0 and metrics["sync/full_resync_bytes"] == 0


def test_lora_baseline_trains_adapters_and_syncs_merged_weights(tmp_path, quickstart_model):
    """optimizer=lora: peft adapters under FSDP2; the engines get W + s·B·A, equal to the trainer's merged view."""
    overrides = ["model=hf", f"model.path={quickstart_model}", "trainer.prompts_per_step=8", "logger.progress=false"]
    overrides += ["optimizer=lora", "optimizer.lr=1e-2", "optimizer.lora_rank=4"]
    overrides += ["rollout.resync_bucket_mb=0.05"]  # ~50 kB: the merged weights stream in several buckets
    controller = Controller(RunConfig.from_mapping(run_config(overrides)), tmp_path, {})
    controller.setup()
    try:
        assert len(controller.resync_buckets) > 2
        history = [controller.step(step) for step in range(2)]
        master = next(s for s in controller.train.call("full_state") if s is not None)
    finally:
        controller.teardown()
    assert "model.layers.0.self_attn.q_proj.weight" in master and not any("lora" in k for k in master)
    for metrics in history:
        assert metrics["sync/full_resync_bytes"] > 0 and metrics["sync/payload_bytes"] == 0
        assert metrics["sync/weight_max_abs_diff"] == 0.0  # engines hold bf16 of the merged weights
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped"] == 0
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(quickstart_model).state_dict()
    moved = (
        master["model.layers.0.self_attn.q_proj.weight"] - original["model.layers.0.self_attn.q_proj.weight"]
    ).abs()
    assert float(moved.max()) > 0  # the adapters moved the merged weight ...
    assert torch.equal(master["model.embed_tokens.weight"], original["model.embed_tokens.weight"])  # ... only there
