"""A `rewind serve` as a child process, for the benchmark and the tests: on a free loopback
port, over one home, ready once /health answers, and ended by its PID."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2

from rewind.home import Home

READY_WITHIN = 60.0  # seconds; importing the server is the slow part on a loaded host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def home_env(home: Home) -> dict[str, str]:
    """This process's environment, pointed at `home`."""
    return {**os.environ, "REWIND_HOME": str(home.root), "REWIND_IMAGES": str(home.images)}


@contextlib.contextmanager
def serve_process(home: Home, log: Path, args: list[str]) -> Iterator[str]:
    """The URL of a `rewind serve ARGS` over `home` (its stderr in `log`), once it answers."""
    url = f"http://127.0.0.1:{(port := free_port())}"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rewind.cli", "serve", "--port", str(port), *args],
                                env=home_env(home), stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rewind serve exited with {proc.returncode}: {log.read_text()[-500:]}")
        with contextlib.suppress(httpx2.TransportError):
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"rewind serve did not answer within {READY_WITHIN:.0f} s: {log.read_text()[-500:]}")
