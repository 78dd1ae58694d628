"""A rollout engine killed or hung mid-run is restarted in its bundle, resynced and asked again: the run ends
with the uninterrupted run's samples and rewards, and says it happened."""

import os
import signal

import pytest

from tests.runs import VOLATILE, actor_processes, launch, records, short_job, stable, wait_for_records


@pytest.mark.parametrize(
    ("fault", "overrides", "said"),
    [
        # as the kernel's OOM killer would; Ray reports ActorUnavailableError while it restarts the actor
        (signal.SIGKILL, [], "engine 0: Actor"),
        # the process stops answering: killed after rollout.call_timeout_s, then restarted like a dead one
        (signal.SIGSTOP, ["rollout.call_timeout_s=20"], "engine 0: no answer within rollout.call_timeout_s=20"),
    ],
    ids=["killed", "hung"],
)
def test_a_lost_engine_changes_no_sampled_token(tmp_path, quickstart_model, uninterrupted, fault, overrides, said):
    run_dir = tmp_path / "outputs/quickstart/faulty"
    args = [*short_job(quickstart_model, checkpoint_every=3), *overrides, "trainer.run_name=faulty"]
    process = launch(args, tmp_path)
    wait_for_records(process, run_dir, 2)
    [engine] = actor_processes(process, "HFEngine")
    os.kill(engine.pid, fault)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    [restart] = [line for line in stdout.splitlines() if "restarted in its bundle, resyncing and asking again" in line]
    assert said in restart, restart

    faulty = records(run_dir)
    assert [r["step"] for r in faulty] == list(range(9))
    assert faulty[-2]["fault/engine_restarts"] == 1 and uninterrupted[-2]["fault/engine_restarts"] == 0
    volatile = (*VOLATILE, "sync/")  # the restart's resync moved bytes the uninterrupted run did not
    assert [stable(r, volatile) for r in faulty] == [stable(r, volatile) for r in uninterrupted]
    assert all(r["sync/drift"] == 0.0 for r in faulty[:-1])  # the new engine holds bf16(master)


def test_past_max_restarts_a_lost_engine_stops_the_run_with_one_line(tmp_path, quickstart_model):
    args = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.total_steps=1000"]
    args += ["rollout.max_restarts=0", "trainer.run_name=fragile", "logger.progress=false", "logger.plot=false"]
    process = launch(args, tmp_path)
    wait_for_records(process, tmp_path / "outputs/quickstart/fragile", 1)
    [engine] = actor_processes(process, "HFEngine")
    os.kill(engine.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("logra-train: EngineFailure: rollout engine lost after 0 restarts (rollout.max_restarts=0)")
    assert "engine 0: ActorDiedError" in last
