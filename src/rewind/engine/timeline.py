"""Checkpoint, restore, fork and create-from: how a running machine becomes a point, and a
point a running machine again. The whole flow reads top to bottom here:

- `checkpoint`: the guest is captured at one instant (snapshot.capture: memory image, device
  state, frozen disk layer); the capture is journaled as a PendingCheckpoint (pending.py)
  and returned at once, while QEMU writes memory out and a detached committer stores it.
- `restore`: the point is located (points.py: stored, or still pending here and run from its
  capture); the state the machine leaves is captured first, with its guest stopped for
  good; a new QEMU runs the point in its place, under the same name and identity.
- `fork`: the source is captured once (held paused until its memory is written when the
  caller waits on the copies); each copy is a new machine running that capture.
- `create_from`: a new machine running a located point, after its meta is checked.

`Machine` (machine.py) keeps what one machine is: its record, QEMU, agent and lifecycle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.engine import gueststate, pending
from rewind.engine.checkpoint import RAM_CHUNK_SIZE, Caches
from rewind.engine.handoff import finish_interrupted_restore, handoff_monitor, run_state
from rewind.engine.locks import file_lock
from rewind.engine.machine import LOCK_TIMEOUT, Handoff, validate_name
from rewind.engine.memory.memfiles import private_runtime
from rewind.engine.memory.pagecapture import WRITTEN_LIMIT, mapped_memory
from rewind.engine.memory.snapshot import capture, ensure_populated, mark_populated, populate_need
from rewind.engine.network import ports
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.pending import PendingCheckpoint
from rewind.engine.pointmeta import PointMeta
from rewind.engine.points import locate
from rewind.engine.process.qemu import QMP_SOCKET, RUNTIME_NODE, disk_node, qemu_build
from rewind.errors import Busy, InvalidArgument, NotFound, PortError, RewindError
from rewind.store import new_checkpoint_id
from rewind.store.errors import BadRef, CheckpointExists, UnknownCheckpoint
from rewind.store.model import DEFAULT_HISTORY, Ref, validate_checkpoint_name

log = logging.getLogger("rewind")

if TYPE_CHECKING:
    from rewind.engine.engine import Engine
    from rewind.engine.machine import Machine, MachineRecord
    from rewind.engine.memory.snapshot import SavedState
    from rewind.engine.points import Located, Point
    from rewind.engine.process.qmp import Monitor
    from rewind.home import Home
    from rewind.store import CheckpointManifest, Store

# ---- checkpoint ----

def checkpoint(machine: Machine, store: Store, name: str | None = None, labels: dict[str, str] | None = None,
               history: int = DEFAULT_HISTORY, live: bool = True, start_first: bool = False,
               held: bool = False, context: str | None = None) -> PendingCheckpoint:
    """Save memory, devices and disk of `machine` as of one instant into `store`; the machine
    runs on, unless not `live`: then its guest is stopped for good, and its QEMU is ended once
    it has written the memory out (the caller starts another in its place). `start_first`: a
    machine is about to start from it or in its place; its commit waits a moment. `held`: the
    guest stays stopped until its memory is written (see snapshot.capture). `context`, the
    caller's own state, is kept in the point's meta as given.

    Returns once the instant is captured; QEMU writing memory out and the commit into the
    store go on in the background (pending.py): `settle` waits for them."""
    with _name_held(machine.home, store, name):
        machine.reload()  # a handle's record may predate a restore that another process left half done
        finish_interrupted_restore(machine)
        # Shared, as a session's: a restore, stop or delete (exclusive) waits for the capture.
        with machine.locked(shared=True):
            return _capture_locked(machine, store, name, labels, history, live, start_first, held, context)


@contextmanager
def _name_held(home: Home, store: Store, name: str | None) -> Iterator[None]:
    """A checkpoint's name checked free and held until its journal names it: two checkpoints
    given one name at once both passed the check, and the second one's commit then failed
    for good (issue 11)."""
    if name is None:
        yield
        return
    validate_checkpoint_name(name)
    folder = home.root / "pending"
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / "names.lock", timeout=LOCK_TIMEOUT, what="checkpoint names"):
        if name in pending.pending_names(home) or _names_a_checkpoint(store, name):
            raise CheckpointExists(f"checkpoint name {name!r} is taken")
        yield


def _names_a_checkpoint(store: Store, name: str) -> bool:
    try:
        store.get(name)
    except (UnknownCheckpoint, BadRef):  # BadRef: a name such as "c0" also reads as a short id
        return False
    return True


def _capture_locked(machine: Machine, store: Store, name: str | None, labels: dict[str, str] | None,
                    history: int = DEFAULT_HISTORY, live: bool = True, start_first: bool = False,
                    held: bool = False, context: str | None = None) -> PendingCheckpoint:
    """checkpoint(), for a caller holding the machine lock: one capture at a time."""
    try:
        with file_lock(machine.path / "checkpoint.lock", timeout=0, what=f"machine {machine.name!r}"):
            machine.reload()
            return _capture(machine, store, name, labels, history, live, start_first, held, context)
    except Busy as e:
        raise Busy(f"a checkpoint of machine {machine.name!r} is already running") from e


def _capture(machine: Machine, store: Store, name: str | None, labels: dict[str, str] | None, history: int,
             live: bool, start_first: bool, held: bool, context: str | None) -> PendingCheckpoint:
    home = machine.home
    caches = Caches.of(home.root, private_runtime(home.runtime))
    for folder in (caches.ram, caches.devstate, caches.layers):
        folder.mkdir(parents=True, exist_ok=True)
    point_id = new_checkpoint_id()
    machine.check_alive()
    guest = gueststate.flush(machine.path)  # its files on its disk, for diffs (see gueststate.py)
    with machine.monitor() as mon:
        r = machine.record
        populating = populate_need(mon, machine.disk_dir, r.pid, r.ram) if live and not held else 0
        pending.ensure_room(home, (r.memory_mib << 20) + populating, f"a checkpoint of {machine.name!r}")
        _reconcile_disks(machine, mon, caches.layers)
        r = machine.record
        top = Path(r.disks[-1])
        new_top = machine.new_top()
        # A try's copy waits for the image anyway: it is copied by pages however much was written.
        by_pages = None if r.ram is None or r.pid is None else \
            mapped_memory(r.pid, Path(r.ram), r.memory_mib << 20, None if held else WRITTEN_LIMIT)
        if live and not held and by_pages is None:
            ensure_populated(mon, machine.disk_dir, r.pid, r.memory_mib)
        cap = capture(mon, live=live, top_node=disk_node(len(r.disks) - 1),
                      new_top_file=new_top, new_top_node=disk_node(len(r.disks)),
                      ram_out=caches.ram / f"{point_id}.ram", devstate_out=caches.devstate / point_id,
                      held=held, by_pages=by_pages)
        if held and cap.written is None:  # migrated whole: every page was read
            mark_populated(machine.disk_dir, r.pid)
        changed, mapped = _ram_changed(r, cap.written)
        # The frozen layer leaves the machine's folder (QEMU keeps its open file): a branch
        # may run on it after this machine is gone. Its old name goes only once the record
        # names the new layers: a kill in between leaves the record true.
        frozen = caches.layers / f"{point_id}.qcow2"
        os.link(top, frozen)
        disks = [*r.disks[:-1], str(frozen)]

        def advance(record: MachineRecord) -> None:
            if live:
                record.disks, record.parent = [*disks, str(new_top)], point_id  # QEMU writes to new_top now
            else:  # the restore that stopped it for good must finish (see Handoff)
                record.disks, record.parent = disks, point_id  # new_top is thrown away with its QEMU
                record.handoff = Handoff(point=point_id, parent=r.parent, store=str(store.root),
                                         layer=str(new_top))
        monitor = None
        if not live:
            for forward in r.ports:  # its successor listens on them; this QEMU ends later
                with suppress(PortError):
                    ports.remove(mon, forward)
            # The record says first that this QEMU is handed off: a kill from here on leaves
            # that for the next command to finish (finish_interrupted_restore).
            machine.update(advance)
            if cap.written is None:
                # Its memory is written out later, by its committer, through the QMP socket
                # moved aside: the path is its successor's from now on.
                monitor = handoff_monitor(caches, point_id)
                os.replace(machine.path / QMP_SOCKET, monitor)
        point = PendingCheckpoint(
            id=point_id, seq=time.time_ns(), machine=r.name, machine_uuid=r.uuid, store=str(store.root),
            parent=r.parent, name=name, labels=labels or {}, history=history, created=time.time(),
            meta=PointMeta.of_record(r, cap.pause_s, context, guest).to_json(),
            ram=str(cap.ram), devstate=str(cap.devstate), done=str(cap.done), disks=disks,
            end_qemu=None if live else r.pid, end_layer=None if live else str(new_top),
            monitor=None if monitor is None else str(monitor),
            not_before=time.time() + pending.START_FIRST_S if start_first else 0.0,
            ram_base=None if changed is None else r.ram_point, ram_changed=changed,
            ram_base_file=r.ram if mapped is not None and r.ram_point is None else None,
            ram_base_inode=mapped if r.ram_point is None else None,
            ram_pages=None if cap.written is None or mapped is None else cap.written,
            ram_over=r.ram, ram_over_inode=mapped, ram_over_point=r.ram_point)
        pending.record(home, point)
        if live:
            machine.update(advance)
        top.unlink()
    # The cache is trimmed by committers, off the caller's path: here it cost 0.12-0.27 s
    # per call once the cache was full (every QEMU's mappings are read to see what is in use).
    return point


def _ram_changed(r: MachineRecord, written: list[tuple[int, int]] | None) -> tuple[list[list[int]] | None,
                                                                                 int | None]:
    """Which chunks of its memory may differ from the memory file it maps (a checkpoint's, or
    its template's), and that file's inode; (None, None) if not known. From the pages a
    capture by pages copied, else read after a capture's instant (see pagemap.py)."""
    from rewind.engine.memory import pagemap

    if r.ram is None or r.pid is None:
        return None, None
    try:
        inode = os.stat(r.ram).st_ino
        ranges = pagemap.changed_chunks(r.pid, r.memory_mib << 20, Path(r.ram), RAM_CHUNK_SIZE) \
            if written is None else pagemap.chunks_of(written, RAM_CHUNK_SIZE // pagemap.PAGE)
    except (LookupError, OSError):
        return None, None
    return [[first, last] for first, last in ranges], inode


def _reconcile_disks(machine: Machine, mon: Monitor, layers: Path) -> None:
    """If an interrupted checkpoint already gave the running QEMU a new top layer that the
    record missed, adopt it. Its old top is then a frozen layer, and moves to `layers` as a
    capture's does: copies made later share it, and it must outlive this machine's folder."""
    expected = disk_node(len(machine.record.disks) - 1)
    # From the block graph: `query-block` describes the whole backing chain, nested, and took
    # 2 ms at the first checkpoint of the agent loop and 61 ms at its 80th layer (3.9 ms here).
    graph = mon.cmd("x-debug-query-block-graph")
    names = {n["id"]: n["name"] for n in graph["nodes"]}
    backends = {n["id"] for n in graph["nodes"] if n["type"] == "block-backend"}
    live = next(names[e["child"]] for e in graph["edges"]
                if e["parent"] in backends and names[e["child"]] != RUNTIME_NODE)
    if live == expected:
        return
    if live != disk_node(len(machine.record.disks)):
        raise RewindError(f"machine {machine.name!r}: its disk layers are not what rewind recorded")
    name = _protocol_file(mon, live)
    old_top = Path(machine.record.disks[-1])
    frozen = layers / f"{new_checkpoint_id()}.qcow2"
    os.link(old_top, frozen)

    def adopt(record: MachineRecord) -> None:
        record.disks[-1:] = [str(frozen), name]
    machine.update(adopt)
    old_top.unlink()


def _protocol_file(mon: Monitor, node: str) -> str:
    """The file under qcow2 node `node`, from its protocol child. (The qcow2 node's own name
    is a "json:{...}" that QEMU cuts at 4 KiB on a long chain.)"""
    graph = mon.cmd("x-debug-query-block-graph")
    ids = {n["name"]: n["id"] for n in graph["nodes"] if n["type"] == "block-driver"}
    child = next(e["child"] for e in graph["edges"] if e["parent"] == ids[node] and e["name"] == "file")
    protocol = next(n["name"] for n in graph["nodes"] if n["id"] == child)
    nodes = mon.cmd("query-named-block-nodes", flat=True)
    return next(n["file"] for n in nodes if n["node-name"] == protocol)


# ---- restore ----

def restore(machine: Machine, store: Store, ref: str | Ref, allow_unsigned: bool | None = None) -> Point:
    """Put `machine` back to checkpoint `ref` (`~N` counts back from its last point): same
    name, identity and handle. The state it leaves is checkpointed first. A point not yet
    stored runs from its capture. A stored point must be signed by this home or a key it
    trusts (unsigned ones: `allow_unsigned`, see signers.check_signed)."""
    ref = Ref.of(ref)
    machine.reload()
    finish_interrupted_restore(machine)
    if ref.counts_from_caller and machine.record.parent is None:
        raise NotFound(f"machine {machine.name!r} has no checkpoint yet to count back from")
    target = locate(machine.home, store, ref, machine.record.parent if ref.counts_from_caller else None)
    target.check_signed(machine.home, store, "restore", allow_unsigned)  # before it is left
    meta = PointMeta.from_json(target.point.id, target.point.meta)
    qemu_build().check_board(meta.board, f"checkpoint {target.point.id[:12]}")  # before it is left
    if (meta.memory_mib, meta.cpus) != (machine.record.memory_mib, machine.record.cpus):
        raise InvalidArgument(f"checkpoint {target.point.id[:12]} is of a {meta.memory_mib} MiB, "
                              f"{meta.cpus}-vCPU machine; restore it as a new machine")
    with machine.locked():
        machine.reload()
        # A stored point's files come first: if they cannot be had, the machine is left as it
        # was. The next QEMU asks for them again (a look at the cache) when it starts.
        if target.point.own_bytes is not None:
            target.state()
        running = machine.status() == "running"
        # The next QEMU starts on a thread meanwhile (see NextQemu). A point not yet stored is
        # waited for there: if this QEMU is still writing it out, it does so with its guest
        # stopped, sooner (no vCPU competes, no page is copied on write).
        nxt = machine.next_qemu(target.state, background=running)
        left = None
        if running:
            # The state it leaves is captured with its guest stopped; that QEMU writes its memory
            # out and is ended in the background, once the new one has started in its place.
            try:
                left = _capture_locked(machine, store, None, {"auto": "before-restore"}, live=False,
                                       start_first=True)
            except BaseException:
                nxt.discard()
                raise
        try:
            run_state(machine, target.point.id, nxt)
        except BaseException:
            if left is not None:  # the machine runs on from the state it was in; the error stands
                found = locate(machine.home, store, left.id)
                run_state(machine, left.id, machine.next_qemu(found.state))
            raise
    return target.point


# ---- new machines from points ----

def create_from(engine: Engine, store: Store, ref: str | CheckpointManifest, name: str | None = None,
                labels: dict[str, str] | None = None, at: str | None = None,
                network: NetworkRules | None = None, allow_unsigned: bool | None = None) -> Machine:
    """A new machine running from checkpoint `ref` (or `at`, such as `~2`, counted back from
    it). It shares the checkpoint's memory and disk read-only and gets its own identity. A
    stored point must be signed by this home or a key it trusts (see restore)."""
    if name is not None:
        validate_name(name)
    found: Located = engine.find_point(store, ref)
    if at is not None:
        found = engine.find_point(store, at, relative_to=found.point.id)
    found.check_signed(engine.home, store, "run", allow_unsigned)
    point = found.point
    meta = PointMeta.from_json(point.id, point.meta)  # before any file is made from it
    return _run_point(engine, name, point.id, point.machine, meta, found.state, labels, network)


def fork(engine: Engine, source: Machine, store: Store, names: list[str | None],
         labels: dict[str, str] | None = None, network: NetworkRules | None = None,
         hold_source: bool = False) -> list[Machine]:
    """Live copies of `source` from this moment, one per name (None: a generated name). The
    source pauses only to be captured once; the copies share that point. `hold_source`: it
    stays paused until its memory is written, which brings the copies sooner (see
    snapshot.capture), for a caller that waits on them."""
    for name in names:
        if name is not None:
            validate_name(name)
    point = checkpoint(source, store, labels={"auto": "fork"}, start_first=True, held=hold_source)
    # The copies start from its files (the source's memory file and the pages it wrote, for a
    # capture by pages); storing it goes on meanwhile.
    state = point.overlay_state()
    if state is None:
        point.wait_written()
        state = point.state
    meta = PointMeta.from_json(point.id, point.meta)
    return [_run_point(engine, name, point.id, point.machine, meta, lambda: state, labels, network,
                       forked_from=source.name) for name in names]


def _run_point(engine: Engine, name: str | None, point_id: str, machine: str, meta: PointMeta,
               state_of: Callable[[], SavedState], labels: dict[str, str] | None,
               network: NetworkRules | None, **extra: str) -> Machine:
    """A new machine running a saved point of `machine`."""
    qemu_build().check_board(meta.board, f"checkpoint {point_id[:12]}")
    image = engine.point_image(meta.image_id, meta.image_base)
    if image.id != meta.image_id:
        extra = {**extra, "image": meta.image_id}  # not on this host: run on its base
    return engine.new_machine(
        name, memory_mib=meta.memory_mib, cpus=meta.cpus, labels=labels, image_id=image.id,
        accel=meta.accel, disk_size_mib=meta.disk_size_mib, parent=point_id, state_of=state_of,
        network=network if network is not None else meta.rules(),
        extra={"from_checkpoint": point_id, "from_machine": machine, **extra},
        exec_defaults=meta.exec, image_base=meta.image_base, image_digest=meta.image_digest)
