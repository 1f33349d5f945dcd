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
import io
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.engine.agent import CONNECT_TIMEOUT, AgentClient, ExecDefaults
from rewind.engine.disk import diskchain
from rewind.engine.locks import any_free_lock, file_lock
from rewind.engine.memory import ramcache
from rewind.engine.memory.memfiles import blank_layer
from rewind.engine.memory.migstream import has_configuration
from rewind.engine.network import hosttrust, netfilter, ports
from rewind.engine.network.hosttrust import HostTrust
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.process.qemu import (
    AGENT_CHARDEV,
    AGENT_PORTS,
    CONSOLE_LOG,
    CONSOLE_SOCKET,
    LEGACY_BOARD,
    PID_FILE,
    QEMU_LOG,
    QMP_SOCKET,
    VmSpec,
    agent_socket,
    disk_node,
    kill,
    launch,
    process_alive,
    qemu_build,
    wait_exit,
)
from rewind.engine.process.qmp import Monitor, MonitorError
from rewind.errors import (
    AgentGone,
    AlreadyExists,
    Busy,
    InvalidArgument,
    MachineDied,
    MachineNotRunning,
    NotFound,
    PortError,
    RewindError,
)
from rewind.home import Home
from rewind.image import find_image
from rewind.results import LOCAL_HOST, MachineInfo, PortForward
from rewind.store.durable import replace_durably

# What only creating, checkpointing and restoring use is imported where it is used: a
# command that runs something in a machine (`rewind exec`) then starts in 0.13 s, not 0.3.
if TYPE_CHECKING:
    from rewind.engine.memory.snapshot import SavedState

# The agent's ports close while init restarts it; that took under a second in a TCG guest.
AGENT_RESTART_GRACE = 3.0
LOCK_TIMEOUT = float(os.environ.get("REWIND_LOCK_TIMEOUT", "30"))
RECORD = "machine.json"
# Folders in machines/ that are no machine: one being deleted, one whose name a copy takes.
DELETED_PREFIX, RETIRED_PREFIX = ".deleted-", ".retired-"
# A folder inside a machine's where its next QEMU starts (see NextQemu).
NEXT_PREFIX = "next-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

Report = Callable[[str], None]
log = logging.getLogger("rewind")


MAX_TTL_S = 30 * 86400
ON_EXPIRY = ("stop", "checkpoint", "delete")


def check_ttl(seconds: float | None, on_expiry: str | None) -> None:
    if seconds is not None and (not isinstance(seconds, int | float) or isinstance(seconds, bool)
                                or not 0 < seconds <= MAX_TTL_S):
        raise InvalidArgument(f"a time to live is more than 0 s and at most {MAX_TTL_S // 86400} days "
                              f"(got {seconds!r})")
    if on_expiry is not None and on_expiry not in ON_EXPIRY:
        raise InvalidArgument(f"on expiry a machine is one of {', '.join(ON_EXPIRY)}, not {on_expiry!r}")


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


def report_lost(messages: list[str]) -> None:
    """Points that could never be stored (the host restarted before): said once, then forgotten."""
    for message in messages:
        log.warning(message)


def _trim_images(home: Home) -> None:
    """Drop memory images no machine or checkpoint needs any more (see pending.trim_images)."""
    from rewind.engine import pending

    pending.trim_images(home)


@dataclass(frozen=True)
class Handoff:
    """A restore under way: the machine's QEMU was stopped and captured as checkpoint `point`
    (not yet written out, perhaps not yet journalled), and ends once that is done; the next
    QEMU is not yet saved in the record. Left in a record only by a restore that died: see
    handoff.finish_interrupted_restore."""

    point: str
    parent: str | None  # the machine's point before the capture
    store: str  # the store the restore was given
    layer: str  # the top layer that QEMU writes to since the capture


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
    handoff: Handoff | None = None
    ports: list[PortForward] = field(default_factory=list)  # set up in every QEMU it runs in
    exec: dict = field(default_factory=dict)  # every command's defaults (ExecDefaults), from its image
    image_base: str | None = None  # the default image an image of the user's own is built on
    image_digest: str | None = None  # an image of the user's own: its source's config digest
    expires: float | None = None  # when its time to live ends (epoch seconds; see expiry.py)
    on_expiry: str = "stop"  # stop | checkpoint | delete
    board: str = LEGACY_BOARD  # the versioned QEMU board its QEMU runs (qemu.QemuBuild)

    @classmethod
    def from_json(cls, data: dict) -> MachineRecord:
        """A record as saved; fields this version no longer keeps are ignored."""
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        if isinstance(record.handoff, dict):
            record.handoff = Handoff(**record.handoff)
        record.ports = [PortForward.from_json(p) if isinstance(p, dict) else p for p in record.ports]
        return record


