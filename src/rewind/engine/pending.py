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
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from rewind import crashpoints
from rewind.engine.checkpoint import Caches, commit_capture
from rewind.engine.disk import diskchain
from rewind.engine.memory import ramcache
from rewind.engine.memory.migstream import PAGE_SIZE, SplitResult, StreamError
from rewind.engine.memory.pagecapture import WRITTEN_LIMIT
from rewind.engine.memory.snapshot import (
    CAPTURE_TIMEOUT,
    PageOverlay,
    SavedState,
    follow_written,
    front_file,
    splitter_ended,
    wait_written,
    write_out,
    write_out_started,
)
from rewind.engine.process.qemu import board_of, process_alive, start_detached, wait_exit
from rewind.engine.process.qmp import Monitor, MonitorError
from rewind.errors import RewindError
from rewind.home import Home
from rewind.store import Store, StoreError, open_store, take_unlocked, unlocked_for_child
from rewind.store.durable import append_line, replace_durably
from rewind.store.locks import is_held

# A checkpoint that a machine is starting from (a branch) or in place of (a restore) is
# committed in the background this long after: a machine is busiest in its first moments
# (its guest code is translated afresh), and its start comes first. Whoever needs the
# checkpoint sooner (settle) commits it at once. For a restore that includes its old QEMU's
# write-out: at 1 s it landed on an agent's next step, a try in a copy (in the loop, failed
# tries took 1.99 s at 1 s against 1.21-1.28 s at 3 s, passed ones 1.07 against 1.22-1.32 s,
# restores 0.54 against 0.64-0.69 s; three runs of 6 rounds, each the median of rounds 2-6).
START_FIRST_S = 3.0


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
    # Memory that may differ from checkpoint `ram_base`'s, as [first, last) ranges of chunk
    # numbers (see pagemap.py): only those chunks are read and hashed. None: all of it.
    ram_base: str | None = None
    ram_changed: list[list[int]] | None = None
    # Or, with no ram_base, the template's memory file they differ from, and its inode then:
    # a file made again under that name later is not the one the machine mapped.
    ram_base_file: str | None = None
    ram_base_inode: int | None = None
    # A capture by pages: the pages it copied, as [first, last) page ranges, over the memory
    # file its QEMU mapped (`ram_over`: its inode then, and the checkpoint it is, None for a
    # template's). Until its image is filled, the point runs from that file with those pages.
    ram_pages: Sequence[Sequence[int]] | None = None  # as [first, last) pairs
    ram_over: str | None = None
    ram_over_inode: int | None = None
    ram_over_point: str | None = None

    @property
    def board(self) -> str:
        return board_of(self.meta)

    @property
    def state(self) -> SavedState:
        """What a new QEMU runs this point from (once wait_written returns)."""
        return SavedState(ram=Path(self.ram), devstate=Path(self.devstate),
                          disks=[Path(d) for d in self.disks], board=self.board, point=self.id)

    def overlay_state(self) -> SavedState | None:
        """What a new QEMU can run this point from before its image is filled: the file its
        QEMU mapped, with the pages it wrote loaded over it; None if that file is gone (or
        another now has its name) or the pages are too many to load quickly."""
        if self.ram_pages is None or self.ram_over is None or \
                sum(last - first for first, last in self.ram_pages) * PAGE_SIZE > WRITTEN_LIMIT:
            return None
        try:
            if os.stat(self.ram_over).st_ino != self.ram_over_inode:
                return None
        except FileNotFoundError:
            return None
        pages = [(first, last) for first, last in self.ram_pages]
        return SavedState(ram=Path(self.ram_over), devstate=Path(self.devstate),
                          disks=[Path(d) for d in self.disks], board=self.board, point=self.id,
                          over=PageOverlay(Path(self.ram), pages, self.ram_over_point))

    def wait_written(self) -> SplitResult:
        """Wait until QEMU has written the memory out; StreamError if it failed."""
        return wait_written(Path(self.done), check=self.check_not_gone)

    def check_not_gone(self) -> None:
        """StreamError if nothing will ever finish writing its memory: its image was taken away
        (a live capture's is made before its journal, so only a host restart, tmpfs emptied,
        takes it, and its writer with it), or its splitter died without a result."""
        if self.monitor is None and not os.path.exists(self.ram):
            raise StreamError(f"the memory image of checkpoint {self.id[:12]} is gone before it was "
                              "all written (was the host restarted?)")
        if splitter_ended(Path(self.devstate)):
            raise StreamError(f"the memory splitter of checkpoint {self.id[:12]} ended before it "
                              "had written it all")


