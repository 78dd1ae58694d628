from logra_rl.utils.checkpoint import Checkpoints, read_controller_state


def test_atomic_commit_latest_pointer_and_pruning(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    assert checkpoints.latest() is None
    for step in (10, 20, 30):
        path = checkpoints.begin(step)
        (path / "weights").write_text(str(step))
        checkpoints.commit(step, {"step": step})
    assert checkpoints.latest() == tmp_path / "checkpoints/step_30"
    assert read_controller_state(checkpoints.latest()) == {"step": 30}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_20", "step_30"]

    partial = checkpoints.begin(40)  # killed before commit: never visible as latest
    (partial / "weights").write_text("half")
    assert checkpoints.latest() == tmp_path / "checkpoints/step_30"
    checkpoints.begin(40)  # the next save clears the partial one
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.tmp")] == ["step_40.tmp"]
    assert not (partial / "weights").exists()


def test_resume_conflicts_name_the_settings_a_resume_may_not_change():
    from logra_rl.utils.checkpoint import resume_conflicts

    saved = {"logra": {"rank": 256, "kl": {"budget": 2e-4}}, "trainer": {"total_steps": 200, "seed": 1}}
    longer = {"logra": {"rank": 256, "kl": {"budget": 2e-4}}, "trainer": {"total_steps": 400, "seed": 1}}
    other = {"logra": {"rank": 64, "kl": {"budget": 2e-4}}, "trainer": {"total_steps": 200, "seed": 2}}
    assert resume_conflicts(saved, longer) == []
    assert resume_conflicts(saved, other) == ["logra.rank: 256 → 64", "trainer.seed: 1 → 2"]
    assert resume_conflicts(saved, {**saved, "eval": {"checkpoint": "x"}}) == []
    assert resume_conflicts(saved, {**saved, "data": {"name": "math"}}) == ["data.name: None → 'math'"]
