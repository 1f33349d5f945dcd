"""Store locks, after restic's: writers share the store; gc and prune hold it alone.

`locks/store.lock` is flock'ed shared or exclusive. Every holder also leaves a note,
`locks/<pid>-<random>.json` (what, by whom, since when), which it keeps flock'ed while it
holds the lock: a waiter that gives up can say who is in the way, and a note whose holder
died (the kernel dropped its flock) is known to be stale and removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rewind.store.errors import StoreBusy


@contextmanager
def store_lock(locks: Path, *, exclusive: bool, operation: str, timeout: float) -> Iterator[None]:
    """Hold the store lock for `operation`; raise StoreBusy naming the holders after `timeout` s."""
    fd = acquire(locks / "store.lock", exclusive=exclusive, timeout=timeout)
    if fd is None:
        holders = ", ".join(live_holders(locks)) or "another process"
        raise StoreBusy(f"the store at {locks.parent} is busy: {holders} holds it "
                        f"(waited {timeout:g} s for {operation})")
    try:
        with _note(locks, exclusive, operation):
            yield
    finally:
        os.close(fd)


@contextmanager
def names_lock(locks: Path, timeout: float) -> Iterator[None]:
    """Held around 'is this name free? then take it', so two commits cannot take one name."""
    fd = acquire(locks / "names.lock", exclusive=True, timeout=timeout)
    if fd is None:
        raise StoreBusy(f"the store at {locks.parent} is busy: another process is naming a checkpoint "
                        f"(waited {timeout:g} s)")
    try:
        yield
    finally:
        os.close(fd)


@contextmanager
def held_file(path: Path, timeout: float) -> Iterator[bool]:
    """Hold an exclusive flock on `path` if it comes free within `timeout` s; yields whether
    it did (a caller that finds someone else at the work may leave it to them)."""
    fd = acquire(path, exclusive=True, timeout=timeout)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def live_holders(locks: Path) -> list[str]:
    """Describe who holds the store lock now; removes the notes of holders that died."""
    out = []
    for path in sorted(locks.glob("*.json")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its holder is alive
                note = json.loads(os.read(fd, 4096) or b"{}")
                since = time.strftime("%H:%M:%S", time.localtime(note.get("since", 0)))
                mode = "exclusively" if note.get("exclusive") else "shared"
                out.append(f"{note.get('operation')} (pid {note.get('pid')} on {note.get('host')}, "
                           f"{mode}, since {since})")
            else:
                path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return out


def acquire(path: Path, *, exclusive: bool, timeout: float, create: bool = True) -> int | None:
    """An fd holding a flock on `path` (created 0600), or None if it was not free within
    `timeout` s (0: one try). rewind's one way to take a file lock; the engine's locks too.
    `create=False`: a lock on a file that must exist (FileNotFoundError if it does not)."""
    deadline = time.monotonic() + timeout
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)


def is_held(path: Path) -> bool:
    """True if a process holds a flock on `path` now (a probe: nothing is kept; FileNotFoundError
    if there is no such file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextmanager
def _note(locks: Path, exclusive: bool, operation: str) -> Iterator[None]:
    """Leave the holder's note while the body runs. It is written under a temporary name,
    flock'ed, then renamed into view, so no reader sees it unlocked and takes it for stale.
    The note only informs: if it cannot be written (a full disk), the lock holds without it."""
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp, path = locks / f".{token}.tmp", locks / f"{token}.json"
    fd = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"operation": operation, "exclusive": exclusive, "pid": os.getpid(),
                                 "host": socket.gethostname(), "since": time.time()}).encode())
        os.rename(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)