@dataclass(frozen=True)
class CommitStats:
    """What storing one point cost, one JSON line each in commit_stats_path (for `bench`)."""

    id: str
    cpu_s: float  # the splitter's, the commit's and a layer merge's CPU together
    split_cpu_s: float
    seconds: float  # from the capture until it was in the store
    version: int = 1
    followed: bool = False  # its memory was stored as it was written out (see follow_written)


def commit_stats_path(home: Home) -> Path:
    return home.root / "pending" / "stats.jsonl"


def read_commit_stats(home: Home) -> list[CommitStats]:
    try:
        lines = commit_stats_path(home).read_text().splitlines()
    except FileNotFoundError:
        return []
    stats = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError):
            stats.append(CommitStats(**json.loads(line)))
    return stats


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
    path = journal_path(home, point)
    # Its fields as they are: asdict() copies every page range one by one, and a daemon's
    # checkpoints held the interpreter lock for that while /health waited (py-spy).
    replace_durably(path, json.dumps({f.name: getattr(point, f.name) for f in fields(point)}).encode())
    start_committer(home, path)


def start_committer(home: Home, journal: Path) -> None:
    """A detached process that commits `journal` (niced: running guests come first), forked by
    the home's spawner where it answers."""
    from rewind.engine.process import spawner

    args = [str(home.root), str(home.images), str(journal)]
    # An encrypted store's keys go through a pipe: the committer skips scrypt (0.13 s here).
    fds: tuple[int, ...] = ()
    unlocked = unlocked_for_child()
    if unlocked:
        read, write = os.pipe()
        try:
            os.write(write, unlocked)  # a few hundred bytes: within the pipe's buffer
        finally:
            os.close(write)
        fds = (read,)
    try:
        request = spawner.Request("commit", [*args, *("{fd0}" for _ in fds)], nice=10)
        if spawner.spawn(home.runtime, request, fds) is None:
            start_detached(["nice", sys.executable, "-c", "from rewind.engine.pending import main; main()",
                            *args, *map(str, fds)], pass_fds=fds)
    finally:
        for fd in fds:  # the committer has its own copy
            os.close(fd)


def revive_committers(home: Home, machine_uuid: str) -> None:
    """Start a committer again for each of the machine's journals that none holds: one killed
    (the OOM killer, a SIGKILL to the home's helpers) left its point unstored and, after a
    restore, the QEMU that restore stopped running with no one to end it."""
    for journal in journals(home, machine_uuid):
        with contextlib.suppress(FileNotFoundError):  # committed meanwhile
            if not is_held(journal):
                start_committer(home, journal)


def settle(home: Home, machine_uuid: str | None = None) -> list[str]:
    """Return once every pending checkpoint (of one machine, or all) is in its store. Returns
    what was lost since the last call (each lost point is reported once)."""
    stores: dict[str, Store] = {}
    for path in journals(home, machine_uuid):
        _commit(home, path, report=True, stores=stores)
    return take_lost(home)


def _lost_path(home: Home) -> Path:
    return home.root / "pending" / "lost.jsonl"


def _lose(home: Home, path: Path, point: PendingCheckpoint, reason: str) -> None:
    """Forget a checkpoint that can never be stored, noting it for the next settle to report.
    A tombstone keeps its parent, so whatever named it (a machine's last point, a child's
    parent) now leads to the point before it."""
    tomb = home.root / "pending" / "lost" / point.id
    tomb.parent.mkdir(exist_ok=True)
    tomb.write_text(point.parent or "")
    with contextlib.suppress(OSError):
        append_line(_lost_path(home), {"id": point.id, "machine": point.machine, "reason": reason})
    _forget(path, point)


def _opened(home: Home, path: str) -> Store:
    """The store a journal names, signing what it commits with the home's key (the point is
    this home's: its committer runs for it, with the same home)."""
    from rewind.signers import signing_key  # the cipher library, only where a commit needs it

    store = open_store(path)
    store.signer = signing_key(home)
    return store


def surviving(home: Home, point_id: str | None) -> str | None:
    """`point_id`, or the nearest point before it that was not lost."""
    seen = set()
    while point_id is not None and point_id not in seen:
        seen.add(point_id)
        try:
            point_id = (home.root / "pending" / "lost" / point_id).read_text() or None
        except (FileNotFoundError, ValueError):
            return point_id
    return point_id


def take_lost(home: Home) -> list[str]:
    """The checkpoints lost since the last call, as messages; each is given once."""
    taken = _lost_path(home).with_suffix(f".{os.getpid()}")
    try:
        os.rename(_lost_path(home), taken)
    except FileNotFoundError:
        return []
    messages = []
    for line in taken.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            lost = json.loads(line)
            messages.append(f"checkpoint {lost['id'][:12]} of {lost['machine']} was lost before it was "
                            f"stored: {lost['reason']}")
    taken.unlink()
    return messages


