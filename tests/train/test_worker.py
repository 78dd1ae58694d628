"""TrainWorker set-up through Ray: only rank 0 reads the checkpoint, the other ranks build on the meta
device and receive their shards, and the sharded model is exactly the model on disk."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from logra_rl.config import RunConfig
from logra_rl.logra import merge_adapters
from logra_rl.models.footprint import model_footprint
from logra_rl.orchestration.cluster import start_ray, stop_ray
from logra_rl.orchestration.train_group import TrainGroup
from logra_rl.rl import token_logprobs
from logra_rl.rollout.resync import bucket_tensors
from logra_rl.train.api import NoChange, StaleBatch
from logra_rl.train.batch import TrainBatch
from logra_rl.train.weight_export import largest_resync_bucket
from logra_rl.train.worker import aggregate_epochs
from tests.orchestration.test_controller import run_config
from tests.tiny_models import random_batch, tiny_qwen3


@pytest.mark.parametrize("optimizer", ["logra", "lora"])
def test_rank0_load_gives_every_rank_the_model_on_disk(tmp_path, optimizer):
    path = tmp_path / "model"
    tied = optimizer == "logra"  # tied: one parameter, two names (LoRA refuses adapters on a tied head)
    tiny_qwen3(seed=4, tie_word_embeddings=tied).save_pretrained(path)
    overrides = ["model=hf", f"model.path={path}", f"optimizer={optimizer}", "optimizer.lora_rank=4"]
    if optimizer == "lora":  # one adapted module outside the layers
        overrides += ["model.target_modules=[q_proj,v_proj,lm_head]"]
    config = RunConfig.from_mapping(run_config(overrides))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = random_batch(3, 12, seed=1)
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        loss_mask=torch.ones(input_ids.shape),
        rollout_logprobs=torch.zeros(input_ids.shape),
        advantages=torch.zeros(3),
        finished=torch.ones(3, dtype=torch.bool),
    )

    owns_ray = start_ray(config)
    group = TrainGroup(config, str(path))
    try:
        assert group.setup() == 0  # policy version
        state = group.full_state()
        logprobs = group.workers.gather([a.logprobs.remote(batch) for a in group.actors])
        buckets = group.resync_buckets(20_000)  # smaller than a layer (~200 kB) or lm_head (26 kB)
        parts = [ray.get(group.resync_bucket(bucket)) for bucket in buckets]
    finally:
        group.shutdown()
        if owns_ray:
            stop_ray()

    expected = reference.state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name  # LoRA: merged W + s·B·A with B = 0 is W exactly
    with torch.no_grad():
        want = token_logprobs(reference(input_ids=input_ids).logits, input_ids, config.rollout.temperature)
    # a full resync's buckets: every weight once, a layer (a LoRA module with its adapters) never split
    assert len(buckets) >= 4
    layers = [{k.split(".layers.")[1].split(".")[0] for k in b.keys if ".layers." in k} for b in buckets]
    assert all(len(numbers) <= 1 for numbers in layers) and len(set().union(*layers)) == 2
    # the memory plan's figure for the largest bucket (a layer here) bounds it, by at most the spread of
    # lm_head's adapters over the layers
    footprint = model_footprint(str(path), config.model.target_modules, "float32")
    largest = max(bucket.nbytes for bucket in buckets)
    lora_rank = config.optimizer.lora_rank if optimizer == "lora" else 0
    assert largest <= largest_resync_bucket(footprint, 20_000, lora_rank) <= 1.05 * largest
    joined = bucket_tensors({k: v for part in parts for k, v in part.items()})  # numpy arrays, zero-copy in Ray
    sent = sum(len(part) for part in parts)
    if tied:
        assert sent == len(joined) == len(state) - 1 and "lm_head.weight" not in joined  # it goes once, as embed
    else:  # LoRA: each adapted module's base weight with its adapters, merged here as the engines merge them
        joined, bases = merge_adapters(joined, config.optimizer.lora_scaling)
        assert sorted(bases) == [
            "lm_head",
            *(f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")),
        ]
        assert sent == len(state) + 2 * len(bases) and sorted(joined) == sorted(state)
    assert all(torch.equal(joined[name], value) for name, value in state.items() if name in joined)
    assert [b.nbytes for b in buckets] == [sum(v.nbytes for v in part.values()) for part in parts]  # adapters too
    for got in logprobs:  # rotary frequencies (buffers, not in the state dict) reached rank 1 too
        torch.testing.assert_close(got[:, 1:], want, rtol=1e-5, atol=1e-5)


def response_batch(rows: int = 4, **fields) -> TrainBatch:
    """Rows of 12 tokens, the last 6 a response sampled with log-prob −4 each, advantages of both signs."""
    input_ids = random_batch(rows, 12, seed=2)
    loss_mask = torch.zeros(input_ids.shape)
    loss_mask[:, 6:] = 1
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        loss_mask=loss_mask,
        rollout_logprobs=torch.full(input_ids.shape, -4.0) * loss_mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat(rows // 4),
        finished=torch.ones(rows, dtype=torch.bool),
        **fields,
    )


@contextlib.contextmanager
def set_up_group(config: RunConfig, path: Path) -> Iterator[TrainGroup]:
    """A TrainGroup set up on the model at `path`, on a Ray that is stopped after unless one already ran."""
    owns_ray = start_ray(config)
    group = TrainGroup(config, str(path))
    try:
        group.setup()
        yield group
    finally:
        group.shutdown()
        if owns_ray:
            stop_ray()


def test_a_dense_step_under_fsdp2_reports_the_kl_between_the_models_before_and_after(tmp_path):
    """Two FSDP2 ranks, tied embeddings (a parameter of the root, which a forward-only pass leaves gathered):
    `train/kl_realized` is the exact KL per generated token between the model before the step and the model
    the step left (both read back from the ranks), over the guard's rows of both shards, not a stale forward."""
    from logra_rl.logra import exact_kl

    path = tmp_path / "model"
    tiny_qwen3(seed=4, tie_word_embeddings=True).save_pretrained(path)
    overrides = ["model=hf", f"model.path={path}", "optimizer=dense", "optimizer.lr=1e-3", "trainer.heldout_every=0"]
    config = RunConfig.from_mapping(run_config(overrides))
    batch = response_batch()
    input_ids, loss_mask = batch.input_ids, batch.loss_mask
    with set_up_group(config, path) as group:
        result = group.train_step(batch, step=0)
        after = group.full_state()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    where = loss_mask[:, 1:].bool()  # 2 rows per shard, both measured
    with torch.no_grad():
        logits_before = model(input_ids=input_ids).logits[:, :-1][where]
        model.load_state_dict(after)
        logits_after = model(input_ids=input_ids).logits[:, :-1][where]
    want = exact_kl(logits_before, logits_after, config.rollout.temperature).mean()
    assert want > 1e-6
    assert result.metrics["train/kl_realized"] == pytest.approx(float(want), rel=1e-3)


