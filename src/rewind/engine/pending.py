"""Checkpoints still being stored.

A checkpoint call returns as soon as the guest runs again. What is left, QEMU writing
memory out and then hashing and compressing it into the store, goes on in a detached
committer process: the caller does not wait for it, and a caller that exits loses
nothing. Each pending checkpoint has a journal under `$REWIND_HOME/pending` (written
whole, then renamed into place) holding all its commit needs. Whoever commits it holds
a lock on the journal and deletes it once the checkpoint is in the store. `settle`
waits for pending checkpoints, and commits itself any whose committer died, so anything
that reads checkpoints sees them all. One machine's checkpoints are committed in order,
because each needs its parent in the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rewind.engine.checkpoint import Caches, commit_capture
from rewind.engine.migstream import StreamError
from rewind.engine.qemu import process_alive, start_detached, wait_exit
from rewind.engine.qmp import Monitor, MonitorError
from rewind.engine.snapshot import SavedState, wait_written, write_out, write_out_started
from rewind.errors import RewindError
from rewind.home import Home
from rewind.store import Store, StoreError

# A checkpoint that a machine is starting from (a branch) or in place of (a restore) is
# committed in the background this long after: a machine is busiest in its first moments
# (its guest code is translated afresh), and its start comes first. Whoever needs the
# checkpoint sooner (settle) commits it at once.
START_FIRST_S = 1.0


@dataclass(frozen=True)
class PendingCheckpoint:
    """A captured checkpoint: its id and files are final; its commit may still be running."""

    id: str
    seq: int  # orders one machine's checkpoints
    machine: str
    machine_uuid: str
    store: str
    parent: str | None
    name: str | None
    labels: dict[str, str]
    meta: dict
    history: int
    created: float
    ram: str
    devstate: str
    done: str  # the memory splitter's result, written when memory is all out
    disks: list[str] = field(default_factory=list)  # frozen layers, base first
    end_qemu: int | None = None  # a QEMU to end once it has written the memory (a restore's old one)
    end_layer: str | None = None  # and the empty top layer it was left writing to
    monitor: str | None = None  # that QEMU's QMP socket, while its memory is still to be written out
    not_before: float = 0.0  # the background committer waits until then (see START_FIRST_S)

    @property
    def state(self) -> SavedState:
        """What a new QEMU runs this point from (once wait_written returns)."""
        return SavedState(ram=Path(self.ram), devstate=Path(self.devstate),
                          disks=[Path(d) for d in self.disks])

    def wait_written(self) -> None:
        """Wait until QEMU has written the memory out; StreamError if it failed."""
        wait_written(Path(self.done))


def journals(home: Home, machine_uuid: str | None = None) -> list[Path]:
    """Pending journals (of one machine, or all), oldest first. They are named
    SEQ-MACHINE_UUID-ID.json."""
    found = (home.root / "pending").glob("*.json")  # nothing if there is no such folder
    return sorted((p for p in found if p.stem.split("-", 1)[1].startswith(machine_uuid or "")), key=_seq)


def _seq(journal: Path) -> int:
    return int(journal.stem.split("-", 1)[0])


def record(home: Home, point: PendingCheckpoint) -> None:
    """Journal `point` and start its committer."""
    folder = home.root / "pending"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{point.seq}-{point.machine_uuid}-{point.id}.json"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(json.dumps(asdict(point)))
    os.replace(tmp, path)
    start_committer(home, path)


def start_committer(home: Home, journal: Path) -> None:
    """A detached process that commits `journal` (niced: running guests come first)."""
    start_detached(["nice", sys.executable, "-c", "from rewind.engine.pending import main; main()",
                    str(home.root), str(home.images), str(journal)])


def settle(home: Home, machine_uuid: str | None = None) -> None:
    """Return once every pending checkpoint (of one machine, or all) is in its store."""
    for path in journals(home, machine_uuid):
        _commit(home, path, report=True)


def pending_names(home: Home) -> set[str]:
    """Checkpoint names taken by pending checkpoints."""
    names = set()
    for path in journals(home):
        with contextlib.suppress(OSError, ValueError):
            if name := json.loads(path.read_text()).get("name"):
                names.add(name)
    return names


def _commit(home: Home, path: Path, report: bool) -> None:
    """Commit the journal at `path` unless someone already has. With `report`, errors are
    raised (a lost capture once, then forgotten); without, they are left for settle."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # committed already
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not path.exists():
            return
        point = PendingCheckpoint(**json.loads(path.read_text()))
        for earlier in journals(home, point.machine_uuid):  # its parent, if pending, goes first
            if _seq(earlier) < point.seq:
                _commit(home, earlier, report)
        try:
            _write_out(point)
            point.wait_written()
        except StreamError as e:
            _end_qemu(point)
            _forget(path, point)
            if report:
                raise RewindError(f"checkpoint {point.id[:12]} of {point.machine} was lost: {e}") from None
            return
        _end_qemu(point)
        try:
            commit_capture(Store.open(point.store), Caches.of(home.root, home.runtime), point.id,
                           point.state, machine=point.machine, parent=point.parent, name=point.name,
                           labels=point.labels, meta=point.meta, history=point.history)
        except (RewindError, OSError) as e:
            if report:
                raise StoreError(f"checkpoint {point.id[:12]} of {point.machine} is captured but not yet "
                                 f"stored: {e}") from None
            return
        _forget(path, point)
    finally:
        os.close(fd)


def _write_out(point: PendingCheckpoint) -> None:
    """Have a restore's stopped QEMU write its memory out, unless that is done or under way."""
    if point.monitor is None or write_out_started(Path(point.ram), Path(point.devstate)):
        return
    try:
        with Monitor(Path(point.monitor)) as mon:
            write_out(mon, Path(point.ram), Path(point.devstate))
    except MonitorError as e:
        raise StreamError(f"its stopped QEMU is gone: {e}") from None


def _end_qemu(point: PendingCheckpoint) -> None:
    """End the QEMU a restore left, with SIGKILL: on a clean exit QEMU would unlink its PID
    file and sockets by path, and those paths are now its successor's."""
    if point.end_qemu is not None and process_alive(point.end_qemu, point.machine_uuid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(point.end_qemu, signal.SIGKILL)
        wait_exit(point.end_qemu, point.machine_uuid, 10)
    for leftover in (point.end_layer, point.monitor):
        if leftover is not None:
            Path(leftover).unlink(missing_ok=True)


def _forget(path: Path, point: PendingCheckpoint) -> None:
    Path(point.done).unlink(missing_ok=True)
    path.unlink()


def main() -> None:
    """The committer: `python -c ... HOME_ROOT IMAGES JOURNAL`."""
    root, images, journal = sys.argv[1:4]
    with contextlib.suppress(OSError, ValueError):
        time.sleep(max(0.0, json.loads(Path(journal).read_text()).get("not_before", 0.0) - time.time()))
    _commit(Home(root=Path(root), images=Path(images)), Path(journal), report=False)
