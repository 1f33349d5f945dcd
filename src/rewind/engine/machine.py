"""Machines: create from the booted template, run commands through the agent, stop, delete.

A machine is a directory under $REWIND_HOME/machines/NAME holding its record
(machine.json), its disk overlay, QEMU's sockets, PID file and logs. Its
status is derived, never trusted: a machine recorded as running whose QEMU
is gone is reported dead.

Locking: lifecycle changes (start, stop, delete) hold the machine's lock
exclusively; agent sessions hold it shared plus one of the agent ports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.engine import gueststate, netfilter
from rewind.engine.agent import AgentClient
from rewind.engine.locks import any_free_lock, file_lock
from rewind.engine.memfiles import blank_layer, private_runtime
from rewind.engine.netrules import NetworkRules
from rewind.engine.qemu import (
    AGENT_PORTS,
    QMP_SOCKET,
    QMP_WARM_SOCKET,
    VmSpec,
    agent_socket,
    disk_node,
    kill,
    launch,
    process_alive,
    wait_exit,
)
from rewind.engine.qmp import Monitor, MonitorError
from rewind.errors import (
    AlreadyExists,
    Busy,
    ImageError,
    InvalidArgument,
    MachineDied,
    MachineNotRunning,
    NotFound,
    RewindError,
)
from rewind.home import Home
from rewind.store.durable import replace_durably
from rewind.store.errors import BadRef, CheckpointExists, UnknownCheckpoint
from rewind.store.model import DEFAULT_HISTORY, is_int, validate_checkpoint_name

# What only creating, checkpointing and restoring use is imported where it is used: a
# command that runs something in a machine (`rewind exec`) then starts in 0.13 s, not 0.3.
if TYPE_CHECKING:
    from rewind.engine.accel import AccelChoice
    from rewind.engine.pending import PendingCheckpoint
    from rewind.engine.points import Located, Point
    from rewind.engine.snapshot import SavedState
    from rewind.engine.template import Template
    from rewind.image import Image
    from rewind.store import CheckpointManifest, Store

DEFAULT_MEMORY_MIB = 512
DEFAULT_CPUS = 2
MIN_MEMORY_MIB = 192  # below this the guest's kernel and agent do not fit
MAX_CPUS = 64
MAX_DISK_MIB = 16 << 20  # 16 TiB
LOCK_TIMEOUT = float(os.environ.get("REWIND_LOCK_TIMEOUT", "30"))
RECORD = "machine.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

Report = Callable[[str], None]
log = logging.getLogger("rewind")


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("machine name is empty")
    if len(name) > 63:
        raise InvalidArgument(f"machine name is {len(name)} characters long; the limit is 63")
    if "/" in name or ".." in name or not _NAME.fullmatch(name):
        raise InvalidArgument(f"invalid machine name {name!r}: use letters, digits, '-', '_' and '.', "
                              "starting with a letter or digit")
    return name


def parse_labels(labels: dict[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in (labels or {}).items():
        if not isinstance(key, str) or not _NAME.fullmatch(key) or len(key) > 63:
            raise InvalidArgument(f"invalid label key {key!r}")
        if not isinstance(value, str) or len(value) > 256 or "\n" in value:
            raise InvalidArgument(f"invalid value for label {key!r}")
        out[key] = value
    return out


def _names_a_checkpoint(store: Store, name: str) -> bool:
    try:
        store.get(name)
    except (UnknownCheckpoint, BadRef):  # BadRef: a name such as "c0" also reads as a short id
        return False
    return True


def _report_lost(messages: list[str]) -> None:
    """Points that could never be stored (the host restarted before): said once, then forgotten."""
    for message in messages:
        log.warning(message)


def _trim_images(home: Home) -> None:
    """Drop memory images no machine or checkpoint needs any more (see pending.trim_images)."""
    from rewind.engine import pending

    pending.trim_images(home)


def _hostname(name: str) -> str:
    host = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    return host[:63] or "rewind"


def _new_mac() -> str:
    # 52:54:00 is QEMU's prefix; the next octet keeps it locally administered and unicast.
    return "52:54:00:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(3))


@dataclass
class MachineRecord:
    """What is persisted about a machine (machine.json)."""

    name: str
    uuid: str
    memory_mib: int
    cpus: int
    labels: dict[str, str]
    image_id: str
    hostname: str
    machine_id: str
    mac: str
    vmgenid: str
    created: float
    state: str = "creating"  # creating | running | stopped
    pid: int | None = None
    accel: str = "tcg"
    disk_size_mib: int = 0
    disks: list[str] = field(default_factory=list)  # the disk's layers, base first, writable top last
    parent: str | None = None  # the checkpoint this machine was last saved to or restored from
    extra: dict = field(default_factory=dict)  # where it came from (checkpoint, machine it forked from)
    ram: str | None = None  # the memory file its QEMU maps
    ram_point: str | None = None  # the checkpoint whose memory that file is (None: a template's)
    network: dict = field(default_factory=lambda: NetworkRules().to_json())  # NetworkRules, as JSON

    @classmethod
    def from_json(cls, data: dict) -> MachineRecord:
        """A record as saved; fields this version no longer keeps are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class MachineInfo:
    """A machine as `rewind ls` shows it."""

    name: str
    status: str  # running | stopped | dead | creating
    memory_mib: int
    cpus: int
    labels: dict[str, str]
    hostname: str
    pid: int | None
    created: float
    accel: str


