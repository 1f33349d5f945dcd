"""Crash points (rewind/crashpoints.py): a verb killed with SIGKILL just before its N-th durable
step, in the CLI, its committer or its memory splitter, loses nothing. After each kill:
`store check --read-data` passes, every listed checkpoint runs, no journal is older than a
minute, every path in every machine record exists, no QEMU or network filter runs without a
record, and the machine still answers.

The suite kills each verb's CLI at a few steps (SUITE_STEPS), and a checkpoint's helpers too;
scripts/crash-sweep (REWIND_CRASH_SWEEP=all) every role of every verb at every step until the
verb runs to its end, and prints the counts.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import cleanup_home, rewind_cli
from invariants import assert_home_whole, ok, wait_until

from rewind import Home, Sandbox
from rewind.crashpoints import CRASH_ENV, LOG_ENV
from rewind.engine import pending
from rewind.engine.process.qemu import process_alive

SWEEP_ENV = "REWIND_CRASH_SWEEP"
FULL = os.environ.get(SWEEP_ENV) == "all"
SUITE_STEPS = (3,)
# The suite crashes every verb's CLI, and the committer and splitter once each, in a checkpoint:
# they run the same code for every verb (the sweep crashes every role of every verb).
SUITE_HELPER_ROLES_IN = "checkpoint"
# Past this many steps the full sweep goes on in growing strides (a commit renames each new chunk).
EVERY_STEP_UNTIL = 16

_round = itertools.count()


@dataclass(frozen=True)
class Verb:
    """A CLI verb to crash: its command for round `k`, the processes it writes from, and what
    must exist before it runs."""

    name: str
    argv: Callable[[int, Path], list[str]]
    roles: tuple[str, ...] = ("cli",)
    prepare: Callable[[int, Path], None] = field(default=lambda k, tmp: None)
    check: Callable[[int, Path], None] = field(default=lambda k, tmp: None)  # beyond the home's
    exit_code: int = 0  # when it runs to its end


VERBS = [
    Verb("checkpoint", lambda k, tmp: ["checkpoint", "m", "--name", f"p{k}"], ("cli", "commit", "split")),
    Verb("restore", lambda k, tmp: ["restore", "m", "~1"], ("cli", "commit")),
    Verb("branch", lambda k, tmp: ["branch", "m", f"b{k}"], ("cli", "commit")),
    Verb("create-from", lambda k, tmp: ["create", f"n{k}", "--from", "m"]),
    Verb("try-kept", lambda k, tmp: ["try", "m", "--", "sh", "-c", f"echo {k} > /root/t"], ("cli", "commit")),
    Verb("try-thrown", lambda k, tmp: ["try", "m", "--", "sh", "-c", f"echo {k} > /root/t; exit 1"],
         ("cli", "commit"), exit_code=1),
    Verb("prune", lambda k, tmp: ["prune", "--keep-last", "2"]),
    Verb("gc", lambda k, tmp: ["gc"]),
    Verb("export", lambda k, tmp: ["export", "m", str(tmp / f"e{k}.rwd")]),
    # Into a store of its own each time: into the home's, the point is there already.
    Verb("import", lambda k, tmp: ["import", "--store", str(tmp / f"s{k}"), str(tmp / "m.rwd")],
         prepare=lambda k, tmp: (tmp / "m.rwd").exists() or ok("export", "m", str(tmp / "m.rwd")),
         check=lambda k, tmp: _check_imported(tmp / f"s{k}", tmp / "m.rwd")),
    Verb("rm", lambda k, tmp: ["rm", f"r{k}"], prepare=lambda k, tmp: ok("create", f"r{k}", "--from", "m")),
]


def _check_imported(store: Path, export: Path) -> None:
    """The store an import was killed in checks clean, and the import done again succeeds (or
    finds it done); one killed before the store was made leaves one that can still be made."""
    if (store / "config.json").exists():
        ok("store", "check", "--read-data", "--store", str(store))
    again = rewind_cli("import", "--store", str(store), str(export))
    assert again.returncode == 0 or b"already in this store" in again.stderr, again.stderr
    ok("store", "check", "--read-data", "--store", str(store))


@pytest.fixture(scope="module")
def crash_home(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[Home]:
    root = tmp_path_factory.mktemp("crash")
    h = Home(root=root / "home", images=images_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REWIND_HOME", str(h.root))
        mp.setenv("REWIND_IMAGES", str(images_dir))
        ok("start", "m")
        ok("exec", "m", "--", "sh", "-c", "echo one > /root/f")
        ok("checkpoint", "m", "--name", "first")
        ok("exec", "m", "--", "sh", "-c", "echo two > /root/f")
        ok("checkpoint", "m")
        yield h
        cleanup_home(h)


def _steps() -> Iterator[int]:
    if not FULL:
        yield from SUITE_STEPS
        return
    yield from range(1, EVERY_STEP_UNTIL + 1)
    n = EVERY_STEP_UNTIL
    while True:
        n = int(n * 1.5)
        yield n


def _crash(home: Home, verb: Verb, role: str, n: int, tmp: Path) -> bool:
    """Run `verb` with its `role` process set to die at step `n`; True if it died."""
    k = next(_round)
    verb.prepare(k, tmp)
    log = tmp / "crashes.log"
    log.unlink(missing_ok=True)
    done = rewind_cli(*verb.argv(k, tmp), env={CRASH_ENV: f"{role}:{n}", LOG_ENV: str(log)})
    verb.check(k, tmp)
    assert b"Traceback" not in done.stderr, done.stderr
    if role == "cli":
        assert log.exists() == (done.returncode == -9), (done.returncode, done.stderr)
    else:
        # The crash comes in a detached process: seen when it logs, or when its work is done.
        wait_until(lambda: log.exists() or not pending.journals(home), f"{verb.name} {role}:{n}")
    if not log.exists():  # it ran to its end, as it would have with no crash switch
        assert done.returncode == verb.exit_code and b"rewind: error:" not in done.stderr, done.stderr
    elif role != "cli" and done.returncode != verb.exit_code:
        # A helper it waited on died (a splitter): the command fails, saying why in one line.
        said = done.stderr.decode()
        assert said.count("\n") == 1 and said.startswith("rewind: error:"), said
    return log.exists()


@pytest.mark.parametrize("verb", VERBS, ids=[v.name for v in VERBS])
def test_a_crash_at_any_step_loses_nothing(crash_home: Home, verb: Verb, tmp_path: Path) -> None:
    probed: set[str] = set()
    counts = {}
    roles = verb.roles if FULL or verb.name == SUITE_HELPER_ROLES_IN else ("cli",)
    for role in roles:
        for n in _steps():
            crashed = _crash(crash_home, verb, role, n, tmp_path)
            try:
                assert ok("exec", "m", "--", "cat", "/root/f") in ("one\n", "two\n")
                assert_home_whole(crash_home, ["m"], probed)
            except AssertionError as e:
                log = tmp_path / "crashes.log"
                raise AssertionError(f"after {verb.name} {role}:{n} "
                                     f"({log.read_text().strip() if crashed else 'no crash'}): {e}") from e
            if not crashed:  # it ran to its end: fewer than n steps
                counts[role] = n - 1
                break
            counts[role] = n
    if FULL:
        print(f"\ncrash-sweep {verb.name}: " + ", ".join(f"{role} {c} steps" for role, c in counts.items()))


@pytest.mark.parametrize("verb", ["rm", "stop"])
def test_a_qemu_a_restore_left_ends_with_its_machine_after_its_committer_was_killed(
        home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verb: str) -> None:
    """A restore leaves its machine's old QEMU stopped, for its committer to write its memory
    out and end it. A committer killed (as the OOM killer would) left that QEMU running after
    `rm` of the machine and the deletion of its home: now `rm` and `stop` return once it is
    gone, and a committer is started again to store the point."""
    sbx = Sandbox.create("left", home=home)
    point = sbx.checkpoint(wait=True)
    # Past pagecapture's limit: the state it leaves is migrated out of the old QEMU, later.
    sbx.exec("head -c 80M /dev/urandom > /dev/shm/after", check=True)
    died = tmp_path / "died"
    monkeypatch.setenv(CRASH_ENV, "commit:1")  # the committer of the state the restore leaves
    monkeypatch.setenv(LOG_ENV, str(died))
    sbx.restore(point)
    wait_until(died.exists, "the committer to be killed", 60)
    (journal,) = pending.journals(home)
    left = pending.load(journal)
    assert left.end_qemu is not None and process_alive(left.end_qemu, left.machine_uuid)
    monkeypatch.delenv(CRASH_ENV)
    ok(verb, "left")
    assert not process_alive(left.end_qemu, left.machine_uuid)  # ended before the verb returned
    wait_until(lambda: not pending.journals(home), "its point to be stored", 60)
