from logra_rl.utils.checkpoint import Checkpoints, read_controller_state, resume_conflicts


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
    # a setting the saved run predates (a later version's key) takes its current value; one it had must stay
    newer = {**saved, "logra": {"rank": 256, "kl": {"budget": 2e-4, "max_overshoot": 1.5}}}
    assert resume_conflicts(saved, newer) == []
    assert resume_conflicts(newer, saved) == ["logra.kl.max_overshoot: 1.5 → None"]


def write_checkpoint(checkpoints: Checkpoints, step: int) -> None:
    """A checkpoint as the trainer writes one: DCP shards of a model, the update state, the controller state."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from logra_rl.utils.checkpoint import UPDATE_STATE

    path = checkpoints.begin(step)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.full((256, 64), float(step))}}, checkpoint_id=path / "model")
    torch.save({"policy_version": step}, path / UPDATE_STATE)
    checkpoints.commit(step, {"step": step, "sampler": {}, "baseline": {}})


def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumed(tmp_path):
    from logra_rl.utils.checkpoint import verify

    checkpoints = Checkpoints(tmp_path, keep=3)
    for step in (3, 6, 9):
        write_checkpoint(checkpoints, step)
    root = tmp_path / "checkpoints"
    assert all(verify(root / f"step_{step}") is None for step in (3, 6, 9))
    assert checkpoints.resumable() == (root / "step_9", [])

    shard = next((root / "step_9/model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short, as by a full disk or an interrupted copy
    (root / "step_6" / "update_state.pt").unlink()
    path, skipped = checkpoints.resumable()
    assert path == root / "step_3"
    assert len(skipped) == 2 and str(root / "step_9") in skipped[0] and f"{shard.name} is 100 of" in skipped[0]
    assert "update_state.pt" in skipped[1]
    (root / "step_3" / "controller.json").write_text('{"step": 3')  # a torn controller state
    assert checkpoints.resumable()[0] is None


def test_a_baseline_resumes_after_its_preset_retunes_logra_step_control():
    """Dense and LoRA never read LoGRA's step controller: a shared preset may retune its budget under a baseline's
    run; the KL rows every rule measures on, and the rule itself, may not change."""

    def run(rule: str, budget: float, guard_responses: int = 16) -> dict:
        kl = {"budget": budget, "final_budget": budget / 4, "guard_responses": guard_responses}
        return {"optimizer": {"name": rule, "lr": 4e-5}, "logra": {"rank": 64, "kl": kl}}

    assert resume_conflicts(run("dense", 4e-2), run("dense", 1e-2)) == []
    assert resume_conflicts(run("lora", 4e-2), run("lora", 1e-2)) == []
    assert resume_conflicts(run("logra", 4e-2), run("logra", 1e-2)) == [
        "logra.kl.budget: 0.04 → 0.01",
        "logra.kl.final_budget: 0.01 → 0.0025",
    ]
    assert resume_conflicts(run("dense", 4e-2), run("dense", 4e-2, guard_responses=8)) == [
        "logra.kl.guard_responses: 16 → 8"
    ]
    assert resume_conflicts(run("dense", 4e-2), run("logra", 1e-2))[-1] == "optimizer.name: 'dense' → 'logra'"
