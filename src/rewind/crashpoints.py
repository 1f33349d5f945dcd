"""Crash points: a switch that kills a rewind process with SIGKILL just before its N-th durable
step, so tests and scripts/crash-sweep can show that a crash at any step loses nothing.

    REWIND_CRASH_AT=ROLE:N

ROLE is the process: `cli` (any rewind command, the SDK's own process is never armed),
`commit` (a background committer) or `split` (a capture's memory splitter). A durable step is
a rename or replace, an unlink, a directory removal, or an fsync/syncfs (store/durable.py
announces those as the audit event `rewind.fsync`); a machine record's save is a replace. Steps
are counted per process through Python's audit hooks, so code needs no call of its own and
nothing is installed unless the switch is set. With REWIND_CRASH_LOG=FILE, a process about to
die appends one line there first (role, step, event, path), so a sweep knows a crash happened.
"""

from __future__ import annotations

import os
import signal
import sys

CRASH_ENV = "REWIND_CRASH_AT"
LOG_ENV = "REWIND_CRASH_LOG"
ROLES = ("cli", "commit", "split")
DURABLE_EVENTS = frozenset({"os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "rewind.fsync"})


def environment() -> dict[str, str]:
    """This process's crash-point settings, for a child it has started elsewhere (the spawner's)."""
    return {name: os.environ.get(name, "") for name in (CRASH_ENV, LOG_ENV)}


def arm(role: str) -> None:
    """In process `role`: if REWIND_CRASH_AT names it, die by SIGKILL just before its N-th
    durable step. A malformed value is said once on stderr and ignored."""
    spec = os.environ.get(CRASH_ENV, "")
    if not spec:
        return
    name, _, number = spec.partition(":")
    if name not in ROLES or not number.isdigit() or int(number) < 1:
        print(f"rewind: {CRASH_ENV}={spec!r} ignored: expected ROLE:N with ROLE one of "
              f"{', '.join(ROLES)} and N from 1", file=sys.stderr)
        return
    if name != role:
        return
    remaining = [int(number)]
    log = os.environ.get(LOG_ENV)

    def hook(event: str, args: tuple) -> None:
        if event in DURABLE_EVENTS:
            remaining[0] -= 1
            if remaining[0] == 0:
                if log:
                    with open(log, "a") as f:
                        f.write(f"{role} {number} {event} {args[0] if args else ''}\n")
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
