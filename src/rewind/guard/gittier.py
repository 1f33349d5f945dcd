"""The git tier: undo for steps that change only files git can take back.

Cheaper than a machine checkpoint by far: one request to the guest agent (in the
session that then runs the step) records the
project folder as a commit on a ref of our own (refs/rewind/guard), and one puts it
back. The user's branch, index and history are left as they were; the work is done
inside the guest (guest/gittier.py says how).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rewind.engine.agent import AgentClient
from rewind.errors import AgentError, RewindError


class GitTierError(RewindError):
    """The git tier could not record or restore a folder."""


@dataclass(frozen=True)
class GitPoint:
    """A project folder as recorded before a step."""

    folder: str
    commit: str
    seconds: float  # how long recording it took, as seen from the host


def _run(agent: AgentClient, action: str, folder: str) -> tuple[dict, float]:
    started = time.monotonic()
    try:
        reply = agent.git(action, folder)
    except AgentError as e:
        raise GitTierError(f"git tier could not {action} {folder}: {e}") from e
    return reply, time.monotonic() - started


def save(agent: AgentClient, folder: str) -> GitPoint:
    """Record `folder`'s repository (tracked files and untracked, not ignored ones) before a step."""
    reply, seconds = _run(agent, "save", folder)
    return GitPoint(folder=folder, commit=reply["commit"], seconds=seconds)


def restore(agent: AgentClient, point: GitPoint) -> None:
    """Put the work tree, HEAD, its branch and the index back as `point` found them."""
    _run(agent, "restore", point.folder)
