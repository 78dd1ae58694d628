"""Memory of a command's processes, measured from outside while it runs (for the benchmark scripts).

`run_measured(command, log)` runs the command to completion and samples, every 50 ms, the machine's used
memory (MemTotal − MemAvailable) and each process's private memory (RssAnon: what it adds to the machine's
used memory; shared library pages are left out) in the command's process tree. Ray retitles its actors
`ray::Class.method`, which names them.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

GIB = 2**30
INTERVAL_S = 0.05  # a phase's peak can last a fraction of a second


def used_bytes() -> int:
    memory = psutil.virtual_memory()  # MemTotal - MemAvailable on Linux
    return memory.total - memory.available


def process_label(process: psutil.Process) -> str | None:
    """A name for one process of the run: Ray titles its actors `ray::Class.method` (None while it has no
    command line, as when it starts or exits: its 15-character process name would cut the title)."""
    command = " ".join(process.cmdline())
    if not command:
        return None
    if command.startswith("ray::"):
        return command.split()[0].split(".")[0]
    words = command.split()
    if "multiprocessing" in command:
        return "python (grading process)"
    script = next((Path(w).name for w in words[1:] if w.endswith(".py") or w.startswith("logra_rl")), "")
    return f"{Path(words[0]).name} {script}".strip()


def anonymous_bytes(pid: int) -> int:
    """Private memory of a process (RssAnon): what it adds to the machine's used memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Measured:
    """A finished command: wall seconds, the machine's peak used memory above its idle level, and per
    process its label, peak private memory and (seconds since start, bytes) samples."""

    wall_s: float
    above_idle_gib: float
    labels: dict[int, str] = field(default_factory=dict)
    peaks: dict[int, int] = field(default_factory=dict)
    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def peaks_by_label(self) -> dict[str, float]:
        """Each label's processes' peaks summed, in GiB, largest first."""
        totals: dict[str, float] = {}
        for pid, peak in self.peaks.items():
            totals[self.labels[pid]] = totals.get(self.labels[pid], 0.0) + peak / GIB
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def process_peaks(self, label: str) -> list[float]:
        """The peaks (GiB) of the processes labelled `label`, largest first."""
        return sorted((self.peaks[pid] / GIB for pid in self.peaks if self.labels[pid] == label), reverse=True)


def run_measured(command: list[str], log: Path) -> Measured:
    """Run `command` to completion (SystemExit naming the log on failure) and measure its memory."""
    done = threading.Event()
    idle = []
    for _ in range(10):
        idle.append(used_bytes())
        done.wait(INTERVAL_S)
    idle_bytes = statistics.median(idle)
    peak = [idle_bytes]
    measured = Measured(0.0, 0.0)
    start = time.time()

    def sample(root: psutil.Process) -> None:
        while not done.wait(INTERVAL_S):
            peak[0] = max(peak[0], used_bytes())
            now = time.time() - start
            for process in [root, *root.children(recursive=True)]:
                try:
                    value = anonymous_bytes(process.pid)
                    label = process_label(process)
                except (psutil.Error, OSError):
                    continue
                # Ray retitles a worker as it becomes an actor (setup_worker.py, ray::IDLE, ray::TrainWorker.setup)
                if label and (label.startswith("ray::") or process.pid not in measured.labels):
                    measured.labels[process.pid] = label
                measured.labels.setdefault(process.pid, process.name())
                measured.peaks[process.pid] = max(measured.peaks.get(process.pid, 0), value)
                measured.samples.setdefault(process.pid, []).append((round(now, 1), value))

    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=sample, args=(psutil.Process(child.pid),), daemon=True)
        sampler.start()
        code = child.wait()
    done.set()
    sampler.join()
    if code != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed ({code}); its output: {log}")
    measured.wall_s = time.time() - start
    measured.above_idle_gib = (peak[0] - idle_bytes) / GIB
    return measured
