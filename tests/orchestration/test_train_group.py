"""A train worker killed or hung mid-run: the group is rebuilt from the last checkpoint and the steps after it
replayed; the run ends with the uninterrupted run's records, each step once."""

import os
import signal

import pytest

from tests.runs import actor_processes, launch, records, short_job, stable, wait_for_records


@pytest.mark.parametrize(
    ("fault", "overrides", "said"),
    [
        (signal.SIGKILL, [], "died: "),  # the process dies (the OOM killer, a crashed GPU)
        # the process stops answering: its peer waits in a collective until trainer.step_timeout_s
        (signal.SIGSTOP, ["trainer.step_timeout_s=20"], "did not answer within 20 s"),
    ],
    ids=["killed", "hung"],
)
def test_a_lost_train_worker_is_replaced_and_the_run_replayed_from_its_checkpoint(
    tmp_path, quickstart_model, uninterrupted, fault, overrides, said
):
    run_dir = tmp_path / "outputs/quickstart/faulty"
    args = [*short_job(quickstart_model, checkpoint_every=3), *overrides, "trainer.run_name=faulty"]
    process = launch(args, tmp_path)
    wait_for_records(process, run_dir, 5)  # past the step-3 checkpoint
    workers = actor_processes(process, "TrainWorker")
    assert len(workers) == 2
    os.kill(workers[1].pid, fault)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    [rebuild] = [line for line in stdout.splitlines() if "rebuilding the train group from" in line]
    assert said in rebuild and "checkpoints/step_" in rebuild, rebuild

    faulty = records(run_dir)
    assert [r["step"] for r in faulty] == list(range(9))  # each step once: the replayed ones replaced
    assert faulty[-2]["fault/train_restarts"] == 1
    assert [stable(r) for r in faulty] == [stable(r) for r in uninterrupted]
