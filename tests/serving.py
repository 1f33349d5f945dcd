"""A real `rewind serve` process for tests (see rewind.serve.process)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from rewind import Home
from rewind.bench.load import processes_naming
from rewind.serve.process import home_env, serve_process

__all__ = ["daemon_pid", "home_env", "served"]


def daemon_pid(port: int) -> int:
    """The PID of the `rewind serve --port PORT` this process started (a child it is forking
    has its command line too, until it runs its own program)."""
    [pid] = [pid for pid in processes_naming(f"--port\0{port}\0") if _parent(pid) == os.getpid()]
    return pid


def _parent(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return None


@contextlib.contextmanager
def served(home: Home, log: Path, token: str | None) -> Iterator[str]:
    """The URL of a `rewind serve` over `home` (with `token` required, or --no-auth)."""
    auth = ["--no-auth"]
    if token is not None:
        token_file = log.with_suffix(".token")
        token_file.write_text(token + "\n")
        auth = ["--token-file", str(token_file)]
    with serve_process(home, log, auth) as url:
        yield url
