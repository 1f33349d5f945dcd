"""Advisory file locks with a timeout, so two rewind commands never step on each other: the
engine's face (errors naming what is busy) over the store's one flock primitive."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rewind.errors import Busy
from rewind.store.locks import acquire


@contextmanager
def file_lock(path: Path, *, shared: bool = False, timeout: float = 30.0, what: str = "it") -> Iterator[None]:
    """Hold a lock on `path`; raise Busy naming `what` if it is not free within `timeout` s."""
    fd = acquire(path, exclusive=not shared, timeout=timeout)
    if fd is None:
        raise Busy(f"{what} is busy: another rewind command is using it (waited {timeout:.0f} s)")
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
            fd = acquire(path, exclusive=True, timeout=0)
            if fd is not None:
                try:
                    yield i
                finally:
                    os.close(fd)
                return
        if time.monotonic() >= deadline:
            raise Busy(f"{what} is busy: all {len(paths)} sessions are in use (waited {timeout:.0f} s)")
        time.sleep(0.02)
