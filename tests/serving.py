"""A real `rewind serve` process for tests (see rewind.serve.process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rewind import Home
from rewind.serve.process import home_env, serve_process

__all__ = ["home_env", "served"]


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
