"""Host memory probes of the current process."""

from __future__ import annotations

import ctypes
import resource
import sys

import psutil


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Whole-process peak RSS from the kernel (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


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
