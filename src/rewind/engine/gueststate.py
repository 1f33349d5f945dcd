"""What a checkpoint asks of its guest first, when the guest can answer: write its cached
writes to the disk, so that the point's disk layers hold its files as the guest sees them
(a diff reads them on the host), and say which processes run and which sockets listen.

Best effort, and bounded: a checkpoint must not wait on a guest whose agent is busy or
hung (it is captured all the same), so the point then records that it was not flushed.
"""

from __future__ import annotations

import time
from pathlib import Path

from rewind.engine.agent import AgentClient
from rewind.engine.locks import any_free_lock
from rewind.engine.process.qemu import AGENT_PORTS, agent_socket
from rewind.errors import RewindError

SYNC_TIMEOUT = 3.0  # a step that just wrote 100 MiB takes about a second here to flush
CONNECT_TIMEOUT = 1.0


def flush(machine_dir: Path) -> dict:
    """The `guest` entry of a point's meta: {"synced": bool, "processes", "listening"} or
    {"synced": False, "why": ...}."""
    started = time.monotonic()
    ports = [machine_dir / f"port-{i}.lock" for i in range(AGENT_PORTS)]
    try:
        with any_free_lock(ports, timeout=0.2, what="its guest agent") as port, \
                AgentClient(machine_dir / agent_socket(port), connect_timeout=CONNECT_TIMEOUT) as client:
            state = client.sync(SYNC_TIMEOUT)
    except (RewindError, OSError) as e:
        return {"synced": False, "why": str(e)}
    return {"synced": True, "flush_s": round(time.monotonic() - started, 4),
            "processes": state.get("processes", []), "listening": state.get("listening", [])}
