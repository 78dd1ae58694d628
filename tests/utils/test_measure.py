"""The benchmarks' and the GPU check's measurements (logra_rl/utils/memory.py, timing.py): a peak since a reset
sees an allocation made after it, a command's process tree is sampled with each process's own peak, and `timed`
returns the call's result and its seconds."""

import math
import sys
import time
from pathlib import Path

import torch

from logra_rl.utils.memory import (
    RssSampler,
    cuda_peak_bytes,
    peak_rss_since_reset,
    reset_peak_rss,
    run_measured,
)
from logra_rl.utils.timing import timed

MIB = 2**20


def test_timed_returns_the_result_and_the_seconds():
    result, seconds = timed(lambda: time.sleep(0.05) or 7)
    assert result == 7 and 0.05 <= seconds < 1.0


def test_a_peak_since_a_reset_sees_a_later_allocation_and_the_sampler_its_samples():
    sampler = RssSampler(interval_s=0.001)
    sampler.start()
    while not sampler.samples:  # a level from before the allocation (the thread's first sample can come late)
        time.sleep(0.001)
    baseline = reset_peak_rss()
    block = torch.ones(256 * MIB // 4)  # 256 MiB, touched
    # The kernel may fold its per-CPU RSS counts in late (seen once in CI: no rise at the first read), so wait,
    # up to 2 s, until the sampler's own reading shows the block before reading the peak.
    deadline = time.monotonic() + 2.0
    while max(sampler.samples) - baseline < 240 * MIB and time.monotonic() < deadline:
        time.sleep(0.01)
    rise = peak_rss_since_reset() - baseline
    sampler.stop()
    del block
    seen = f"rise {rise / MIB:.0f} MiB, sampler {min(sampler.samples) / MIB:.0f}-{max(sampler.samples) / MIB:.0f} MiB"
    assert 240 * MIB <= rise <= 400 * MIB, seen
    assert max(sampler.samples) - min(sampler.samples) >= 240 * MIB, seen


def test_a_commands_process_tree_is_sampled_per_process(tmp_path):
    child = "import time; block = bytearray(300 * 2**20); time.sleep(0.6)"  # 300 MiB of private memory
    measured = run_measured([sys.executable, "-c", child], tmp_path / "child.log")
    label = Path(sys.executable).name  # a python command without a script
    peaks = measured.process_peaks(label)
    assert measured.wall_s >= 0.6 and len(peaks) == 1
    assert 0.29 <= peaks[0] <= 0.45, peaks  # GiB: the bytearray and the interpreter
    assert measured.peaks_by_label() == {label: peaks[0]}


def test_cuda_peak_is_nan_off_cuda():
    assert math.isnan(cuda_peak_bytes(torch.device("cpu")))
