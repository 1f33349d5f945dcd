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
    "ExecResult": "rewind.engine.agent",
    "Home": "rewind.home",
    "Checkpoint": "rewind.sandbox", "Files": "rewind.sandbox", "Sandbox": "rewind.sandbox",
    "TreeCopy": "rewind.sandbox", "try_in_copy": "rewind.sandbox",
    "classify": "rewind.guard.classify", "Decision": "rewind.guard.classify",
    "Outcome": "rewind.guard.trial",
    "PortForward": "rewind.engine.ports",
    "GuardedResult": "rewind.guard.guarded", "Refused": "rewind.guard.guarded",
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
    from rewind.engine.agent import ExecResult
    from rewind.engine.ports import PortForward
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
    from rewind.guard.guarded import GuardedResult, Refused
    from rewind.guard.trial import Outcome
    from rewind.home import Home
    from rewind.sandbox import Checkpoint, Files, Sandbox, TreeCopy, try_in_copy


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rewind' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