def test_the_held_out_rows_train_nothing_and_measure_the_step_where_nothing_was_tuned(tmp_path):
    """Every `trainer.heldout_every` steps each rank withholds `trainer.heldout_responses` rows (drawn at random by
    the run's seed, the step and the rank) from the gradient and the guard: `train/tokens` counts the other rows
    only, and `heldout/kl` is the exact KL per generated token between the models before and after the step on
    the withheld rows, with the step's budget beside it."""
    from logra_rl.logra import exact_kl

    path = tmp_path / "model"
    tiny_qwen3(seed=4).save_pretrained(path)
    overrides = ["model=hf", f"model.path={path}", "trainer.heldout_every=1", "trainer.heldout_responses=1"]
    overrides.append("logra.update_ratio=1e-2")
    config = RunConfig.from_mapping(run_config(overrides))
    batch = response_batch(rows=8)
    with set_up_group(config, path) as group:
        before = group.full_state()
        result = group.train_step(batch, step=0)
        after = group.full_state()

    assert result.metrics["train/tokens"] == 6 * 6  # 3 rows of each rank's 4 trained, 6 response tokens each
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kl_per_row = []
    for state in (before, after):
        model.load_state_dict(state)
        with torch.no_grad():
            kl_per_row.append(model(input_ids=batch.input_ids).logits[:, 5:-1])  # the predictions of the response
    per_row = exact_kl(*kl_per_row, config.rollout.temperature).mean(dim=1)  # rows of equal length
    candidates = [float((per_row[a] + per_row[b]) / 2) for a in range(4) for b in range(4, 8)]  # one of each shard
    assert min(candidates) > 0
    assert any(result.metrics["heldout/kl"] == pytest.approx(c, rel=1e-4) for c in candidates), candidates
    assert result.metrics["heldout/kl_budget"] == result.metrics["logra/kl_budget"]


