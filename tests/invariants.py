"""What must hold in a home after crashes and concurrent commands (tests/test_crash_points.py,
tests/test_soak.py): the store checks clean, every listed checkpoint runs, no journal is
older than a minute, every machine answers and every path its record names exists, and no
QEMU or network filter runs without a record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from conftest import alive, processes_using, rewind_cli, wait_until

from rewind import Home
from rewind.engine import pending
from rewind.engine.engine import Engine

JOURNAL_AGE_LIMIT_S = 60.0
SETTLE_S = 30.0  # for a crashed committer's or an ended restore's leftovers to be taken up


def ok(*args: str) -> str:
    """stdout of `rewind ARGS`, which must succeed."""
    done = rewind_cli(*args)
    assert done.returncode == 0, f"`rewind {' '.join(args)}`: {done.stderr.decode()}"
    return done.stdout.decode()


def assert_home_whole(home: Home, keep: list[str], probed: set[str]) -> None:
    """Check every invariant; machines other than `keep` are removed on the way. `probed`:
    checkpoints already run once (a stored point never changes), added to."""
    points = json.loads(ok("checkpoints", "--json"))  # a reader: stores what a crash left pending
    ok("store", "check", "--read-data")
    now = time.time()
    old = [j.name for j in pending.journals(home) if now - j.stat().st_mtime > JOURNAL_AGE_LIMIT_S]
    assert not old, f"journals older than a minute: {old}"
    for name in keep:  # the next command on a machine finishes what was left half done
        ok("exec", name, "--", "true")
    for machine in Engine(home).list():
        record = machine.record
        paths = [*record.disks, *([record.ram] if record.state == "running" and record.ram else [])]
        missing = [p for p in paths if not os.path.exists(p)]
        assert not missing, f"machine {record.name}: its record names files that are gone: {missing}"
    for point in points:
        if point["id"] not in probed:
            ok("create", "probe", "--from", point["id"])
            ok("exec", "probe", "--", "true")
            ok("rm", "probe")
            probed.add(point["id"])
    others = [m["name"] for m in json.loads(ok("ls", "--json")) if m["name"] not in keep]
    if others:
        ok("rm", *others)
    wait_until(lambda: not unrecorded_processes(home), "processes with no record")


def unrecorded_processes(home: Home) -> list[str]:
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
