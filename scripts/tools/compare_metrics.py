"""Two runs' metrics.jsonl, compared in every value that does not measure time or memory.

    .venv/bin/python scripts/tools/compare_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl [--rtol 0]

Both files are read under today's metric names (`logra_rl.utils.metrics.RENAMED_METRICS`), so a run from
before a rename compares with one after it. Timing (`timing_s/`, `perf/`) and memory (`memory/`) values are
left out: they differ between two runs of the same job. Prints each difference (step, metric, both values) and
a one-line verdict; exits 1 when the runs differ (a metric only one run has counts as a difference).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from logra_rl.utils.metrics import current_names

UNCOMPARED = ("timing_s/", "perf/", "memory/")


def read(path: Path) -> dict[int, dict]:
    """Records by step (a resumed run's last record of a step wins), under today's names, compared keys only."""
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = current_names(json.loads(line))
            step = record.pop("step")
            records[step] = {k: v for k, v in record.items() if not k.startswith(UNCOMPARED)}
    return records


def differences(a: dict[int, dict], b: dict[int, dict], rtol: float) -> list[tuple[int, str, object, object]]:
    found = []
    for step in sorted(set(a) | set(b)):
        left, right = a.get(step, {}), b.get(step, {})
        for key in sorted(set(left) | set(right)):
            x, y = left.get(key, "absent"), right.get(key, "absent")
            same = x == y or (
                isinstance(x, int | float) and isinstance(y, int | float) and math.isclose(x, y, rel_tol=rtol)
            )
            if not same:
                found.append((step, key, x, y))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (0: bit-equal values)")
    args = parser.parse_args()
    a, b = read(args.a), read(args.b)
    found = differences(a, b, args.rtol)
    for step, key, x, y in found:
        print(f"step {step} {key}: {x} | {y}")
    compared = sum(len(record) for record in a.values())
    verdict = "equal" if not found else f"{len(found)} differences"
    print(f"{len(a)} / {len(b)} steps, {compared} values compared (timing and memory left out): {verdict}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
