import errno
import subprocess
import sys

import pytest

from logra_rl.utils.run_dir import RunDirInUse, RunLock, no_space, remove_unused, staged_dir, write_atomic

HOLD_LOCK = """
import sys, time
from logra_rl.utils.run_dir import RunLock
lock = RunLock(sys.argv[1], ["logra-train", "trainer.run_name=first"]).acquire()
lock.announce()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_process_is_refused_while_the_first_lives_and_takes_the_lock_once_it_is_gone(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=rf"in use by another run \(pid {holder.pid} on .*trainer.run_name=first"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # as a crash or SIGKILL ends a run: no chance to clean up
        holder.wait()
    assert (tmp_path / ".lock").exists()  # the dead run's file is still there: stale, not held
    with RunLock(tmp_path, ["logra-train", "second"]), pytest.raises(RunDirInUse, match="logra-train second"):
        RunLock(tmp_path).acquire()  # also within one process (a sweep's next job)
    RunLock(tmp_path).acquire().release()


def test_write_atomic_keeps_the_old_content_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    write_atomic(path, "old: 1\n")

    def full_disk(self, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(type(path), "write_text", full_disk)
    with pytest.raises(OSError):
        write_atomic(path, "new: 2\n")
    monkeypatch.undo()
    assert path.read_text() == "old: 1\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_staged_directory_is_whole_or_absent(tmp_path):
    final = tmp_path / "base_model"
    with pytest.raises(RuntimeError), staged_dir(final) as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("the disk filled before the weights")
    assert list(tmp_path.iterdir()) == []  # neither a half model nor its staging directory
    with staged_dir(final) as staging:
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").write_text("w")
    with staged_dir(final) as staging:  # replacing a complete one
        (staging / "model.safetensors").write_text("w2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base_model"]
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]


def test_a_rejected_runs_directory_goes_with_its_empty_parents_but_never_a_recorded_one_or_the_cwd(
    tmp_path, monkeypatch
):
    outputs = tmp_path / "outputs"
    run_dir = outputs / "quickstart/run"

    def rejected_run() -> None:
        run_dir.mkdir(parents=True)
        for name in (".lock", "config.yaml", "logra-train.log"):
            (run_dir / name).write_text("" if name.endswith(".log") else "x")
        (run_dir / "base_model").mkdir()

    rejected_run()
    remove_unused(run_dir, keep=tmp_path)  # outputs/ was made for this run: it goes when left empty
    assert list(tmp_path.iterdir()) == []
    rejected_run()
    remove_unused(run_dir, keep=outputs)  # outputs/ was there before: it stays
    assert list(tmp_path.iterdir()) == [outputs] and list(outputs.iterdir()) == []

    rejected_run()
    (outputs / "quickstart/other").mkdir()
    remove_unused(run_dir, keep=outputs)
    assert [p.name for p in (outputs / "quickstart").iterdir()] == ["other"]  # a parent with another run stays

    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    remove_unused(run_dir, keep=outputs)
    assert (run_dir / "metrics.jsonl").exists()  # a run that recorded anything stays

    cwd = tmp_path / "here"
    cwd.mkdir()
    (cwd / "config.yaml").write_text("x")
    monkeypatch.chdir(cwd)
    remove_unused(cwd, keep=tmp_path)  # `hydra.run.dir=.`: never the working directory
    assert (cwd / "config.yaml").exists()


def test_no_space_is_found_however_a_library_wrapped_it():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints/step_2.tmp/model/__0_0.distcp")
        except OSError as error:
            raise RuntimeError("CheckpointException ranks:{0}") from error
    except RuntimeError as wrapped:
        assert no_space(wrapped).filename.endswith("__0_0.distcp")
    assert no_space(RuntimeError("RayTaskError: ... OSError: [Errno 28] No space left on device")) is not None
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None
