"""Advisory file locks (flock) with a timeout, so two rewind commands never step on each other."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rewind.errors import Busy


def _try_lock(path: Path, shared: bool) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextmanager
def file_lock(path: Path, *, shared: bool = False, timeout: float = 30.0, what: str = "it") -> Iterator[None]:
    """Hold a lock on `path`; raise Busy naming `what` if it is not free within `timeout` s."""
    deadline = time.monotonic() + timeout
    while (fd := _try_lock(path, shared)) is None:
        if time.monotonic() >= deadline:
            raise Busy(f"{what} is busy: another rewind command is using it (waited {timeout:.0f} s)")
        time.sleep(0.02)
    try:
        yield
    finally:
        os.close(fd)


@contextmanager
def any_free_lock(paths: list[Path], *, timeout: float = 30.0, what: str = "it") -> Iterator[int]:
    """Hold the first free one of several exclusive locks; yields its index."""
    deadline = time.monotonic() + timeout
    while True:
        for i, path in enumerate(paths):
            fd = _try_lock(path, shared=False)
            if fd is not None:
                try:
                    yield i
                finally:
                    os.close(fd)
                return
        if time.monotonic() >= deadline:
            raise Busy(f"{what} is busy: all {len(paths)} sessions are in use (waited {timeout:.0f} s)")
        time.sleep(0.02)