class Machine:
    """One machine on this host. Obtain through Engine."""

    def __init__(self, engine: Engine, path: Path, record: MachineRecord) -> None:
        self.engine = engine
        self.path = path
        self.record = record

    @property
    def name(self) -> str:
        return self.record.name

    def reload(self) -> None:
        try:
            self.record = MachineRecord.from_json(json.loads((self.path / RECORD).read_text()))
        except FileNotFoundError as e:
            raise NotFound(f"machine {self.name!r} no longer exists") from e

    def _save(self) -> None:
        """Write the record; the caller holds the machine lock exclusively (else see _update)."""
        replace_durably(self.path / RECORD, json.dumps(asdict(self.record), indent=2).encode())

    def _update(self, change: Callable[[MachineRecord], None]) -> None:
        """Reload the record, change it and save it under the record lock: for commands that
        hold the machine lock shared (a checkpoint, new network rules), which would otherwise
        undo each other's changes."""
        with file_lock(self.path / "record.lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            change(self.record)
            self._save()

    # ---- status ----

    def status(self) -> str:
        if self.record.state == "running":
            alive = self.record.pid is not None and process_alive(self.record.pid, self.record.uuid)
            return "running" if alive else "dead"
        return self.record.state

    def info(self) -> MachineInfo:
        r = self.record
        return MachineInfo(name=r.name, status=self.status(), memory_mib=r.memory_mib, cpus=r.cpus,
                           labels=dict(r.labels), hostname=r.hostname, pid=r.pid, created=r.created,
                           accel=r.accel)

    def check_alive(self) -> None:
        """Raise MachineDied/MachineNotRunning unless the machine's QEMU is running."""
        status = self.status()
        if status == "dead":
            raise MachineDied(f"machine {self.name!r} is dead: its QEMU exited unexpectedly "
                              f"(see {self.path / 'console.log'}); `rewind rm {self.name}` removes it")
        if status != "running":
            raise MachineNotRunning(f"machine {self.name!r} is {status}; start it with "
                                    f"`rewind start {self.name}`")

    def _agent_silent(self) -> None:
        """What an agent session checks when the guest does not answer: that QEMU runs, and
        that the guest is not left paused by a checkpoint whose caller died between stopping
        it and starting the capture (then it is resumed, unless a checkpoint is under way)."""
        self.check_alive()
        try:
            with file_lock(self.path / "checkpoint.lock", timeout=0, what=f"machine {self.name!r}"), \
                    self.monitor() as mon:
                if mon.cmd("query-status").get("status") == "paused" and \
                        mon.cmd("query-migrate").get("status") not in ("setup", "active"):
                    mon.cmd("cont")
        except (Busy, MonitorError):
            pass

    # ---- sessions ----

    @contextmanager
    def agent(self, connect_timeout: float = 30.0) -> Iterator[AgentClient]:
        """A session with the guest agent, on the first free agent port."""
        what = f"machine {self.name!r}"
        with file_lock(self.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=what):
            self.reload()  # another handle may have restored it: a new QEMU
            self.check_alive()
            ports = [self.path / f"port-{i}.lock" for i in range(AGENT_PORTS)]
            with any_free_lock(ports, timeout=LOCK_TIMEOUT, what=what) as port, \
                    AgentClient(self.path / agent_socket(port), alive=self._agent_silent,
                                connect_timeout=connect_timeout) as client:
                yield client

    def monitor(self) -> Monitor:
        return Monitor(self.path / QMP_SOCKET)

    # ---- lifecycle ----

    def _spec(self, ram: Path | None, incoming: bool) -> VmSpec:
        r = self.record
        image = self.engine.image(r.image_id)
        return VmSpec(tag=r.uuid, memory_mib=r.memory_mib, cpus=r.cpus, accel=r.accel,
                      kernel=image.kernel, initrd=image.initrd, disks=[Path(d) for d in r.disks],
                      ram_file=ram, ram_shared=False, mac=r.mac, vmgenid=r.vmgenid, incoming=incoming)

    @property
    def disk_dir(self) -> Path:
        """Where its writable disk layers live: named by its UUID, not its name, because QEMU
        reopens a layer by the path it was given (a renamed machine keeps its QEMU)."""
        return self.engine.home.root / "disks" / self.record.uuid

    def _new_top(self) -> Path:
        """A new, empty top layer for the disk, over the current chain's top."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        top = self.disk_dir / f"disk-{secrets.token_hex(4)}.qcow2"
        shutil.copyfile(blank_layer(self.engine.home.runtime, self.record.disk_size_mib), top)
        return top

    def set_labels(self, changes: dict[str, str | None]) -> dict[str, str]:
        """Add or change labels (a None value removes one); the labels it has now."""
        if not isinstance(changes, dict):
            raise InvalidArgument("labels must be a mapping of KEY to VALUE (None removes KEY)")
        removed = [key for key, value in changes.items() if value is None]
        added = parse_labels({key: value for key, value in changes.items() if value is not None})

        def change(record: MachineRecord) -> None:
            record.labels = {k: v for k, v in {**record.labels, **added}.items() if k not in removed}
        with file_lock(self.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self._update(change)
        return dict(self.record.labels)

    @property
    def network(self) -> NetworkRules:
        return NetworkRules.from_json(self.record.network)

    def set_network(self, rules: NetworkRules) -> None:
        """Apply new network rules now (if running) and from every later start."""
        with file_lock(self.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self._update(lambda r: setattr(r, "network", rules.to_json()))
            if self.status() == "running":
                netfilter.update(self.path, rules)

    def network_attempts(self) -> list[str]:
        """What it tried to reach and its network rules refused, since its QEMU started (see
        netfilter.attempts)."""
        self.check_alive()
        return netfilter.attempts(self.path)

    @contextmanager
    def _launching(self, spec: VmSpec) -> Iterator[None]:
        """Start QEMU and, alongside it, the filter that enforces its network rules. The block
        gets the guest going while the filter starts (until it connects, the guest's frames
        go nowhere); the filter must be ready by the block's end."""
        r = self.record
        r.pid = None
        filter_proc = netfilter.spawn(self.path, r.uuid, self.network)
        try:
            r.pid = launch(spec, self.path)
            yield
            netfilter.wait_ready(filter_proc, self.path)
        except BaseException:
            if r.pid is not None:
                kill(r.pid, r.uuid)
            filter_proc.kill()
            filter_proc.wait()
            netfilter.stop(self.path, r.uuid)
            raise

    def _start_from_state(self, state: SavedState) -> None:
        """Run a saved state in a new QEMU: its memory file mapped copy-on-write, its
        device state loaded, its disk layers below a new top layer of this machine's;
        then give the guest this machine's identity."""
        self.record.disks = [str(d) for d in state.disks]
        self.record.disks.append(str(self._new_top()))
        self.record.ram, self.record.ram_point = str(state.ram), state.point
        with self._launching(self._spec(state.ram, incoming=True)), self.monitor() as mon:
            mon.cmd("migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}])
            mon.cmd("migrate-incoming", uri=f"exec:cat {shlex.quote(str(state.devstate))}")
            mon.wait_migration()
            mon.cmd("cont")
            self._apply_identity(connect_timeout=30)

    def _boot(self, report: Report) -> None:
        """Cold boot from this machine's own disk (a stopped machine), then give it its identity."""
        from rewind.engine.template import BOOT_TIMEOUT

        report(f"booting {self.name} from its disk")
        with self._launching(self._spec(None, incoming=False)):
            self._apply_identity(connect_timeout=BOOT_TIMEOUT)

    def _check_starting(self) -> None:
        """check_alive for a machine still being started (its record is not yet 'running')."""
        r = self.record
        if r.pid is None or not process_alive(r.pid, r.uuid):
            raise MachineDied(f"machine {r.name!r}: QEMU exited while starting "
                              f"(see {self.path / 'console.log'})")

    def _apply_identity(self, connect_timeout: float) -> None:
        r = self.record
        with AgentClient(self.path / agent_socket(0), alive=self._check_starting,
                         connect_timeout=connect_timeout) as client:
            client.set_identity(hostname=r.hostname, machine_id=r.machine_id, mac=r.mac,
                                seed=secrets.token_hex(32), time=time.time())

    def _grow_disk(self, disk_mib: int) -> None:
        """Grow the virtual disk (the guest sees the new size at once) and its file system."""
        with self.monitor() as mon:
            mon.cmd("block_resize", **{"node-name": disk_node(len(self.record.disks) - 1),
                                       "size": disk_mib << 20})
        with AgentClient(self.path / agent_socket(0), alive=self._check_starting) as client:
            result = client.exec(["resize2fs", "/dev/vda"], timeout=120)
        if result.exit_code != 0:
            raise RewindError(f"could not grow the root file system: {result.stderr.strip()}")

    def start(self, report: Report = lambda _: None) -> None:
        """Start a stopped machine (cold boot from its disk)."""
        with file_lock(self.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            if self.status() == "running":
                return
            self._boot(report)
            self.record.state = "running"
            self._save()

    def stop(self) -> None:
        """Flush the guest's disk and end its QEMU. Files survive; processes do not."""
        self._settle_before_ending()
        with file_lock(self.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            if self.status() == "running":
                self._shutdown()
            self._cleanup_runtime()
            self.record.state = "stopped"
            self.record.pid = None
            self._save()
        _trim_images(self.engine.home)

    def _shutdown(self) -> None:
        r = self.record
        assert r.pid is not None
        try:
            with AgentClient(self.path / agent_socket(0), connect_timeout=5) as client:
                client.exec(["sync"], timeout=30)
        except RewindError:
            pass  # a guest whose agent is gone cannot flush; its disk is as the guest left it
        try:
            with self.monitor() as mon:
                mon.quit()
        except MonitorError:
            pass
        if not wait_exit(r.pid, r.uuid, 10):
            kill(r.pid, r.uuid)

    def _cleanup_runtime(self) -> None:
        netfilter.stop(self.path, self.record.uuid)
        for name in (QMP_SOCKET, QMP_WARM_SOCKET, "qemu.pid", *(agent_socket(i) for i in range(AGENT_PORTS))):
            (self.path / name).unlink(missing_ok=True)

    # ---- checkpoints ----

    def checkpoint(self, store: Store, name: str | None = None, labels: dict[str, str] | None = None,
                   history: int = DEFAULT_HISTORY, live: bool = True, start_first: bool = False,
                   held: bool = False, context: str | None = None) -> PendingCheckpoint:
        """Save memory, devices and disk as of one instant into `store`; the machine runs on,
        unless not `live`: then its guest is stopped for good, and its QEMU is ended once it
        has written the memory out (the caller starts another in its place). `start_first`:
        a machine is about to start from it or in its place; its commit waits a moment.
        `held`: the guest stays stopped until its memory is written (see snapshot.capture).
        `context`, the caller's own state, is kept in the point's meta as given.

        Returns once the moment is captured; QEMU writing memory out and the commit into the
        store go on in the background (pending.py): `settle` waits for them."""
        from rewind.engine import pending

        if name is not None:
            validate_checkpoint_name(name)
            if name in pending.pending_names(self.engine.home) or _names_a_checkpoint(store, name):
                raise CheckpointExists(f"checkpoint name {name!r} is taken")
        # Shared, as a session's: a restore, stop or delete (exclusive) waits for the capture.
        with file_lock(self.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            return self._capture_point(store, name, labels, history, live, start_first, held, context)

    def _capture_point(self, store: Store, name: str | None, labels: dict[str, str] | None,
                       history: int = DEFAULT_HISTORY, live: bool = True, start_first: bool = False,
                       held: bool = False, context: str | None = None) -> PendingCheckpoint:
        """checkpoint(), for a caller holding the machine lock."""
        try:
            with file_lock(self.path / "checkpoint.lock", timeout=0, what=f"machine {self.name!r}"):
                self.reload()
                return self._checkpoint(store, name, labels, history, live, start_first, held, context)
        except Busy as e:
            raise Busy(f"a checkpoint of machine {self.name!r} is already running") from e

    def _checkpoint(self, store: Store, name: str | None, labels: dict[str, str] | None,
                    history: int, live: bool, start_first: bool, held: bool,
                    context: str | None) -> PendingCheckpoint:
        from rewind.engine import pending
        from rewind.engine.checkpoint import Caches
        from rewind.engine.pending import PendingCheckpoint
        from rewind.engine.snapshot import capture, ensure_populated
        from rewind.store import new_checkpoint_id

        home = self.engine.home
        caches = Caches.of(home.root, private_runtime(home.runtime))
        for folder in (caches.ram, caches.devstate, caches.layers):
            folder.mkdir(parents=True, exist_ok=True)
        point_id = new_checkpoint_id()
        self.check_alive()
        pending.ensure_room(home, self.record.memory_mib << 20, f"a checkpoint of {self.name!r}")
        guest = gueststate.flush(self.path)  # its files on its disk, for diffs (see gueststate.py)
        with self.monitor() as mon:
            r = self.record
            self._reconcile_disks(mon)
            top = Path(r.disks[-1])
            new_top = self._new_top()
            if live and not held:
                ensure_populated(mon, self.disk_dir, r.pid, r.memory_mib)
            cap = capture(mon, live=live, top_node=disk_node(len(r.disks) - 1),
                          new_top_file=new_top, new_top_node=disk_node(len(r.disks)),
                          ram_out=caches.ram / f"{point_id}.ram", devstate_out=caches.devstate / point_id,
                          held=held)
            changed = self._ram_changed()
            monitor = None
            if not live:
                # Its memory is written out later, by its committer, through the QMP socket
                # moved aside: the path is its successor's from now on.
                monitor = caches.devstate / f"{point_id}.qmp"
                os.replace(self.path / QMP_SOCKET, monitor)
            # The frozen layer leaves this machine's folder (QEMU keeps its open file): a
            # branch may run on it after this machine is gone. Its old name goes only once the
            # record names the new layers: a kill in between leaves the record true.
            frozen = caches.layers / f"{point_id}.qcow2"
            os.link(top, frozen)
            disks = [*r.disks[:-1], str(frozen)]
            point = PendingCheckpoint(
                id=point_id, seq=time.time_ns(), machine=r.name, machine_uuid=r.uuid, store=str(store.root),
                parent=r.parent, name=name, labels=labels or {}, history=history, created=time.time(),
                meta={"memory_mib": r.memory_mib, "cpus": r.cpus, "accel": r.accel, "image_id": r.image_id,
                      "disk_size_mib": r.disk_size_mib, "hostname": r.hostname, "machine_id": r.machine_id,
                      "mac": r.mac, "network": r.network, "pause_s": cap.pause_s,
                      "guest": guest, "machine_labels": dict(r.labels),
                      **({} if context is None else {"context": context})},
                ram=str(cap.ram), devstate=str(cap.devstate), done=str(cap.done), disks=disks,
                end_qemu=None if live else r.pid, end_layer=None if live else str(new_top),
                monitor=None if monitor is None else str(monitor),
                not_before=time.time() + pending.START_FIRST_S if start_first else 0.0,
                ram_base=None if changed is None else r.ram_point, ram_changed=changed)
            pending.record(home, point)

            def advance(record: MachineRecord) -> None:
                record.disks, record.parent = [*disks, str(new_top)], point_id  # QEMU writes to new_top now
            self._update(advance)
            top.unlink()
        # The cache is trimmed by committers, off the caller's path: here it cost 0.12-0.27 s
        # per call once the cache was full (every QEMU's mappings are read to see what is in use).
        return point

    def _ram_changed(self) -> list[list[int]] | None:
        """Which chunks of its memory may differ from its memory file's checkpoint, read after a
        capture's instant (see pagemap.py); None if that is not known (a template's file)."""
        from rewind.engine import pagemap
        from rewind.engine.checkpoint import RAM_CHUNK_SIZE

        r = self.record
        if r.ram_point is None or r.ram is None or r.pid is None:
            return None
        try:
            ranges = pagemap.changed_chunks(r.pid, r.memory_mib << 20, Path(r.ram), RAM_CHUNK_SIZE)
        except (LookupError, OSError):
            return None
        return [[first, last] for first, last in ranges]

    def warm(self) -> None:
        """Prepare this machine's QEMU for its next checkpoint, in the background (see
        snapshot.start_warming): for machines that will be checkpointed soon."""
        from rewind.engine.snapshot import start_warming

        start_warming(self.path, self.disk_dir, self.record.pid, self.record.memory_mib)

    def settle(self) -> None:
        """Return once this machine's checkpoints are all in the store."""
        from rewind.engine import pending

        _report_lost(pending.settle(self.engine.home, self.record.uuid))

    def _reconcile_disks(self, mon: Monitor) -> None:
        """If an interrupted checkpoint already gave the running QEMU a new top layer that the
        record missed, adopt it (its old top is then a plain frozen layer)."""
        expected = disk_node(len(self.record.disks) - 1)
        live = next(d["inserted"]["node-name"] for d in mon.cmd("query-block") if "inserted" in d)
        if live == expected:
            return
        if live != disk_node(len(self.record.disks)):
            raise RewindError(f"machine {self.name!r}: its disk layers are not what rewind recorded")
        node = next(n for n in mon.cmd("query-named-block-nodes", flat=True) if n["node-name"] == live)
        name = node["image"]["filename"]
        if name.startswith("json:"):  # QEMU's name for a layer with an explicit backing node
            name = json.loads(name[len("json:"):])["file"]["filename"]
        self.record.disks.append(name)
        self._save()

    def restore(self, store: Store, ref: str) -> Point:
        """Put this machine back to checkpoint `ref` (`~N` counts back from its last point):
        same name, identity and handle. The state it leaves is checkpointed first. A point
        not yet stored runs from its capture here."""
        self.reload()
        if ref.startswith("~") and self.record.parent is None:
            raise NotFound(f"machine {self.name!r} has no checkpoint yet to count back from")
        target = self.engine.find_point(store, ref, self.record.parent if ref.startswith("~") else None)
        meta = target.point.meta
        if (meta.get("memory_mib"), meta.get("cpus")) != (self.record.memory_mib, self.record.cpus):
            raise InvalidArgument(f"checkpoint {target.point.id[:12]} is of a {meta.get('memory_mib')} MiB, "
                                  f"{meta.get('cpus')}-vCPU machine; restore it as a new machine")
        state = target.state()
        with file_lock(self.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            if self.status() == "running":
                # The state it leaves is captured with its guest stopped; that QEMU writes its memory
                # out and is ended in the background, once the new one has started in its place.
                self._capture_point(store, None, {"auto": "before-restore"}, live=False, start_first=True)
            self._cleanup_runtime()
            r = self.record
            r.vmgenid = str(uuid.uuid4())  # a new generation: the guest reseeds its randomness
            self._start_from_state(state)
            r.state, r.parent = "running", target.point.id
            self._save()
            self.warm()
        return target.point

    def _settle_before_ending(self) -> None:
        """Before its QEMU ends, let it finish writing out the memory of its checkpoints (a
        capture is lost if its QEMU ends first); storing them goes on without it, and their
        committers end the QEMUs its restores left."""
        from rewind.engine import pending

        home = self.engine.home
        for point in pending.captured(home):
            if point.machine_uuid == self.record.uuid and point.end_qemu is None:
                with contextlib.suppress(RewindError):
                    pending.wait_captured(home, point)

    def delete(self) -> None:
        self._settle_before_ending()
        with file_lock(self.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            if self.record.pid is not None and process_alive(self.record.pid, self.record.uuid):
                try:
                    with self.monitor() as mon:
                        mon.quit()
                except MonitorError:
                    pass
                if not wait_exit(self.record.pid, self.record.uuid, 5):
                    kill(self.record.pid, self.record.uuid)
            netfilter.stop(self.path, self.record.uuid)
            shutil.rmtree(self.disk_dir, ignore_errors=True)
            shutil.rmtree(self.path)
        _trim_images(self.engine.home)


class Engine:
    """Machines under one $REWIND_HOME."""

    def __init__(self, home: Home | None = None) -> None:
        self.home = home or Home.from_env()
        self._accel: AccelChoice | None = None

    def image(self, image_id: str | None = None) -> Image:
        """An image by id, or the default one."""
        from rewind.image import find_image

        return find_image(self.home.images, image_id)

    def accel(self) -> AccelChoice:
        from rewind.engine.accel import choose_accel

        if self._accel is None:
            try:
                default: Image | None = self.image()
            except ImageError:
                default = None  # only imported images here
            self._accel = choose_accel(self.home.images, default)
        return self._accel

    def template(self, memory_mib: int, cpus: int, image: Image | None = None,
                 report: Report = lambda _: None) -> Template:
        from rewind.engine.template import ensure_template

        return ensure_template(image or self.image(), self.accel().accel, memory_mib, cpus, report)

    def _path(self, name: str) -> Path:
        return self.home.machines / validate_name(name)

    def get(self, name: str) -> Machine:
        path = self._path(name)
        try:
            record = MachineRecord.from_json(json.loads((path / RECORD).read_text()))
        except FileNotFoundError as e:
            raise NotFound(f"no machine named {name!r}") from e
        except (ValueError, TypeError) as e:
            raise RewindError(f"machine {name!r} has a damaged record ({e}); remove {path}") from e
        return Machine(self, path, record)

    def list(self, labels: dict[str, str] | None = None) -> list[Machine]:
        if not self.home.machines.is_dir():
            return []
        found = []
        for path in sorted(self.home.machines.iterdir()):
            if path.name.startswith(".") or not (path / RECORD).is_file():
                continue
            try:
                machine = self.get(path.name)
            except (NotFound, RewindError):
                continue
            if all(machine.record.labels.get(k) == v for k, v in (labels or {}).items()):
                found.append(machine)
        return found

    def create(self, name: str | None = None, *, memory_mib: int = DEFAULT_MEMORY_MIB,
               cpus: int = DEFAULT_CPUS, disk_mib: int = 0, labels: dict[str, str] | None = None,
               image: str | None = None, network: NetworkRules | None = None,
               report: Report = lambda _: None) -> Machine:
        """Create and start a machine from the booted template. Nothing is left behind on failure."""
        from rewind.engine.template import template_state

        if not isinstance(memory_mib, int) or memory_mib < MIN_MEMORY_MIB:
            raise InvalidArgument(f"memory must be at least {MIN_MEMORY_MIB} MiB (got {memory_mib})")
        if not isinstance(cpus, int) or not 1 <= cpus <= MAX_CPUS:
            raise InvalidArgument(f"cpus must be between 1 and {MAX_CPUS} (got {cpus})")
        labels = parse_labels(labels)
        chosen = self.image(image)
        base_mib = chosen.disk_size_mib
        if not isinstance(disk_mib, int) or (disk_mib and disk_mib < base_mib):
            raise InvalidArgument(f"disk must be at least the image's {base_mib} MiB (got {disk_mib})")
        if name is not None:
            validate_name(name)
        template = self.template(memory_mib, cpus, chosen, report)
        machine = self._new(name, memory_mib=memory_mib, cpus=cpus, labels=labels, image_id=chosen.id,
                            accel=template.accel, disk_size_mib=base_mib, parent=None,
                            state=template_state(template, self.home.runtime, chosen), network=network)
        if disk_mib > base_mib:
            with self._undo_on_failure(machine):
                machine._grow_disk(disk_mib)
                machine.record.disk_size_mib = disk_mib
                machine._save()
        return machine

    def create_from(self, store: Store, ref: str | CheckpointManifest, name: str | None = None,
                    labels: dict[str, str] | None = None, at: str | None = None,
                    network: NetworkRules | None = None) -> Machine:
        """A new machine running from checkpoint `ref` (or `at`, such as `~2`, counted back from
        it). It shares the checkpoint's memory and disk read-only and gets its own identity."""
        if name is not None:
            validate_name(name)
        found = self.find_point(store, ref)
        if at is not None:
            found = self.find_point(store, at, relative_to=found.point.id)
        point = found.point
        self._check_shape(point.id, point.meta)  # before any file is made from it
        return self._run_point(name, point.id, point.machine, point.meta, found.state(), labels, network)

    def find_point(self, store: Store, ref: str | CheckpointManifest,
                   relative_to: str | None = None) -> Located:
        """The point `ref` names, stored or still being stored here (see points.py)."""
        from rewind.engine.points import locate

        return locate(self.home, store, ref, relative_to)

    def fork(self, source: Machine, store: Store, names: list[str | None],
             labels: dict[str, str] | None = None, network: NetworkRules | None = None,
             hold_source: bool = False) -> list[Machine]:
        """Live copies of `source` from this moment, one per name (None: a generated name).
        The source pauses only to be captured once; the copies share that point.
        `hold_source`: it stays paused until its memory is written, which brings the copies
        sooner (see snapshot.capture), for a caller that waits on them."""
        for name in names:
            if name is not None:
                validate_name(name)
        point = source.checkpoint(store, labels={"auto": "fork"}, start_first=True, held=hold_source)
        point.wait_written()  # the copies start from its files; storing it goes on meanwhile
        return [self._run_point(name, point.id, point.machine, point.meta, point.state, labels, network,
                                forked_from=source.name) for name in names]

    def _run_point(self, name: str | None, point_id: str, machine: str, meta: dict, state: SavedState,
                   labels: dict[str, str] | None, network: NetworkRules | None, **extra: str) -> Machine:
        """A new machine running a saved point, whose meta says what machine it was. A point
        imported from a file brings no network rules of its own: without `network`, its
        machine starts offline (a file must not grant itself the internet or the host)."""
        if network is None:
            network = NetworkRules(internet=False) if meta.get("imported") \
                else NetworkRules.from_json(meta.get("network", {}))
        return self._new(name, memory_mib=meta["memory_mib"], cpus=meta["cpus"], labels=parse_labels(labels),
                         image_id=meta["image_id"], accel=meta["accel"], disk_size_mib=meta["disk_size_mib"],
                         parent=point_id, state=state, network=network,
                         extra={"from_checkpoint": point_id, "from_machine": machine, **extra})

    def _check_shape(self, point_id: str, meta: dict) -> None:
        """Check the machine a point's meta describes before its values become QEMU options
        and file names: the point may come from an imported file."""
        from rewind.engine.accel import ACCELS

        memory, cpus, disk, accel = (meta.get(k) for k in ("memory_mib", "cpus", "disk_size_mib", "accel"))
        host_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        problems = [what for what, ok in (
            ("memory", is_int(memory) and MIN_MEMORY_MIB <= memory <= host_mib),
            ("vCPUs", is_int(cpus) and 1 <= cpus <= MAX_CPUS),
            ("disk size", is_int(disk) and 0 < disk <= MAX_DISK_MIB),
            ("accelerator", accel in ACCELS)) if not ok]
        if problems:
            raise InvalidArgument(f"checkpoint {point_id[:12]} describes a machine rewind cannot run: "
                                  f"bad {', '.join(problems)}")
        self.image(meta.get("image_id") if isinstance(meta.get("image_id"), str) else "")

    def settle(self) -> None:
        """Return once every machine's checkpoints are all in their stores (see pending.py)."""
        from rewind.engine import pending

        _report_lost(pending.settle(self.home))

    def replace(self, original: Machine, successor: Machine) -> None:
        """`successor`, a running copy of `original`, takes over its name, identity, labels and
        network rules, and `original` is deleted. Both directories are swapped by rename, so
        at every moment one machine holds the name; on failure everything is put back. Disk
        layers live outside the directories (disk_dir), so QEMU's paths stay true."""
        retired = self.home.machines / f".retired-{original.name}-{secrets.token_hex(4)}"
        name = original.name
        with file_lock(self.home.machines / ".lock", timeout=LOCK_TIMEOUT, what="the machine list"), \
                file_lock(original.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {name!r}"), \
                file_lock(successor.path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {successor.name!r}"):
            original.reload()
            successor.reload()
            successor.check_alive()
            before = MachineRecord(**asdict(successor.record))
            home_dir, own_dir = original.path, successor.path
            os.rename(home_dir, retired)
            os.rename(own_dir, home_dir)
            try:
                successor.path = home_dir
                r, o = successor.record, original.record
                r.name, r.labels, r.network = o.name, dict(o.labels), dict(o.network)
                r.hostname, r.machine_id, r.mac, r.created = o.hostname, o.machine_id, o.mac, o.created
                r.extra["replaced"] = {"machine": o.uuid, "by": before.name, "at": time.time()}
                with AgentClient(home_dir / agent_socket(0), alive=successor.check_alive) as agent:
                    agent.set_identity(hostname=r.hostname, machine_id=r.machine_id, mac=r.mac)
                netfilter.update(home_dir, successor.network)
                successor._save()
            except BaseException:
                os.rename(home_dir, own_dir)
                os.rename(retired, home_dir)
                successor.path, successor.record = own_dir, before
                raise
        successor.warm()  # it carries on as the machine: its next checkpoint comes soon
        Machine(self, retired, original.record).delete()
        original.path, original.record = successor.path, successor.record

    @contextmanager
    def _undo_on_failure(self, machine: Machine) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if machine.record.pid is not None:
                kill(machine.record.pid, machine.record.uuid)
            netfilter.stop(machine.path, machine.record.uuid)
            shutil.rmtree(machine.disk_dir, ignore_errors=True)
            shutil.rmtree(machine.path, ignore_errors=True)
            raise

    def _new(self, name: str | None, *, memory_mib: int, cpus: int, labels: dict[str, str], image_id: str,
             accel: str, disk_size_mib: int, parent: str | None, state: SavedState,
             network: NetworkRules | None = None, extra: dict | None = None) -> Machine:
        """Register a machine and run `state` in it, with a new identity."""
        name = name if name is not None else f"m-{secrets.token_hex(4)}"
        self.home.machines.mkdir(parents=True, exist_ok=True)
        path = self.home.machines / name
        with file_lock(self.home.machines / ".lock", timeout=LOCK_TIMEOUT, what="the machine list"):
            try:
                path.mkdir()
            except FileExistsError as e:
                raise AlreadyExists(f"a machine named {name!r} already exists") from e
        record = MachineRecord(
            name=name, uuid=str(uuid.uuid4()), memory_mib=memory_mib, cpus=cpus, labels=labels,
            image_id=image_id, hostname=_hostname(name), machine_id=uuid.uuid4().hex, mac=_new_mac(),
            vmgenid=str(uuid.uuid4()), created=time.time(), accel=accel, disk_size_mib=disk_size_mib,
            parent=parent, extra=extra or {}, network=(network or NetworkRules()).to_json())
        machine = Machine(self, path, record)
        with self._undo_on_failure(machine), \
                file_lock(path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {name!r}"):
            machine._save()
            machine._start_from_state(state)
            record.state = "running"
            machine._save()
        return machine
