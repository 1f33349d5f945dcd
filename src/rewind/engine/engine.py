"""The machines of one home: finding, listing, creating and deleting them, and what a
killed command left half done in the list. What happens to a machine over time
(checkpoint, restore, fork, create-from) is timeline.py; one machine is machine.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB, MAX_CPUS, MIN_MEMORY_MIB
from rewind.engine.agent import AgentClient
from rewind.engine.handoff import finish_interrupted_restore
from rewind.engine.locks import file_lock
from rewind.engine.machine import (
    DELETED_PREFIX,
    LOCK_TIMEOUT,
    RECORD,
    RETIRED_PREFIX,
    Machine,
    MachineRecord,
    Report,
    parse_labels,
    remove_deleted,
    report_lost,
    validate_name,
)
from rewind.engine.network import netfilter
from rewind.engine.network.hosttrust import HostTrust
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.process.qemu import agent_socket, kill
from rewind.errors import AlreadyExists, Busy, ImageError, InvalidArgument, NotFound, RewindError
from rewind.home import Home
from rewind.image import Image, find_image

if TYPE_CHECKING:
    from rewind.engine.memory.snapshot import SavedState
    from rewind.engine.points import Located
    from rewind.engine.process.accel import AccelChoice
    from rewind.engine.process.template import Template
    from rewind.store import CheckpointManifest, Store


def _hostname(name: str) -> str:
    host = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    return host[:63] or "rewind"


def _new_mac() -> str:
    # 52:54:00 is QEMU's prefix; the next octet keeps it locally administered and unicast.
    return "52:54:00:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(3))


class Engine:
    """Machines under one $REWIND_HOME."""

    def __init__(self, home: Home | None = None) -> None:
        self.home = home or Home.from_env()
        self._accel: AccelChoice | None = None

    def image(self, image_id: str | None = None) -> Image:
        """An image by id, or the default one."""
        return find_image(self.home.images, image_id)

    def point_image(self, image_id: str, base: str | None) -> Image:
        """The image to run a point of image `image_id` on: that image, or, on a host without
        it, the default image it was built on (its disk comes with the point's layers)."""
        try:
            return self.image(image_id)
        except ImageError:
            if base is None:
                raise
        try:
            return self.image(base)
        except ImageError as e:
            raise ImageError(f"this host has neither image {image_id!r} nor the default image "
                             f"{base!r} it was built on: run `rewind image build`") from e

    def accel(self) -> AccelChoice:
        from rewind.engine.process.accel import choose_accel

        if self._accel is None:
            try:
                default: Image | None = self.image()
            except ImageError:
                default = None  # only imported images here
            self._accel = choose_accel(self.home.images, default)
        return self._accel

    def template(self, memory_mib: int, cpus: int, image: Image | None = None,
                 report: Report = lambda _: None) -> Template:
        from rewind.engine.process.template import ensure_template

        return ensure_template(image or self.image(), self.accel().accel, memory_mib, cpus, report)

    def _path(self, name: str) -> Path:
        return self.home.machines / validate_name(name)

    def get(self, name: str) -> Machine:
        self.finish_interrupted()
        path = self._path(name)
        try:
            record = MachineRecord.from_json(json.loads((path / RECORD).read_text()))
        except FileNotFoundError as e:
            raise NotFound(f"no machine named {name!r}") from e
        except (ValueError, TypeError) as e:
            raise RewindError(f"machine {name!r} has a damaged record ({e}); remove {path}") from e
        return Machine(self.home, path, record, recover=finish_interrupted_restore)

    def finish_interrupted(self) -> None:
        """Finish what a killed command left in the machine list: a delete's folder (removed
        with its disk layers), and a copy taking over a name (`replace`): finished if the
        copy's record already bears the name, else undone."""
        if not self.home.machines.is_dir():
            return
        leftovers = [p for p in self.home.machines.iterdir()
                     if p.name.startswith((DELETED_PREFIX, RETIRED_PREFIX))]
        if not leftovers:
            return
        with contextlib.suppress(Busy), file_lock(self.home.machines / ".lock", timeout=0, what="the list"):
            for path in leftovers:
                if path.name.startswith(DELETED_PREFIX):
                    remove_deleted(path, self.home.root / "disks" / path.name[len(DELETED_PREFIX):])
                    continue
                with contextlib.suppress(NotFound, FileNotFoundError, ValueError, TypeError):
                    self._finish_replace(path)

    def _finish_replace(self, retired: Path) -> None:
        original = MachineRecord.from_json(json.loads((retired / RECORD).read_text()))
        holder = self.home.machines / original.name
        try:
            successor = MachineRecord.from_json(json.loads((holder / RECORD).read_text()))
        except FileNotFoundError:  # killed between the two renames
            os.rename(retired, holder)
            return
        if successor.name != original.name:  # killed before the copy's record took the name
            os.rename(holder, self.home.machines / validate_name(successor.name))
            os.rename(retired, holder)
            return
        Machine(self.home, retired, original).delete()

    def list(self, labels: dict[str, str] | None = None) -> list[Machine]:
        self.finish_interrupted()
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
               host_trust: bool = False, report: Report = lambda _: None) -> Machine:
        """Create and start a machine from the booted template; with `host_trust`, it takes this
        host's CA certificates and proxy settings (see hosttrust.py). Nothing is left behind on
        failure."""
        from rewind.engine.process.template import template_state

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
        trust = HostTrust.collect() if host_trust else None  # a host with none to give fails first
        template = self.template(memory_mib, cpus, chosen, report)
        machine = self.new_machine(name, memory_mib=memory_mib, cpus=cpus, labels=labels, image_id=chosen.id,
                            accel=template.accel, disk_size_mib=base_mib, parent=None,
                            state_of=lambda: template_state(template, self.home.runtime, chosen),
                            network=network, exec_defaults=chosen.exec, image_base=chosen.base,
                            image_digest=chosen.source.get("digest"))
        if disk_mib > base_mib:
            with self._undo_on_failure(machine):
                machine.grow_disk(disk_mib)
                machine.record.disk_size_mib = disk_mib
                machine.save()
        if trust is not None:
            report(f"{machine.name} takes {trust.describe()}")
            with self._undo_on_failure(machine):
                machine.take_trust(trust)
        return machine

    def find_point(self, store: Store, ref: str | CheckpointManifest,
                   relative_to: str | None = None) -> Located:
        """The point `ref` names, stored or still being stored here (see points.py)."""
        from rewind.engine.points import locate

        return locate(self.home, store, ref, relative_to)

    def settle(self) -> None:
        """Return once every machine's checkpoints are all in their stores (see pending.py)."""
        from rewind.engine import pending

        report_lost(pending.settle(self.home))

    def replace(self, original: Machine, successor: Machine) -> None:
        """`successor`, a running copy of `original`, takes over its name, identity, labels and
        network rules, and `original` is deleted. Both directories are swapped by rename, so
        at every moment one machine holds the name; on failure everything is put back. Disk
        layers live outside the directories (disk_dir), so QEMU's paths stay true."""
        retired = self.home.machines / f"{RETIRED_PREFIX}{original.name}-{secrets.token_hex(4)}"
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
                r.name, r.labels, r.network, r.ports = o.name, dict(o.labels), dict(o.network), list(o.ports)
                r.hostname, r.machine_id, r.mac, r.created = o.hostname, o.machine_id, o.mac, o.created
                r.extra["replaced"] = {"machine": o.uuid, "by": before.name, "at": time.time()}
                with AgentClient(home_dir / agent_socket(0), alive=successor.check_alive) as agent:
                    agent.set_identity(hostname=r.hostname, machine_id=r.machine_id, mac=r.mac)
                netfilter.update(home_dir, successor.network)
                netfilter.forward(home_dir, [f.guest_port for f in r.ports])
                successor.save()
            except BaseException:
                os.rename(home_dir, own_dir)
                os.rename(retired, home_dir)
                successor.path, successor.record = own_dir, before
                raise
        with contextlib.suppress(NotFound, FileNotFoundError):  # another command finished it first
            Machine(self.home, retired, original.record).delete()
        successor._open_ports()  # the original's QEMU held the host ports until now
        original.path, original.record = successor.path, successor.record

    @contextmanager
    def _undo_on_failure(self, machine: Machine) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if machine.record.pid is not None:
                kill(machine.record.pid, machine.record.uuid)
            netfilter.stop(machine.path)
            shutil.rmtree(machine.disk_dir, ignore_errors=True)
            shutil.rmtree(machine.path, ignore_errors=True)
            raise

    def new_machine(self, name: str | None, *, memory_mib: int, cpus: int, labels: dict[str, str] | None,
                    image_id: str, accel: str, disk_size_mib: int, parent: str | None,
                    state_of: Callable[[], SavedState], network: NetworkRules | None = None,
                    extra: dict | None = None, exec_defaults: dict | None = None,
                    image_base: str | None = None, image_digest: str | None = None) -> Machine:
        """Register a machine and run the saved state `state_of` gives in it, with a new
        identity."""
        name = validate_name(name) if name is not None else f"m-{secrets.token_hex(4)}"
        labels = parse_labels(labels)
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
            parent=parent, extra=extra or {}, network=(network or NetworkRules()).to_json(),
            exec=dict(exec_defaults or {}), image_base=image_base, image_digest=image_digest)
        machine = Machine(self.home, path, record, recover=finish_interrupted_restore)
        with self._undo_on_failure(machine), \
                file_lock(path / "lock", timeout=LOCK_TIMEOUT, what=f"machine {name!r}"):
            machine.save()
            machine.start_from_state(state_of)
            record.state = "running"
            machine.save()
        return machine
