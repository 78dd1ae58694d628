"""Config keys that moved, and a saved run's config read under today's names.

`logra-train` rewrites an old key on its command line (with a note); a saved run's config.yaml in the old names
reads through `migrate_keys` (the config's `RunConfig.from_mapping`, resume, logra-eval's export, the plots). Plain
mappings only, no dataclass: the run's plot reads a config.yaml through it without importing the config (torch)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# Keys that moved: old name → new name.
RENAMED_KEYS = {
    "trainer.eval_every": "eval.every",
    "rollout.eval_temperature": "eval.temperature",
    "rollout.eval_top_p": "eval.top_p",
    "rollout.eval_samples": "eval.samples",
    "rollout.residual": "sync.residual",
    "rollout.resync_every": "sync.resync_every",
    "rollout.allow_resync_fallback": "sync.allow_resync_fallback",
    "rollout.resync_bucket_mb": "sync.bucket_mb",
    "rollout.probe_coordinates": "sync.drift_check_coordinates",
    "logra.merge_chunk_rows": "sync.merge_chunk_rows",
    "logra.target_modules": "model.target_modules",
    "optimizer.lora_targets": "model.target_modules",
}


def migrate_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of the nested mapping `values` (a run's saved config) with each old key of RENAMED_KEYS moved to its
    new name, and a note per key moved. The old key's value wins over the new key's (a composed config holds the
    new key's default). Every saved run held both old target lists; where they differ, the one its update rule
    read wins (`optimizer.lora_targets` for LoRA, `logra.target_modules` otherwise)."""
    values = copy.deepcopy(dict(values))
    if "experiment" in values and "experiment_name" not in values:  # its name before the `experiment` group
        values["experiment_name"] = values.pop("experiment")
    lora = (values.get("optimizer") or {}).get("name") == "lora"
    notes, moved = [], {}
    for old, new in RENAMED_KEYS.items():
        group, leaf = old.split(".")
        node = values.get(group)
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        if new in moved and moved[new][1] != value:
            read = old if lora == (old == "optimizer.lora_targets") else moved[new][0]
            notes.append(f"{moved[new][0]} and {old} differ: the run's update rule read {read}")
            if read != old:
                continue
        moved[new] = (old, value)
        new_group, new_leaf = new.split(".")
        values.setdefault(new_group, {})[new_leaf] = value
        notes.append(f"{old} is now {new}")
    return values, notes