def test_a_batch_staler_than_its_kl_bound_changes_no_weight_and_reports_its_behaviour_kl(tmp_path):
    """A batch sampled one update ago (algorithm.max_staleness) whose behaviour KL is past algorithm.staleness_kl:
    the step is refused (the controller samples it again), nothing moves, and the behaviour KL it reports is
    KL(π_behaviour ‖ π_train) per token, r − 1 − log r over the sampled tokens, from the trainer's log-probs."""
    path = tmp_path / "model"
    tiny_qwen3(seed=4).save_pretrained(path)
    overrides = ["model=hf", f"model.path={path}", "logra.kl.probe_responses=2", "algorithm.staleness_kl=1e-3"]
    config = RunConfig.from_mapping(run_config(overrides))
    batch = response_batch(policy_version=torch.zeros(4, dtype=torch.long))  # sampled by the start's weights
    input_ids, loss_mask = batch.input_ids, batch.loss_mask
    with set_up_group(config, path) as group:
        fresh = group.train_step(batch, step=0)  # on-policy: trained, whatever its behaviour KL
        before = group.full_state()
        stale = group.train_step(batch, step=1)  # the trainer is at version 1 now
        after = group.full_state()

    assert fresh.policy_version == 1 and fresh.metrics["async/staleness"] == 0
    assert not isinstance(fresh.update, NoChange)
    assert isinstance(stale.update, StaleBatch) and "> the staleness bound 0.001" in stale.update.reason
    assert stale.metrics["async/staleness_bound"] == 1e-3
    assert stale.policy_version == 1 and stale.metrics["train/skipped"] == 1 and stale.metrics["async/staleness"] == 1
    assert all(torch.equal(before[name], after[name]) for name in before)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(before)
    with torch.no_grad():
        trained = token_logprobs(model(input_ids=input_ids).logits, input_ids, config.rollout.temperature)
    where = loss_mask[:, 1:].bool()
    log_ratio = trained[where] - batch.rollout_logprobs[:, 1:][where]
    want = float((log_ratio.exp() - 1 - log_ratio).mean())
    assert want > 1e-3
    assert stale.metrics["async/behaviour_kl"] == pytest.approx(want, rel=1e-4)


def test_ppo_epochs_metrics_are_aggregated_over_every_epoch():
    """Counts and times add up over the epochs; every other metric is the mean over the epochs reporting it."""
    epochs = [
        {"train/loss": 0.5, "train/clip_frac": 0.0, "train/skipped": 0.0, "timing_s/probe": 1.0, "logra/alpha": 2.0},
        {"train/loss": 0.25, "train/clip_frac": 0.5, "train/skipped": 1.0},  # a skipped LoGRA update
        {"train/loss": 0.0, "train/clip_frac": 0.25, "train/skipped": 0.0, "timing_s/probe": 0.5, "logra/alpha": 1.0},
    ]
    assert aggregate_epochs(epochs) == {
        "train/loss": 0.25,
        "train/clip_frac": 0.25,
        "train/skipped": 1.0,
        "timing_s/probe": 1.5,
        "logra/alpha": 1.5,
    }
