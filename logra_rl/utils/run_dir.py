"""A run directory's safety: one writer at a time, artefacts written whole or not at all, nothing left behind by a
run that never started.

The lock is an advisory `flock` on `<run>/.lock`, held for the run's life: the kernel drops it when the process
ends however it ends, so a lock file left by a killed run is never mistaken for a live one. It works wherever
`flock` does (local disks, NFSv4, Lustre mounted with `flock`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = ".lock"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """The run directory's lock: `acquire` it before writing anything there, keep it until the run ends."""

    def __init__(self, run_dir: Path, command: list[str] | None = None) -> None:
        self.path = Path(run_dir) / LOCK
        self.command = command if command is not None else sys.argv  # shown to a run refused by this one
        self._file = None

    def acquire(self) -> RunLock:
        """Take the lock or raise `RunDirInUse` naming the holder (pid, host, start, command). Nothing is written
        until `announce`: a run that stops before it (a refused resume) leaves the directory as it was."""
        while True:
            handle = open(self.path, "a+")  # noqa: SIM115 (held open for the run's life, closed by release)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip()
                handle.close()
                raise RunDirInUse(
                    f"{self.path.parent} is in use by another run ({describe_holder(holder)}); wait for it to end or "
                    "stop it, or start this one under another name with trainer.run_name=NAME"
                ) from None
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino:
                self._file = handle
                return self
            handle.close()  # the file was removed (a rejected run's directory) between open and flock: again

    def announce(self) -> None:
        """Write who holds the lock, for a run it refuses."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": self.command}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(holder))
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None

    def __enter__(self) -> RunLock:
        self.acquire().announce()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        command = " ".join(Path(holder["command"][0]).name.split() + holder["command"][1:])
        return f"pid {holder['pid']} on {holder['host']}, started {started}: {command}"
    except (ValueError, KeyError, TypeError, IndexError):
        return "a process that has not said who it is yet"


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole, or keeps what it held: written beside it, then renamed over it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A temporary sibling of `final` to write a directory artefact into; renamed to `final` when the block ends
    without an error (replacing what was there), removed when it raises: `final` is whole or absent."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        try:
            yield staging
        except Exception as error:
            full = full_disk_error(error, final)
            if full is None:
                raise
            raise full from error
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def no_space(error: BaseException) -> OSError | None:
    """The out-of-space OSError (ENOSPC, EDQUOT) in `error`'s chain of causes, however a library wrapped it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return error
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return OSError(errno.ENOSPC, str(error))
        error = error.__cause__ or error.__context__
    return None


# A write that failed with less than this free on its file system is taken for a full disk: not every writer says
# ENOSPC (torch.save's zip writer reports "unexpected pos"), and a failed write of a large file leaves ~0 free.
FULL_DISK_BYTES = 64 * 2**20


def full_disk_error(error: BaseException, path: Path) -> OSError | None:
    """`error` as the out-of-space error it is (ENOSPC, with `path`): found in its chain, or, whatever a writer
    raised, when the file system holding `path` has under FULL_DISK_BYTES free. None for any other failure."""
    found = no_space(error)
    if found is None:
        existing = Path(path).absolute()
        while not existing.exists():
            existing = existing.parent
        if shutil.disk_usage(existing).free >= FULL_DISK_BYTES:
            return None
    return OSError(errno.ENOSPC, "No space left on device", str(path))


# What a run directory holds before its run recorded anything: removed with it when the run is rejected.
DISPOSABLE = (LOCK, "config.yaml", "base_model")
TEMPORARY = (".tmp-", ".old-")  # staged artefacts (`staged_dir`, `write_atomic`)


def only_logs(run_dir: Path) -> bool:
    """Whether `run_dir` holds nothing but empty log files (Hydra opens its log before the config is read): a
    directory this run may take for its own, to remove if it is rejected."""
    return all(entry.suffix == ".log" and entry.is_file() and entry.stat().st_size == 0 for entry in run_dir.iterdir())


def may_remove(run_dir: Path) -> bool:
    """Whether a rejected run may remove `run_dir` at all: not the working directory, one above it, or a link."""
    path, cwd = Path(run_dir).absolute(), Path.cwd()
    return path.is_dir() and not path.is_symlink() and path != cwd and path not in cwd.parents


def remove_unused(run_dir: Path, keep: Path) -> None:
    """Remove the run directory of a run rejected before it recorded anything, with the parents it left empty
    below `keep`: a rejected run leaves nothing behind. Call it only for a directory the run found holding
    `only_logs`, holding its lock: it removes only DISPOSABLE entries, empty logs and temporary files, and leaves
    the directory when anything else is there or `may_remove` says no."""
    path = Path(run_dir).absolute()
    if not may_remove(path):
        return
    for entry in path.iterdir():
        empty_log = entry.suffix == ".log" and entry.is_file() and entry.stat().st_size == 0
        if not (entry.name in DISPOSABLE or empty_log or any(mark in entry.name for mark in TEMPORARY)):
            return
    shutil.rmtree(path, ignore_errors=True)
    keep = Path(keep).absolute()
    for parent in path.parents:
        if keep not in parent.parents or not may_remove(parent):
            return
        try:
            parent.rmdir()  # only when empty; another run may be starting there (ENOTEMPTY)
        except OSError:
            return
