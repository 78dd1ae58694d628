"""Memory probes: this process's RSS and peak, a process's peak since a reset, CUDA's peak, and a command's
process tree sampled from outside while it runs (the benchmarks and the GPU check measure with these)."""

from __future__ import annotations

import ctypes
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

GIB = 2**30


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Whole-process peak RSS from the kernel (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def status_bytes(pid: int | str, key: str) -> int:
    """One memory line of /proc/PID/status (`VmHWM`, `RssAnon`, ...) in bytes; 0 when absent (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss(pid: int | None = None) -> int:
    """Restart a process's (default: this one's) peak-RSS count at its current RSS, which it returns, so that
    `peak_rss_since_reset` leaves out what came before (Linux: `echo 5 > /proc/PID/clear_refs`)."""
    Path(f"/proc/{pid or 'self'}/clear_refs").write_text("5")
    return psutil.Process(pid).memory_info().rss


def peak_rss_since_reset(pid: int | None = None) -> int:
    """A process's peak RSS (VmHWM) since `reset_peak_rss`, or since it started."""
    return status_bytes(pid or "self", "VmHWM")


def reset_cuda_peak(device: torch.device) -> None:
    """Start CUDA's peak count afresh (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device) -> float:
    """The CUDA allocator's peak since `reset_cuda_peak`; nan off CUDA (nothing to read)."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else float("nan")


class RssSampler(threading.Thread):
    """This process's RSS every few ms, until `stop`: a second view of the peak, and the mean over a stretch."""

    def __init__(self, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._done = threading.Event()

    def run(self) -> None:
        process = psutil.Process()
        while not self._done.is_set():
            self.samples.append(process.memory_info().rss)
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


# ---- a command's process tree, sampled from outside --------------------------------------------------------

TREE_INTERVAL_S = 0.05  # a phase's peak can last a fraction of a second


def used_bytes() -> int:
    """The machine's used memory (MemTotal − MemAvailable on Linux)."""
    memory = psutil.virtual_memory()
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
    """Run `command` to completion (SystemExit naming the log on failure), sampling every 50 ms the machine's
    used memory and each process's private memory (RssAnon: what it adds to the machine's used memory; shared
    library pages are left out) in the command's process tree. Ray retitles its actors `ray::Class.method`,
    which names them."""
    done = threading.Event()
    idle = []
    for _ in range(10):
        idle.append(used_bytes())
        done.wait(TREE_INTERVAL_S)
    idle_bytes = statistics.median(idle)
    peak = [idle_bytes]
    measured = Measured(0.0, 0.0)
    start = time.time()

    def sample(root: psutil.Process) -> None:
        while not done.wait(TREE_INTERVAL_S):
            peak[0] = max(peak[0], used_bytes())
            now = time.time() - start
            try:  # a process that exits while the tree is listed ends this sample, not the sampler
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in tree:
                try:
                    value = status_bytes(process.pid, "RssAnon")
                    label = process_label(process) or process.name()
                except (psutil.Error, OSError):
                    continue
                # Ray retitles a worker as it becomes an actor (setup_worker.py, ray::IDLE, ray::TrainWorker.setup)
                if label.startswith("ray::") or process.pid not in measured.labels:
                    measured.labels[process.pid] = label
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


def _malloc_trim() -> ctypes._CFuncPtr | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


MALLOC_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS. glibc keeps freed blocks under 32 MB for reuse (a step's
    activations, a loaded checkpoint's layers), so a process would hold its peak; in the synchronous loop the
    next phase runs in another process (train ranks, then engines), which needs those pages."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