class Machine:
    """One machine on this host. Obtain through Engine."""

    def __init__(self, home: Home, path: Path, record: MachineRecord,
                 recover: Callable[[Machine], None] = lambda _: None) -> None:
        self.home = home
        # What a command that uses the machine does first: Engine gives the finishing of a
        # restore a killed command left (handoff.py).
        self._recover = recover
        self.path = path
        self.record = record
        self._agent_closed_since: float | None = None  # see _agent_silent

    @property
    def name(self) -> str:
        return self.record.name

    def reload(self) -> None:
        try:
            self.record = MachineRecord.from_json(json.loads((self.path / RECORD).read_text()))
        except FileNotFoundError as e:
            raise NotFound(f"machine {self.name!r} no longer exists") from e

    def locked(self, shared: bool = False) -> contextlib.AbstractContextManager[None]:
        """The machine lock: exclusive for lifecycle changes (start, stop, restore, delete),
        shared for sessions and checkpoints."""
        what = f"machine {self.name!r}"
        return file_lock(self.path / "lock", shared=shared, timeout=LOCK_TIMEOUT, what=what)

    def save(self) -> None:
        """Write the record; the caller holds the machine lock exclusively (else see _update)."""
        replace_durably(self.path / RECORD, json.dumps(asdict(self.record), indent=2).encode())

    def update(self, change: Callable[[MachineRecord], None]) -> None:
        """Reload the record, change it and save it under the record lock: for commands that
        hold the machine lock shared (a checkpoint, new network rules), which would otherwise
        undo each other's changes."""
        with file_lock(self.path / "record.lock", timeout=LOCK_TIMEOUT, what=f"machine {self.name!r}"):
            self.reload()
            change(self.record)
            self.save()

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
                           accel=r.accel, expires=r.expires, on_expiry=r.on_expiry if r.expires else None)

    def check_alive(self) -> None:
        """Raise MachineDied/MachineNotRunning unless the machine's QEMU is running."""
        status = self.status()
        if status == "dead":
            raise MachineDied(f"machine {self.name!r} is dead: its QEMU exited unexpectedly "
                              f"(see {self.path / 'console.log'}); `rewind start {self.name}` boots it "
                              f"again from its disk, `rewind restore {self.name} REF` runs it from a "
                              f"checkpoint, `rewind rm {self.name}` removes it")
        if status != "running":
            raise MachineNotRunning(f"machine {self.name!r} is {status}; start it with "
                                    f"`rewind start {self.name}`")

    def _agent_silent(self) -> None:
        """What an agent session checks when the guest does not answer: that QEMU runs; that
        the guest is not left paused by a checkpoint whose caller died between stopping it and
        starting the capture (then it is resumed, unless a checkpoint is under way); and that
        the guest agent still has its ports open, else it is reported gone within
        AGENT_RESTART_GRACE instead of waited on for the whole connect timeout."""
        self.check_alive()
        try:
            with file_lock(self.path / "checkpoint.lock", timeout=0, what=f"machine {self.name!r}"), \
                    self.monitor() as mon:
                if mon.cmd("query-status").get("status") == "paused" and \
                        mon.cmd("query-migrate").get("status") not in ("setup", "active"):
                    mon.cmd("cont")
                listening = any(c.get("frontend-open") for c in mon.cmd("query-chardev")
                                if c.get("label", "").startswith(AGENT_CHARDEV))
        except (Busy, MonitorError):
            return
        now = time.monotonic()
        if listening:
            self._agent_closed_since = None
            return
        self._agent_closed_since = self._agent_closed_since or now
        if now - self._agent_closed_since > AGENT_RESTART_GRACE:
            raise AgentGone(f"machine {self.name!r}: its guest agent is not running and has not restarted "
                            f"for {AGENT_RESTART_GRACE:.0f} s (a command may have removed what it runs on, "
                            f"such as its runtime disk at /usr/lib/rewind); `rewind restore {self.name} ~0` "
                            "puts the machine back to its last checkpoint")

    # ---- sessions ----

    @contextmanager
    def agent(self, connect_timeout: float = CONNECT_TIMEOUT,
              deadline: float | None = None) -> Iterator[AgentClient]:
        """A session with the guest agent, on the first free agent port; reaching the agent
        ends at `deadline` (monotonic, see agent.exec_deadline) if that comes first."""
        what = f"machine {self.name!r}"
        self.reload()
        self._recover(self)
        defaults = ExecDefaults.from_json(self.record.exec)
        with file_lock(self.path / "lock", shared=True, timeout=LOCK_TIMEOUT, what=what):
            self.reload()  # another handle may have restored it: a new QEMU
            self.check_alive()
            port_locks = [self.path / f"port-{i}.lock" for i in range(AGENT_PORTS)]
            with any_free_lock(port_locks, timeout=LOCK_TIMEOUT, what=what) as port, \
                    AgentClient(self.path / agent_socket(port), alive=self._agent_silent,
                                connect_timeout=connect_timeout if deadline is None
                                else min(connect_timeout, deadline - time.monotonic()),
                                defaults=defaults) as client:
                yield client

    def monitor(self) -> Monitor:
        return Monitor(self.path / QMP_SOCKET)

    # ---- lifecycle ----

    def _spec(self, ram: Path | None, incoming: bool, disks: list[Path], vmgenid: str,
              configuration: bool = True, board: str | None = None) -> VmSpec:
        """QEMU's command line for this machine, its disk's frozen layers merged where a merged
        file is there (diskchain.py). Reads only what no restore changes (a NextQemu calls it
        on a thread of its own)."""
        r = self.record
        image = find_image(self.home.images, r.image_id)
        chain = [*diskchain.for_qemu(disks[:-1], self.home), (len(disks) - 1, disks[-1])]
        return VmSpec(board=board or "q35", tag=r.uuid, memory_mib=r.memory_mib, cpus=r.cpus, accel=r.accel,
                      kernel=image.kernel, initrd=image.initrd, disks=chain,
                      ram_file=ram, ram_shared=False, mac=r.mac, vmgenid=vmgenid, incoming=incoming,
                      configuration=configuration, runtime_disk=image.runtime_disk)

    @property
    def disk_dir(self) -> Path:
        """Where its writable disk layers live: named by its UUID, not its name, because QEMU
        reopens a layer by the path it was given (a renamed machine keeps its QEMU)."""
        return self.home.root / "disks" / self.record.uuid

    def new_top(self) -> Path:
        """A new, empty top layer for the disk, over the current chain's top."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        top = self.disk_dir / f"disk-{secrets.token_hex(4)}.qcow2"
        shutil.copyfile(blank_layer(self.home.runtime, self.record.disk_size_mib), top)
        return top

    def set_ttl(self, seconds: float | None, on_expiry: str | None = None) -> None:
        """Its time to live ends `seconds` from now (None: never); then `on_expiry` is done to
        it: stop, checkpoint (and stop) or delete, by whoever watches (`rewind serve`, or
        `rewind expire`)."""
        check_ttl(seconds, on_expiry)

        def change(r: MachineRecord) -> None:
            r.expires = None if seconds is None else time.time() + seconds
            r.on_expiry = on_expiry or r.on_expiry
        with self.locked(shared=True):
            self.update(change)

    def set_labels(self, changes: dict[str, str | None]) -> dict[str, str]:
        """Add or change labels (a None value removes one); the labels it has now."""
        if not isinstance(changes, dict):
            raise InvalidArgument("labels must be a mapping of KEY to VALUE (None removes KEY)")
        removed = [key for key, value in changes.items() if value is None]
        added = parse_labels({key: value for key, value in changes.items() if value is not None})

        def change(record: MachineRecord) -> None:
            record.labels = {k: v for k, v in {**record.labels, **added}.items() if k not in removed}
        with self.locked(shared=True):
            self.update(change)
        return dict(self.record.labels)

    @property
    def network(self) -> NetworkRules:
        return NetworkRules.from_json(self.record.network)

    def set_network(self, rules: NetworkRules) -> None:
        """Apply new network rules now (if running) and from every later start."""
        with self.locked(shared=True):
            self.update(lambda r: setattr(r, "network", rules.to_json()))
            if self.status() == "running":
                netfilter.update(self.path, rules)

    def forward_port(self, guest_port: int, host_port: int | None = None,
                     host: str = LOCAL_HOST) -> PortForward:
        """Lead `host:host_port` (default: a free port on 127.0.0.1) to the guest's
        `guest_port`, now and in every QEMU this machine runs in later (see ports.py)."""
        ports.check_port(guest_port, "the guest port")
        ports.check_port(host_port, "the host port", allow_none=True)
        ports.check_host(host)
        with self.locked(shared=True):
            self.reload()
            if any(f.guest_port == guest_port for f in self.record.ports):
                raise AlreadyExists(f"guest port {guest_port} of {self.name!r} is forwarded already "
                                    f"(rewind port {self.name} {guest_port} --remove first)")
            forward = PortForward(host, host_port or ports.free_port(host), guest_port)
            if self.status() == "running":
                # The filter first: the guest's first answer through the forward must pass.
                netfilter.forward(self.path, [f.guest_port for f in [*self.record.ports, forward]])
                try:
                    with self.monitor() as monitor:
                        ports.add(monitor, forward)
                except BaseException:
                    netfilter.forward(self.path, [f.guest_port for f in self.record.ports])
                    raise
            self.update(lambda r: r.ports.append(forward))
        return forward

    def remove_forward(self, guest_port: int) -> PortForward:
        """End the forward to `guest_port`; the forward it was."""
        with self.locked(shared=True):
            self.reload()
            forward = next((f for f in self.record.ports if f.guest_port == guest_port), None)
            if forward is None:
                raise NotFound(f"guest port {guest_port} of {self.name!r} is not forwarded")
            self.update(lambda r: r.ports.remove(forward))
            if self.status() == "running":
                with self.monitor() as monitor:
                    ports.remove(monitor, forward)
                netfilter.forward(self.path, [f.guest_port for f in self.record.ports])
        return forward

    def _open_ports(self) -> None:
        """Set the record's forwards up in the QEMU just started. One that cannot be (its host
        port was taken meanwhile) is logged and kept: the machine runs on."""
        if not self.record.ports:
            return
        with self.monitor() as monitor:
            for forward in self.record.ports:
                try:
                    ports.add(monitor, forward)
                except PortError as e:
                    log.warning("machine %s: %s", self.name, e)

    def network_attempts(self) -> list[str]:
        """What it tried to reach and its network rules refused, since its QEMU started (see
        netfilter.attempts)."""
        self.check_alive()
        return netfilter.attempts(self.path)

    @contextmanager
    def _launching(self, start: Callable[[], int]) -> Iterator[None]:
        """Start QEMU (`start` returns its PID once its sockets are in this machine's folder)
        and, alongside it, the filter that enforces its network rules. The block gets the guest
        going while the filter starts (until it connects, the guest's frames go nowhere); the
        filter must be ready by the block's end."""
        r = self.record
        r.pid = None
        filter_proc = netfilter.spawn(self.home.runtime, self.path, r.uuid, self.network,
                                      [f.guest_port for f in r.ports])
        try:
            r.pid = start()
            yield
            netfilter.wait_ready(filter_proc, self.path)
            self._open_ports()
        except BaseException:
            if r.pid is not None:
                kill(r.pid, r.uuid)
            filter_proc.kill()
            filter_proc.wait()
            netfilter.stop(self.path)
            raise

    def next_qemu(self, state_of: Callable[[], SavedState], vmgenid: str | None = None,
                  background: bool = False) -> NextQemu:
        """Start a QEMU for the saved state `state_of` gives (see NextQemu); `vmgenid`: the
        generation it starts in (default: a new one, so the guest reseeds its randomness)."""
        return NextQemu(self, state_of, vmgenid or str(uuid.uuid4()), background)

    def start_from_state(self, state_of: Callable[[], SavedState]) -> None:
        """Run the saved state `state_of` gives in a new QEMU (see run_next), in the generation
        the record names."""
        self.run_next(self.next_qemu(state_of, self.record.vmgenid))

    def run_next(self, nxt: NextQemu) -> None:
        """Make the QEMU `nxt` started, which runs the saved state by now (see NextQemu), this
        machine's: its disk layers, memory file and generation go into the record, its
        sockets into this machine's folder, and its network filter starts. This machine's old
        QEMU is gone by now."""
        try:
            launched = nxt.wait()
            state, r = launched.state, self.record
            r.disks = [*(str(d) for d in state.disks), str(launched.top)]
            r.ram, r.ram_point, r.vmgenid = str(state.ram), state.ram_point, nxt.vmgenid
            r.board = state.board
            with self._launching(nxt.adopt):
                pass  # its guest runs already: nothing to do while the filter starts
        except BaseException:
            nxt.discard()
            raise

    def _boot(self, report: Report) -> None:
        """Cold boot from this machine's own disk (a stopped machine), then give it its identity."""
        from rewind.engine.process.template import BOOT_TIMEOUT

        report(f"booting {self.name} from its disk")
        spec = self._spec(None, incoming=False, disks=[Path(d) for d in self.record.disks],
                          vmgenid=self.record.vmgenid)
        self.record.board = qemu_build().board  # what plain q35 is: its captures are of that
        with self._launching(lambda: launch(spec, self.path)):
            self.apply_identity(self.path, self._check_starting, connect_timeout=BOOT_TIMEOUT)

    def _check_starting(self, pid: int | None = None) -> None:
        """check_alive for a QEMU still being started (its record is not yet 'running'): the
        machine's, or `pid`, a next QEMU not yet adopted (see NextQemu)."""
        r = self.record
        pid = r.pid if pid is None else pid
        if pid is None or not process_alive(pid, r.uuid):
            raise MachineDied(f"machine {r.name!r}: QEMU exited while starting "
                              f"(see {self.path / QEMU_LOG} and {self.path / CONSOLE_LOG})")

    def apply_identity(self, run_dir: Path, alive: Callable[[], None], connect_timeout: float) -> None:
        """Give the guest of the QEMU in `run_dir` this machine's identity, a fresh seed for
        its randomness and the time; `alive` raises if that QEMU is gone."""
        r = self.record
        with AgentClient(run_dir / agent_socket(0), alive=alive, connect_timeout=connect_timeout) as client:
            client.set_identity(hostname=r.hostname, machine_id=r.machine_id, mac=r.mac,
                                seed=secrets.token_hex(32), time=time.time())

    def take_trust(self, trust: HostTrust) -> None:
        """Install the host's CA certificates into the guest's trust store, and make the
        variables that point tools at that store, and the host's proxies, every command's
        defaults."""
        with self.agent() as agent:
            agent.write_file(hosttrust.GUEST_ADDED, io.BytesIO(trust.certificates), 0o644)
            done = agent.exec(["sh", "-c", hosttrust.INSTALL], timeout=120)
        if not done.ok:
            raise RewindError(f"machine {self.name!r}: installing the host's CA certificates failed: "
                              f"{(done.stderr or done.stdout).strip()[-300:]}")

        def change(r: MachineRecord) -> None:
            r.exec = {**r.exec, "env": {**r.exec.get("env", {}), **trust.env()}}
            r.extra["host_trust"] = {"bundle": trust.bundle, "proxies": sorted(trust.proxies)}
        with self.locked(shared=True):
            self.update(change)

    def grow_disk(self, disk_mib: int) -> None:
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
        self._recover(self)
        with self.locked():
            self.reload()
            if self.status() == "running":
                return
            self._boot(report)
            self.record.state = "running"
            self.save()

    def stop(self) -> None:
        """Flush the guest's disk and end its QEMU. Files survive; processes do not."""
        self._recover(self)
        self._settle_before_ending()
        with self.locked():
            self.reload()
            if self.status() == "running":
                self._shutdown()
            self.cleanup_runtime()
            self.record.state = "stopped"
            self.record.pid = None
            self.save()
        _trim_images(self.home)

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

    def stray_starts(self) -> list[Path]:
        """Folders of NextQemus that were never adopted: their command was killed."""
        return list(self.path.glob(f"{NEXT_PREFIX}*"))

    def end_stray_qemu(self) -> None:
        """End a QEMU of this machine that its record does not name: one a command killed
        between starting it and saving the record left (its PID file is the newest, or in a
        NextQemu's folder), and remove NextQemu's folders."""
        for run_dir in [self.path, *self.stray_starts()]:
            try:
                pid = int((run_dir / PID_FILE).read_text())
            except (OSError, ValueError):
                pid = None
            if pid is not None and pid != self.record.pid:
                kill(pid, self.record.uuid)
            if run_dir != self.path:
                shutil.rmtree(run_dir, ignore_errors=True)

    def cleanup_runtime(self) -> None:
        netfilter.stop(self.path)
        for name in (QMP_SOCKET, CONSOLE_SOCKET, PID_FILE,
                     *(agent_socket(i) for i in range(AGENT_PORTS))):
            (self.path / name).unlink(missing_ok=True)

    # ---- checkpoints ----

    def settle(self) -> None:
        """Return once this machine's checkpoints are all in the store."""
        from rewind.engine import pending

        report_lost(pending.settle(self.home, self.record.uuid))

    def _settle_before_ending(self) -> None:
        """Before its QEMU ends, let it finish writing out the memory of its checkpoints (a
        capture is lost if its QEMU ends first), and end the QEMUs its restores left once
        theirs is out. Storing them goes on without it (a committer killed is started again).
        The QEMUs a restore left were their committers' to end: one killed, or one whose home
        was deleted under it, left them running with nothing to record them."""
        from rewind.engine import pending

        home = self.home
        pending.revive_committers(home, self.record.uuid)
        for point in pending.captured(home):
            if point.machine_uuid == self.record.uuid:
                with contextlib.suppress(RewindError):
                    pending.wait_captured(home, point)
                    pending.end_qemu(point)

    def delete(self) -> None:
        self._settle_before_ending()
        with self.locked():
            self.reload()
            if self.record.pid is not None and process_alive(self.record.pid, self.record.uuid):
                try:
                    with self.monitor() as mon:
                        mon.quit()
                except MonitorError:
                    pass
                if not wait_exit(self.record.pid, self.record.uuid, 5):
                    kill(self.record.pid, self.record.uuid)
            self.end_stray_qemu()
            netfilter.stop(self.path)
            # Out of sight in one rename: a kill after it leaves a folder the next look at the
            # machine list removes (finish_interrupted), never a record naming files gone.
            deleted = self.path.parent / f"{DELETED_PREFIX}{self.record.uuid}"
            os.rename(self.path, deleted)
            remove_deleted(deleted, self.disk_dir)
        _trim_images(self.home)


@dataclass(frozen=True)
class Launched:
    """A QEMU started for a saved state and waiting for its device state (see NextQemu)."""

    state: SavedState
    top: Path  # the new top layer of the disk, which it writes to
    pid: int


class NextQemu:
    """A machine's next QEMU, started for a saved state in a folder of its own, since the
    machine's current QEMU, whose sockets have the same names, may still run meanwhile; `adopt`
    moves it into the machine's folder. It loads the state and gives the guest the machine's
    identity there, before it is adopted: a restore starts it on a thread while it captures
    the state the machine leaves, so that capture (0.1-0.2 s in the agent loop) overlaps
    QEMU's start (0.05-0.2 s), the load (0.04-0.09 s) and the guest's first answers, which a
    just-loaded TCG guest gives slowly (0.1-0.15 s). The two guests share no file they write,
    and the new one has no network until it is adopted (its filter starts then). One never
    adopted (its command was killed) is ended by end_stray_qemu.

    The memory image is held against release from the cache (ramcache.starting) from before
    QEMU maps it until the load."""

    def __init__(self, machine: Machine, state_of: Callable[[], SavedState], vmgenid: str,
                 background: bool) -> None:
        self.vmgenid = vmgenid
        self.run_dir = machine.path / f"{NEXT_PREFIX}{secrets.token_hex(4)}"
        self._machine, self._state_of = machine, state_of
        self._held = contextlib.ExitStack()
        self._top: Path | None = None
        self._launched: Launched | None = None
        self._error: BaseException | None = None
        self._discarding = False
        self._thread = threading.Thread(target=self._start, name="rewind-next-qemu", daemon=True) \
            if background else None
        if self._thread is None:
            self._start()
        else:
            self._thread.start()

    def _start(self) -> None:
        try:
            launched = self._launched = self._launch()
            self._run(launched)
        except BaseException as e:  # raised by wait(), on the caller's thread
            self._error = e
        finally:
            self._held.close()

    def _launch(self) -> Launched:
        m, state = self._machine, self._state_of()
        missing = self._hold(state)
        if missing is not None and missing.parent == m.home.runtime / "ram":
            # Released from the cache after it was picked (a trim with no machine left in the
            # home, in another process): picked again, so brought back from the store.
            state = self._state_of()
            missing = self._hold(state)
        what = f"checkpoint {state.point[:12]}" if state.point else "its image's template"
        qemu_build().check_board(state.board, what)  # said before QEMU fails on it less clearly
        if missing is not None:
            raise NotFound(f"machine {m.name!r} cannot run from {what}: its file {missing} is gone")
        self._top = m.new_top()
        spec = m._spec(state.ram, incoming=True, disks=[*state.disks, self._top], vmgenid=self.vmgenid,
                       configuration=has_configuration(state.devstate), board=state.board)
        self.run_dir.mkdir()
        return Launched(state, self._top, launch(spec, self.run_dir, log_dir=m.path))

    def _run(self, launched: Launched) -> None:
        """Load the saved state into the started QEMU (its memory file mapped copy-on-write,
        its device state loaded, its disk layers below a new top layer), then give the guest
        the machine's identity."""
        from rewind.engine.memory.snapshot import incoming

        m = self._machine
        with Monitor(self.run_dir / QMP_SOCKET) as mon, \
                incoming(launched.state, m.record.memory_mib << 20) as stream:
            mon.load_incoming(stream, str(launched.state.devstate))
        self._held.close()  # QEMU maps its memory as it starts

        def alive() -> None:
            if self._discarding:
                raise RewindError("the next QEMU was discarded")
            m._check_starting(launched.pid)
        m.apply_identity(self.run_dir, alive, connect_timeout=30)

    def _hold(self, state: SavedState) -> Path | None:
        """Hold the state's memory images against release (ramcache.starting); the first of
        its files that is gone, if one is."""
        self._held.close()
        missing = next((Path(f) for f in (state.devstate, *state.disks) if not os.path.exists(f)), None)
        for image in (state.ram, *([] if state.over is None else [state.over.image])):
            try:
                self._held.enter_context(ramcache.starting(image))
            except FileNotFoundError:
                missing = missing or Path(image)
        return missing

    def wait(self) -> Launched:
        """The QEMU, running the state; if it could not be started, what stopped it is raised
        here and what it left is removed."""
        if self._thread is not None:
            self._thread.join()
        if self._launched is None or self._error is not None:
            self.discard()
            raise self._error or RewindError("the next QEMU was not started")
        return self._launched

    def adopt(self) -> int:
        """Move its sockets and PID file into the machine's folder, whose old ones are gone by
        now; returns its PID."""
        launched = self.wait()
        for entry in os.listdir(self.run_dir):
            os.replace(self.run_dir / entry, self._machine.path / entry)
        self.run_dir.rmdir()
        return launched.pid

    def discard(self) -> None:
        """End it if it started, and remove what it made: for a caller that will not run it."""
        self._discarding = True  # a guest that is slow to answer is not waited for
        if self._thread is not None:
            self._thread.join()
        if self._launched is not None:
            kill(self._launched.pid, self._machine.record.uuid)
        if self._top is not None:
            self._top.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._held.close()


def remove_deleted(folder: Path, disk_dir: Path) -> None:
    shutil.rmtree(disk_dir, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
