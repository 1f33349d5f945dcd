"""A host restart, simulated: every process of a home ends at once (SIGKILL) and its runtime
folder on tmpfs is emptied. Nothing on disk is lost: every verb answers within seconds, the
points that were only on tmpfs are named lost once, and the machine boots again from its disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import pytest
from conftest import alive, processes_using, rewind_cli, wait_until

from rewind import Home, Sandbox
from rewind.engine import pending

VERB_LIMIT_S = 10.0
BOOT_LIMIT_S = 30.0  # a cold boot under TCG: 8-11 s (11.3 s on a busy CI host)


def _restart_host(home: Home) -> None:
    """End every process of the home with SIGKILL (as a power loss would) and empty tmpfs."""
    pids = processes_using([home.root, home.runtime])
    assert pids, "no process of the home was found"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(alive(pid) for pid in pids), "the home's processes ending on SIGKILL",
               timeout=10, every=0.01)
    shutil.rmtree(home.runtime)


def _timed_cli(*args: str, limit: float = VERB_LIMIT_S) -> tuple[str, str, int]:
    started = time.monotonic()
    done = rewind_cli(*args, timeout=60)
    took = time.monotonic() - started
    assert took < limit, f"`rewind {' '.join(args)}` took {took:.1f} s after the restart"
    assert b"Traceback" not in done.stderr, done.stderr
    return done.stdout.decode(), done.stderr.decode(), done.returncode


def test_after_a_host_restart_every_verb_answers_and_the_machine_boots_again(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    start_committer = pending.start_committer
    monkeypatch.setattr(pending, "start_committer", lambda *_: None)  # the second point stays on tmpfs
    sbx = Sandbox.create("rebooted", home=home)
    sbx.files.write("/root/f", "one")
    stored = sbx.checkpoint(name="stored")
    sbx.history()  # a reader stores what is pending: `stored` is in the store now
    sbx.files.write("/root/f", "two")
    only_captured = sbx.checkpoint(name="captured")
    assert pending.journals(home)
    monkeypatch.setattr(pending, "start_committer", start_committer)  # (not undo(): REWIND_HOME stays)

    _restart_host(home)

    out, err, rc = _timed_cli("ls")
    assert rc == 0 and "rebooted" in out
    out, err, rc = _timed_cli("log", "rebooted")
    assert rc == 0 and "stored" in out and "captured" not in out
    assert only_captured.id[:12] in err and "lost" in err  # named once...
    out, err, rc = _timed_cli("log", "rebooted")
    assert rc == 0 and "lost" not in err  # ...and not again
    out, err, rc = _timed_cli("exec", "rebooted", "--", "true")
    assert rc != 0 and "rewind start rebooted" in err.replace("`", "")
    out, err, rc = _timed_cli("start", "rebooted", limit=BOOT_LIMIT_S)  # a cold boot from its disk
    assert rc == 0, err
    out, err, rc = _timed_cli("exec", "rebooted", "--", "cat", "/etc/hostname")
    assert rc == 0 and out == "rebooted\n"
    out, err, rc = _timed_cli("restore", "rebooted", "stored")
    assert rc == 0, err
    out, err, rc = _timed_cli("exec", "rebooted", "--", "cat", "/root/f")
    assert rc == 0 and out == "one"
    out, err, rc = _timed_cli("store", "check")
    assert rc == 0, err
    assert stored.id in [c.id for c in Sandbox.get("rebooted", home=home).history()]
