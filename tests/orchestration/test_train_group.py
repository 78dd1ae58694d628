"""A train worker killed mid-run: the group is rebuilt from the last checkpoint and the steps after it replayed;
the run ends with the uninterrupted run's records, each step once."""

import os
import signal

from tests.runs import actor_processes, launch, records, run_to_the_end, short_job, stable, wait_for_records


def test_a_killed_train_worker_is_replaced_and_the_run_replayed_from_its_checkpoint(tmp_path, quickstart_model):
    common = short_job(quickstart_model, checkpoint_every=3)
    straight = run_to_the_end(common, tmp_path, "straight")

    run_dir = tmp_path / "outputs/quickstart/killed"
    process = launch([*common, "trainer.run_name=killed"], tmp_path)
    wait_for_records(process, run_dir, 5)  # past the step-3 checkpoint
    workers = actor_processes(process, "TrainWorker")
    assert len(workers) == 2
    os.kill(workers[1].pid, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "rebuilding the train group from" in stdout and "checkpoints/step_" in stdout

    killed = records(run_dir)
    assert [r["step"] for r in killed] == list(range(9))  # each step once: the replayed ones replaced
    assert killed[-2]["fault/train_restarts"] == 1
    assert [stable(r) for r in killed] == [stable(r) for r in straight]
