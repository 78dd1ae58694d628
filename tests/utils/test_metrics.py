import json

from logra_rl.utils.metrics import LoggerConfig, MetricsLogger, current_names


def test_jsonl_records_resume_truncation_and_offline_wandb(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig(wandb_mode="offline", progress=False), {"a": 1}, total_steps=4)
    for step in range(4):
        logger.log(step, {"reward/mean": step / 4, "train/kl_realized": float("nan")})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["reward/mean"] == 0.5 and records[2]["train/kl_realized"] is None  # NaN → null
    assert list((tmp_path / "wandb").glob("offline-run-*"))  # written offline, no login

    resumed = MetricsLogger(tmp_path, LoggerConfig(progress=False), {}, total_steps=4, start_step=2)
    resumed.log(2, {"reward/mean": 0.75})
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and records[2]["reward/mean"] == 0.75


def test_a_record_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward/mean": 0.1}\n{"step": 1, "reward/mean": 0.2}\n{"step": 2, "rew')
    resumed = MetricsLogger(tmp_path, LoggerConfig(progress=False), {}, total_steps=4, start_step=2)
    resumed.log(2, {"reward/mean": 0.3})
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def test_a_run_resumed_across_the_metric_renames_keeps_one_name_per_metric(tmp_path):
    """Records written before issue 27's renames are rewritten under today's names when the run resumes, so
    metrics.jsonl never holds `actor/loss` and `train/loss` for the same quantity."""
    path = tmp_path / "metrics.jsonl"
    old = {"step": 0, "actor/loss": 0.5, "rollout/logprob_diff_mean": 1e-3, "sync/weight_max_abs_diff": 0.0}
    path.write_text(json.dumps(old) + "\n" + json.dumps({"step": 1, "logra/kl_realized": 2e-4}) + "\n")
    resumed = MetricsLogger(tmp_path, LoggerConfig(progress=False), {}, total_steps=4, start_step=2)
    resumed.log(2, {"train/loss": 0.25})
    resumed.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"step": 0, "train/loss": 0.5, "train/mismatch": 1e-3, "sync/drift": 0.0}
    assert records[1] == {"step": 1, "train/kl_realized": 2e-4}
    assert records[2] == {"step": 2, "train/loss": 0.25}


def test_current_names_prefers_a_current_name_present_beside_an_old_one():
    assert current_names({"step": 3, "actor/kl_realized": 1.0, "train/kl_realized": 2.0}) == {
        "step": 3,
        "train/kl_realized": 2.0,
    }
