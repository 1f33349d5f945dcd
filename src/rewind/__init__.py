"""rewind: an undo button for AI agents, built on QEMU microVMs.

    from rewind import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.exec("uname -a").stdout)
"""

from rewind.engine.agent import ExecResult
from rewind.errors import (
    AgentError,
    AgentGone,
    AlreadyExists,
    Busy,
    CommandFailed,
    ImageError,
    InvalidArgument,
    MachineDied,
    MachineNotRunning,
    NotFound,
    RewindError,
)
from rewind.home import Home
from rewind.sandbox import Checkpoint, Files, Sandbox

__all__ = [
    "AgentError", "AgentGone", "AlreadyExists", "Busy", "Checkpoint", "CommandFailed", "ExecResult", "Files",
    "Home",
    "ImageError", "InvalidArgument", "MachineDied", "MachineNotRunning", "NotFound", "RewindError",
    "Sandbox",
]
