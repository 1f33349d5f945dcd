"""rewind: an undo button for AI agents, built on QEMU microVMs.

    from rewind import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.exec("uname -a").stdout)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Names are imported on first use, so that helper processes that import one module
# of the package (the network filter, the migration splitter) start quickly.
_EXPORTS = {
    "Home": "rewind.home",
    "Files": "rewind.sandbox", "Sandbox": "rewind.sandbox", "try_in_copy": "rewind.sandbox",
    "classify": "rewind.guard.classify", "Decision": "rewind.guard.classify",
    **{name: "rewind.results" for name in (
        "Checkpoint", "ExecResult", "GuardedResult", "Outcome", "PortForward", "Refused", "TreeCopy")},
    **{name: "rewind.errors" for name in (
        "AgentError", "AgentGone", "AlreadyExists", "Busy", "CommandFailed", "ImageError", "InvalidArgument",
        "MachineDied", "MachineNotRunning", "NotFound", "RewindError")},
}
__all__ = [
    "AgentError", "AgentGone", "AlreadyExists", "Busy", "Checkpoint", "CommandFailed", "Decision",
    "ExecResult", "Files", "GuardedResult", "Home", "ImageError", "InvalidArgument", "MachineDied",
    "MachineNotRunning", "NotFound", "Outcome", "PortForward", "Refused", "RewindError", "Sandbox",
    "TreeCopy", "classify", "try_in_copy",
]

if TYPE_CHECKING:
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
    from rewind.guard.classify import Decision, classify
    from rewind.home import Home
    from rewind.results import Checkpoint, ExecResult, GuardedResult, Outcome, PortForward, Refused, TreeCopy
    from rewind.sandbox import Files, Sandbox, try_in_copy


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rewind' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
