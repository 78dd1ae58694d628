"""Checkpoint directories: written under a temporary name, renamed when complete, `latest` updated atomically.

A run killed mid-save leaves only a `step_N.tmp` directory, which is ignored and removed on the next save,
so `latest` always names a complete checkpoint. A complete one can still be damaged afterwards (a file lost
or cut short by a disk or a copy): `verify` reads every file's size against what the checkpoint records, and
a resume takes the newest checkpoint that verifies, naming the ones it skips.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from logra_rl.utils.run_dir import write_atomic
from logra_rl.utils.structs import flatten

UPDATE_STATE = "update_state.pt"  # the update rule's own state (and the policy version) inside a checkpoint
SHARDED = ("model", "optimizer")  # torch.distributed.checkpoint directories (the optimizer's: dense and LoRA)
ROLLOUTS = "rollouts.pt"  # the batches in flight (algorithm.max_staleness), beside controller.json

# What a resumed run may change: its length, logging, cluster shape, eval and sync cadence, grading
# resources. Everything else (model, data, algorithm, optimizer, LoGRA, sampling, seed, batch) must match.
RESUME_MAY_CHANGE = (
    "logger.",
    "ray.",
    "cluster.",
    "eval.",
    "trainer.total_steps",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.micro_batch_tokens",
    "trainer.grader_workers",
    "trainer.grader_timeout_s",
    "trainer.max_restarts",
    "trainer.preempted_exit_code",
    "trainer.step_timeout_s",
    "rollout.max_restarts",
    "rollout.call_timeout_s",
    "trainer.output_dir",
    "rollout.num_engines",
    "rollout.gpus_per_engine",
    "rollout.gpu_memory_utilization",
    "sync.resync_every",
    "sync.bucket_mb",
    "sync.drift_check_coordinates",
)


# The LoGRA step controller's settings: only `optimizer=logra` reads them (dense and LoRA measure their KL on the
# guard's rows, `logra.kl.guard_responses` / `probe_max_tokens` / `forward_tokens`, which stay fixed), so a
# baseline resumes after a shared preset retunes LoGRA's budget.
LOGRA_STEP_CONTROL = tuple(
    f"logra.kl.{name}"
    for name in (
        "budget",
        "final_budget",
        "schedule",
        "schedule_steps",
        "alpha_max",
        "max_overshoot",
        "max_tries",
        "estimator",
        "fd_step",
        "probe_responses",
        "guard_confidence",
        "mismatch_subtraction",
        "mismatch_ema_weight",
        "mismatch_budget_floor",
    )
)


def resume_conflicts(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: saved → current` for each setting a resume may not change (see RESUME_MAY_CHANGE; for a run whose
    update rule is not LoGRA, LOGRA_STEP_CONTROL too). A setting the saved run predates (absent from its config,
    added by a later version) takes its current value."""
    old, new = flatten(saved), flatten(current)
    may_change = RESUME_MAY_CHANGE
    if old.get("optimizer.name", "logra") == new.get("optimizer.name", "logra") != "logra":
        may_change += LOGRA_STEP_CONTROL
    return [
        f"{key}: {old.get(key)!r} → {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if key in old and old.get(key) != new.get(key) and not key.startswith(may_change)
    ]


class Checkpoints:
    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `step` (stale partial saves are removed)."""
        for partial in self.root.glob("*.tmp"):
            shutil.rmtree(partial)
        path = self.root / f"step_{step}.tmp"
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, controller_state: dict[str, Any]) -> Path:
        """Write the controller state, rename the checkpoint into place, point `latest` at it, prune old ones."""
        temporary = self.root / f"step_{step}.tmp"
        (temporary / "controller.json").write_text(json.dumps(controller_state))
        final = self.root / f"step_{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        write_atomic(self.root / "latest", final.name)
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old)
        return final

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if path.is_dir() else None

    def resumable(self) -> tuple[Path | None, list[str]]:
        """The checkpoint `latest` names if it verifies, else the newest earlier one that does (in commit
        order: a directory reused with `trainer.resume=never` may hold an older run's higher steps); and a
        line for each one skipped as damaged."""
        latest = self.latest()
        if latest is None:
            return None, []
        complete = self.committed()
        line = complete[: complete.index(latest) + 1] if latest in complete else [latest]
        return first_verified(reversed(line))

    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest commit first (the controller state is written last)."""
        steps = [p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
        return sorted(steps, key=lambda p: (_committed_at(p), p.name))


def _committed_at(path: Path) -> int:
    """When the checkpoint at `path` was committed (its controller state written last), 0 if it never was."""
    state = path / "controller.json"
    return state.stat().st_mtime_ns if state.exists() else 0


def read_controller_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "controller.json").read_text())


def first_verified(paths: Iterable[Path]) -> tuple[Path | None, list[str]]:
    """The first of `paths` that verifies, and a line for each one before it that does not."""
    skipped = []
    for path in paths:
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {path} is damaged ({problem}); skipped")
    return None, skipped


def verify(path: Path) -> str | None:
    """What makes the checkpoint at `path` unusable, or None: a missing or unreadable controller state or update
    state, a sharded directory without its metadata, or a shard file missing or shorter than the metadata says.
    Reads sizes and the small files, not the shards."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        state = read_controller_state(path)
        missing = {"step", "sampler", "baseline"} - state.keys()
        if missing:
            return f"controller.json lacks {sorted(missing)}"
        torch.load(path / UPDATE_STATE, weights_only=True)
        if state.get("rollouts"):  # the batches in flight (algorithm.max_staleness): mapped, not read
            torch.load(path / ROLLOUTS, weights_only=True, mmap=True)
    except Exception as error:  # whatever a torn or foreign file raises (unpickling, JSON, types)
        return f"{type(error).__name__}: {str(error)[:200]}"
    if not (path / "model").is_dir():
        return "no model directory"
    for name in SHARDED:
        directory = path / name
        if not directory.is_dir():
            continue
        try:
            storage = FileSystemReader(directory).read_metadata().storage_data
        except Exception as error:
            return f"{name}/.metadata unreadable ({type(error).__name__})"
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for relative, size in sorted(needed.items()):
            file = directory / relative
            have = file.stat().st_size if file.exists() else -1
            if have < size:
                return f"{name}/{relative} is {'missing' if have < 0 else f'{have} of {size} bytes'}"
    return None
