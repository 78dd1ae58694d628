import json

from logra_rl.config import LoggerConfig
from logra_rl.utils.metrics import MetricsLogger


def test_jsonl_records_resume_truncation_and_offline_wandb(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig(wandb_mode="offline", progress=False), {"a": 1}, total_steps=4)
    for step in range(4):
        logger.log(step, {"reward/mean": step / 4, "actor/kl_realized": float("nan")})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["reward/mean"] == 0.5 and records[2]["actor/kl_realized"] is None  # NaN → null
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
