"""Crash points (rewind/crashpoints.py): a verb killed with SIGKILL just before its N-th durable
step, in the CLI, its committer or its memory splitter, loses nothing. After each kill:
`store check --read-data` passes, every listed checkpoint runs, no journal is older than a
minute, every path in every machine record exists, no QEMU or network filter runs without a
record, and the machine still answers.

The suite kills each verb at a few steps (SUITE_STEPS); scripts/crash-sweep
(REWIND_CRASH_SWEEP=all) at every step until the verb runs to its end, and prints the counts.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import alive, cleanup_home, processes_using, rewind_cli

from rewind import Home
from rewind.crashpoints import CRASH_ENV, LOG_ENV
from rewind.engine import pending
from rewind.engine.machine import Engine

SWEEP_ENV = "REWIND_CRASH_SWEEP"
FULL = os.environ.get(SWEEP_ENV) == "all"
SUITE_STEPS = (1, 3)
# Past this many steps the full sweep goes on in growing strides (a commit renames each new chunk).
EVERY_STEP_UNTIL = 16
JOURNAL_AGE_LIMIT_S = 60.0
SETTLE_S = 30.0  # for a crashed committer's or an ended restore's leftovers to be taken up

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


def _ok(*args: str) -> str:
    done = rewind_cli(*args)
    assert done.returncode == 0, f"`rewind {' '.join(args)}`: {done.stderr.decode()}"
    return done.stdout.decode()


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
         prepare=lambda k, tmp: (tmp / "m.rwd").exists() or _ok("export", "m", str(tmp / "m.rwd")),
         check=lambda k, tmp: _check_imported(tmp / f"s{k}", tmp / "m.rwd")),
    Verb("rm", lambda k, tmp: ["rm", f"r{k}"], prepare=lambda k, tmp: _ok("create", f"r{k}", "--from", "m")),
]


def _check_imported(store: Path, export: Path) -> None:
    """The store an import was killed in checks clean, and the import done again succeeds (or
    finds it done); one killed before the store was made leaves one that can still be made."""
    if (store / "config.json").exists():
        _ok("store", "check", "--read-data", "--store", str(store))
    again = rewind_cli("import", "--store", str(store), str(export))
    assert again.returncode == 0 or b"already in this store" in again.stderr, again.stderr
    _ok("store", "check", "--read-data", "--store", str(store))


@pytest.fixture(scope="module")
def crash_home(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[Home]:
    root = tmp_path_factory.mktemp("crash")
    h = Home(root=root / "home", images=images_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REWIND_HOME", str(h.root))
        mp.setenv("REWIND_IMAGES", str(images_dir))
        _ok("start", "m")
        _ok("exec", "m", "--", "sh", "-c", "echo one > /root/f")
        _ok("checkpoint", "m", "--name", "first")
        _ok("exec", "m", "--", "sh", "-c", "echo two > /root/f")
        _ok("checkpoint", "m")
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
        _wait_until(lambda: log.exists() or not pending.journals(home), f"{verb.name} {role}:{n}")
    if not log.exists():  # it ran to its end, as it would have with no crash switch
        assert done.returncode == verb.exit_code, done.stderr.decode()
    elif role != "cli" and done.returncode != verb.exit_code:
        # A helper it waited on died (a splitter): the command fails, saying why in one line.
        said = done.stderr.decode()
        assert said.count("\n") == 1 and said.startswith("rewind: error:"), said
    return log.exists()


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def _assert_nothing_lost(home: Home, probed: set[str]) -> None:
    points = json.loads(_ok("checkpoints", "--json"))  # a reader: stores what a crash left pending
    _ok("store", "check", "--read-data")
    now = time.time()
    old = [j.name for j in pending.journals(home) if now - j.stat().st_mtime > JOURNAL_AGE_LIMIT_S]
    assert not old, f"journals older than a minute: {old}"
    # The next command on the machine finishes what the crash left half done (a restore).
    assert _ok("exec", "m", "--", "cat", "/root/f") in ("one\n", "two\n")
    machines = Engine(home).list()
    for machine in machines:
        record = machine.record
        paths = [*record.disks, *([record.ram] if record.state == "running" and record.ram else [])]
        missing = [p for p in paths if not os.path.exists(p)]
        assert not missing, f"machine {record.name}: its record names files that are gone: {missing}"
    for point in points:
        if point["id"] not in probed:  # a stored point never changes: once is enough
            _ok("create", "probe", "--from", point["id"])
            _ok("exec", "probe", "--", "true")
            _ok("rm", "probe")
            probed.add(point["id"])
    _tidy()
    _wait_until(lambda: not _unrecorded_processes(home), "processes with no record")


def _unrecorded_processes(home: Home) -> list[str]:
    """QEMUs and network filters of this home that no running machine's record accounts for."""
    machines = Engine(home).list()
    qemus = {m.record.pid for m in machines if m.record.state == "running"}
    folders = {str(m.path) for m in machines if m.record.state == "running"}
    strays = []
    for pid in processes_using([home.root, home.runtime]):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if not alive(pid):
            continue
        if comm.startswith("qemu-system") and pid not in qemus:
            strays.append(f"QEMU {pid}")
        if comm == "rewind-filter" and cwd not in folders:
            strays.append(f"filter {pid} in {cwd}")
    return strays


def _tidy() -> None:
    """Remove the machines a round made (copies, new machines), keeping `m`."""
    names = [m["name"] for m in json.loads(_ok("ls", "--json")) if m["name"] != "m"]
    if names:
        _ok("rm", *names)


@pytest.mark.parametrize("verb", VERBS, ids=[v.name for v in VERBS])
def test_a_crash_at_any_step_loses_nothing(crash_home: Home, verb: Verb, tmp_path: Path) -> None:
    probed: set[str] = set()
    counts = {}
    for role in verb.roles:
        for n in _steps():
            crashed = _crash(crash_home, verb, role, n, tmp_path)
            try:
                _assert_nothing_lost(crash_home, probed)
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
