"""Connecting to QEMU's unix sockets, whose full paths may exceed the 107-byte limit."""

from __future__ import annotations

import os
import socket
from pathlib import Path

_SUN_PATH_MAX = 107


def connect_unix(path: Path, timeout: float | None = None) -> socket.socket:
    """Connect to a unix socket; long paths go through /proc/self/fd of their directory."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            sock.connect(os.fspath(path))
        else:
            dirfd = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
            try:
                sock.connect(f"/proc/self/fd/{dirfd}/{path.name}")
            finally:
                os.close(dirfd)
    except BaseException:
        sock.close()
        raise
    return sock
