"""What changed between two points of machines' histories, or between a point and a machine
as it runs now: files (read on the host from the disk layers, see filediff.py), Debian
packages (the dpkg status file on either disk), processes and listening sockets (what each
side's guest said: at capture for a point, see gueststate.py; at once for a running
machine), network rules and labels.

A running machine is flushed through its agent and paused while its disk is read (QEMU
writes its own metadata out when it pauses), so its layers hold what its guest sees.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from rewind.engine import gueststate, pending
from rewind.engine.changes.filediff import Disk, IndexCache, diff_disks, file_bytes, index_ahead
from rewind.engine.checkpoint import Caches, layer_path
from rewind.engine.disk import diskchain
from rewind.engine.engine import Engine
from rewind.engine.locks import file_lock
from rewind.engine.machine import LOCK_TIMEOUT, Machine
from rewind.engine.pointmeta import PointMeta
from rewind.engine.points import Point
from rewind.errors import InvalidArgument, RewindError
from rewind.results import Diff, PackageChange
from rewind.store import Store

CONTENT_LIMIT = 4 << 20  # --content compares text files up to this size
_STATUS = "/var/lib/dpkg/status"


@dataclass
class _Side:
    what: str
    disk: Disk
    guest: dict
    network: dict | None
    labels: dict | None


def diff(engine: Engine, store: Store, before: str | Point, after: str | Point | Machine, *,
         relative_to: str | None = None, include_noise: bool = False,
         globs: list[str] | None = None) -> Diff:
    """What changed from point `before` to point or running machine `after`. `~N` refs count
    back from point `relative_to`."""
    with _side(engine, store, before, relative_to) as a, _side(engine, store, after, relative_to) as b:
        files = diff_disks(a.disk, b.disk, include_noise=include_noise, globs=globs)
        packages = _packages(a.disk, b.disk)
        result = Diff(before=a.what, after=b.what, files=files, packages=packages,
                      network=_changed(a.network, b.network), labels=_changed(a.labels, b.labels),
                      notes=[n for s in (a, b) for n in _notes(s)])
        if a.guest.get("synced") and b.guest.get("synced"):
            pa, pb = _processes(a.guest), _processes(b.guest)
            la, lb = set(a.guest.get("listening", [])), set(b.guest.get("listening", []))
            result = replace(result, processes_started=[pb[k] for k in sorted(pb.keys() - pa.keys())],
                             processes_ended=[pa[k] for k in sorted(pa.keys() - pb.keys())],
                             listening_opened=sorted(lb - la), listening_closed=sorted(la - lb))
        return result


def content(engine: Engine, store: Store, before: str | Point, after: str | Point | Machine, path: str, *,
            relative_to: str | None = None) -> str:
    """A unified diff of one text file between the two sides ('' if it is the same)."""
    with _side(engine, store, before, relative_to) as a, _side(engine, store, after, relative_to) as b:
        old, new = file_bytes(a.disk, path, CONTENT_LIMIT + 1), file_bytes(b.disk, path, CONTENT_LIMIT + 1)
    if old is None and new is None:
        raise InvalidArgument(f"{path} is not a regular file on either side")
    if max(len(old or b""), len(new or b"")) > CONTENT_LIMIT:
        raise InvalidArgument(f"{path} is over {CONTENT_LIMIT >> 20} MiB: compare it another way")
    try:
        old_text, new_text = (old or b"").decode(), (new or b"").decode()
    except UnicodeDecodeError:
        return "" if old == new else f"Binary file {path} differs\n"
    lines = difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                 fromfile=f"a{path}" if old is not None else "/dev/null",
                                 tofile=f"b{path}" if new is not None else "/dev/null")
    bare = "\n\\ No newline at end of file\n"
    return "".join(line if line.endswith("\n") else line + bare for line in lines)


@contextmanager
def _side(engine: Engine, store: Store, which: str | Point | Machine,
          relative_to: str | None) -> Iterator[_Side]:
    cache = IndexCache(own=engine.home.root / "cache" / "fileindex", image=engine.home.images / "fileindex",
                       merged=lambda chain: diskchain.reading_files(chain, engine.home))
    if isinstance(which, Machine):
        with _live(which, cache) as side:
            yield side
        return
    point = which if isinstance(which, Point) else engine.find_point(store, which, relative_to).point
    layers = _point_layers(engine, store, point)
    disk = Disk(layers, len(layers), cache)
    try:
        meta = PointMeta.from_json(point.id, point.meta)
        yield _Side(f"point {point.id[:12]} (machine {point.machine})", disk,
                    meta.guest or {"synced": False, "why": "it was taken by an older rewind"},
                    meta.network or None, meta.machine_labels)
    finally:
        disk.close()


def _point_layers(engine: Engine, store: Store, point: Point) -> list[Path]:
    """A point's disk layers on this host: its capture's while it is pending, else unpacked
    from the store (once: they are cached like a restore's)."""
    for p in pending.captured(engine.home):
        if p.id == point.id and all(Path(d).exists() for d in p.disks):
            return [Path(d) for d in p.disks]
    manifest = store.get(point.id)
    caches = Caches.of(engine.home.root, engine.home.runtime)
    layers = []
    for i in range(PointMeta.from_json(manifest.id, manifest.meta).disk_layers(manifest.id)):
        blob = manifest.blobs[f"disk.{i}"]
        dest = layer_path(caches, blob)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.materialize(blob, dest, durable=True)
        layers.append(dest)
    return layers


@contextmanager
def _live(machine: Machine, cache: IndexCache) -> Iterator[_Side]:
    """A running machine, flushed and paused while it is read. Its disk's top layer is the
    one QEMU writes: its directory index is not cached."""
    what = f"machine {machine.name!r}"
    with file_lock(machine.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=what):
        machine.reload()
        machine.check_alive()
        r = machine.record
        if len(r.disks) > 1:
            index_ahead([Path(d) for d in r.disks[:-1]], cache)
        guest = gueststate.flush(machine.path)
        with machine.monitor() as mon:
            running = mon.cmd("query-status").get("running", False)
            if running:
                mon.cmd("stop")  # QEMU drains and flushes its disk: its files are whole for us
            try:
                disk = Disk([Path(d) for d in r.disks], len(r.disks) - 1, cache)
                try:
                    yield _Side(f"machine {machine.name} now", disk, guest, r.network, dict(r.labels))
                finally:
                    disk.close()
            finally:
                if running:
                    with contextlib.suppress(RewindError):
                        mon.cmd("cont")


def _notes(side: _Side) -> list[str]:
    if side.guest.get("synced"):
        return []
    why = side.guest.get("why", "")
    return [f"{side.what}: its guest did not write its cached writes to disk first ({why}); files it "
            "wrote in the seconds before may be missing or partial, and its processes are not known"]


def _changed(a: dict | None, b: dict | None) -> dict | None:
    return None if a is None or b is None or a == b else {"before": a, "after": b}


def _processes(guest: dict) -> dict[tuple[int, int], str]:
    """(pid, start time) -> "pid command line": a pid can be reused."""
    return {(pid, start): f"{pid} {line}" for pid, start, line in guest.get("processes", [])}


def _packages(a: Disk, b: Disk) -> list[PackageChange]:
    ia, ib = a.index.resolve(_STATUS), b.index.resolve(_STATUS)
    sa = None if ia is None else a.view.stat(ia)
    sb = None if ib is None else b.view.stat(ib)
    if ia == ib and sa == sb:
        return []
    before = _installed(file_bytes(a, _STATUS, 64 << 20) or b"")
    after = _installed(file_bytes(b, _STATUS, 64 << 20) or b"")
    changes = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old != new:
            kind = "installed" if old is None else "removed" if new is None else "upgraded"
            changes.append(PackageChange(name, kind, old, new))
    return changes


def _installed(status: bytes) -> dict[str, str]:
    """Package (with its architecture if not the native one's "all"/amd64) -> version, of
    those dpkg calls installed."""
    found = {}
    for stanza in status.decode(errors="replace").split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            found[fields["Package"]] = fields.get("Version", "")
    return found
