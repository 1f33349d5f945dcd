"""The generated references (docs/reference/) are what the code gives: a command, a route or
an MCP tool cannot come without its page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_http_and_mcp_references_are_up_to_date() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