def pending_names(home: Home) -> set[str]:
    """Checkpoint names taken by pending checkpoints."""
    return {point.name for point in captured(home) if point.name}


# Journals read, by path and file identity (a journal is replaced whole, never written in
# place). A daemon reads every pending journal on each restore and each trim of the memory
# cache, and a capture by pages lists its pages: under load (scripts/load, 6 clients) a
# third of the daemon's time holding the GIL went to parsing them again, and /health waited.
_READ: dict[Path, tuple[tuple[int, int, int], PendingCheckpoint]] = {}
_READ_KEPT = 256
_READ_LOCK = threading.Lock()


def load(path: Path) -> PendingCheckpoint:
    """A journal, read; RewindError if it is damaged (FileNotFoundError if it is gone)."""
    st = path.stat()
    identity = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _READ_LOCK:
        kept = _READ.get(path)
    if kept is not None and kept[0] == identity:
        return kept[1]
    try:
        point = PendingCheckpoint(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise RewindError(f"the journal {path} is damaged ({e}); remove it to forget that "
                          "checkpoint") from e
    with _READ_LOCK:
        _READ[path] = (identity, point)
        while len(_READ) > _READ_KEPT:
            del _READ[next(iter(_READ))]
    return point


def captured(home: Home) -> list[PendingCheckpoint]:
    """The checkpoints captured here and not yet stored, oldest first (damaged journals are
    skipped here; settle reports them)."""
    points = []
    for path in journals(home):
        with contextlib.suppress(OSError, RewindError):
            points.append(load(path))
    return points


def trim_images(home: Home) -> None:
    """Keep the memory images on tmpfs within their budget (see ramcache.py); captures not
    yet stored stay. With no machine left in the home, only the templates stay."""
    machines_left = any((home.root / "machines").glob("*/machine.json"))
    ramcache.trim(Caches.of(home.root, home.runtime).ram, lambda: _captured_images(home),
                  None if machines_left else 0)


def ensure_room(home: Home, need: int, what: str) -> None:
    """NoRoom unless `need` bytes of memory image fit on tmpfs (after releasing cached ones)."""
    ramcache.ensure_room(Caches.of(home.root, home.runtime).ram, need, lambda: _captured_images(home), what)


def _captured_images(home: Home) -> list[Path]:
    return [Path(p.ram) for p in captured(home)]


def journal_path(home: Home, point: PendingCheckpoint) -> Path:
    return home.root / "pending" / f"{point.seq}-{point.machine_uuid}-{point.id}.json"


def wait_captured(home: Home, point: PendingCheckpoint) -> SavedState | None:
    """The files to run a pending point from, once its memory is all written out (a restore's
    stopped QEMU is asked to write it now, unless its committer already does); None if the
    point was stored meanwhile (its files then come from the store). StreamError if the
    capture failed: the point is lost."""
    journal = journal_path(home, point)
    if point.monitor is not None:
        try:
            fd = os.open(journal, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its committer writes it out
            _write_out(point)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    if not Path(point.done).exists() and journal.exists():
        # Not filled yet: most often a restore right after its checkpoint (0.1-0.4 s of
        # waiting in the agent loop here). Its pages go over the file they were written over.
        overlay = point.overlay_state()
        if overlay is not None:
            return overlay
    deadline = time.monotonic() + CAPTURE_TIMEOUT
    while not Path(point.done).exists():
        if not journal.exists():
            return None
        point.check_not_gone()
        if time.monotonic() > deadline:
            raise StreamError(f"the memory of checkpoint {point.id[:12]} was not written within "
                              f"{CAPTURE_TIMEOUT:.0f} s")
        time.sleep(0.005)
    try:
        point.wait_written()
    except FileNotFoundError:  # stored and forgotten between the two looks
        return None
    return point.state


def _commit(home: Home, path: Path, report: bool, stores: dict[str, Store]) -> None:
    """Commit the journal at `path` unless someone already has. With `report`, errors are
    raised (a lost capture once, then forgotten); without, they are left for settle.
    `stores`: those opened so far, by path (a Store keeps the manifests it read or wrote, and
    a point's parent is most often the point committed just before)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # committed already
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not path.exists():
            return
        point = load(path)
        # Its parent goes first (this machine's earlier points, or the point of another
        # machine it was forked or created from): the commit refers to it.
        for earlier in journals(home, point.machine_uuid):
            if _seq(earlier) < point.seq:
                _commit(home, earlier, report, stores)
        if point.parent is not None:
            for parent in (home.root / "pending").glob(f"*-{point.parent}.json"):
                _commit(home, parent, report, stores)
        cpu_before = _process_cpu()
        split: list[SplitResult] = []

        def captured() -> SplitResult:
            split.append(_captured(point))
            return split[-1]
        try:
            store = stores.get(point.store) or stores.setdefault(point.store, _opened(home, point.store))
            if _stored(store, point.id):  # by a committer killed before it forgot the journal
                end_qemu(point)
                _forget(path, point)
                return
            _write_out(point)
            # Memory still being written out is stored as it comes (see follow_written).
            ram_written = follow_written(Path(point.devstate), check=point.check_not_gone)
            if ram_written is None:
                captured()
            commit_capture(store, Caches.of(home.root, home.runtime), point.id,
                           point.state, machine=point.machine, parent=surviving(home, point.parent),
                           name=point.name, labels=point.labels, meta=point.meta, history=point.history,
                           ram_base=point.ram_base, ram_changed=point.ram_changed,
                           ram_base_file=point.ram_base_file, ram_base_inode=point.ram_base_inode,
                           ram_written=ram_written, captured=None if ram_written is None else captured)
        except StreamError as e:  # the capture failed: nothing will ever store it
            end_qemu(point)
            _lose(home, path, point, str(e))
            return
        except (RewindError, OSError) as e:
            if report:
                raise StoreError(f"checkpoint {point.id[:12]} of {point.machine} is captured but not yet "
                                 f"stored: {e}") from e
            return
        _forget(path, point)
        with contextlib.suppress(OSError, RewindError):
            trim_images(home)
        with contextlib.suppress(OSError, RewindError):  # a cache: starts open the longer chain
            diskchain.merge_if_deep([Path(d) for d in point.disks], home)
        cpu = _process_cpu() - cpu_before
        split_cpu = split[-1].cpu_s if split else 0.0  # none: stored by another committer meanwhile
        with contextlib.suppress(OSError):
            append_line(commit_stats_path(home), asdict(CommitStats(
                id=point.id, cpu_s=round(cpu + split_cpu, 4), split_cpu_s=split_cpu,
                seconds=round(time.time() - point.created, 3), followed=ram_written is not None)))
    finally:
        os.close(fd)


def _stored(store: Store, point_id: str) -> bool:
    try:
        store.get(point_id)
    except LookupError:
        return False
    return True


def _captured(point: PendingCheckpoint) -> SplitResult:
    """Wait until the capture's memory is all written and its files are there, then end the
    QEMU it came from if it is to end; StreamError if it never will be."""
    split = point.wait_written()
    missing = [f for f in (point.ram, point.devstate, *point.disks) if not Path(f).exists()]
    if missing:  # the host restarted (tmpfs emptied), or someone removed them
        raise StreamError(f"its captured files are gone ({missing[0]})")
    end_qemu(point)
    return split


def _process_cpu() -> float:
    """CPU seconds of this process and the children it waited for (qemu-img's merges)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage,
                                                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def _write_out(point: PendingCheckpoint) -> None:
    """Have a restore's stopped QEMU write its memory out, unless that is done or under way.
    (At the lowest priority, tried on 2026-12-03 (ae9c933), the loop's tries were slower, 1.5-2.5 s
    against 1.2-2.3 s: the old QEMU and its memory then lived on into the next steps.)"""
    if point.monitor is None or write_out_started(Path(point.ram), Path(point.devstate)):
        return
    try:
        with Monitor(Path(point.monitor)) as mon:
            write_out(mon, Path(point.ram), Path(point.devstate))
    except MonitorError as e:
        raise StreamError(f"its stopped QEMU is gone: {e}") from e


def end_qemu(point: PendingCheckpoint) -> None:
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
    for result in (Path(point.done), front_file(Path(point.devstate))):
        result.unlink(missing_ok=True)
    path.unlink()


def main() -> None:
    """The committer, with sys.argv = [_, HOME_ROOT, IMAGES, JOURNAL] (see start_committer)."""
    crashpoints.arm("commit")
    root, images, journal = sys.argv[1:4]
    if len(sys.argv) > 4:  # the caller's unlocked store keys (start_committer)
        with open(int(sys.argv[4]), "rb") as handed:
            take_unlocked(handed.read())
    with contextlib.suppress(OSError, ValueError):
        time.sleep(max(0.0, json.loads(Path(journal).read_text()).get("not_before", 0.0) - time.time()))
    _commit(Home(root=Path(root), images=Path(images)), Path(journal), report=False, stores={})
