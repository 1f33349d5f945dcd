"""What a point says of the machine it was: a checkpoint's `meta` (docs/format.md §2.6), read
and checked in one place. The store keeps it as a JSON object and knows nothing of it; the
engine reads it only through PointMeta.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from rewind.engine import MAX_CPUS, MAX_DISK_MIB, MIN_MEMORY_MIB
from rewind.engine.agent import ExecDefaults
from rewind.engine.network.netrules import NetworkRules
from rewind.engine.process.accel import ACCELS
from rewind.engine.process.qemu import LEGACY_BOARD, board_of
from rewind.errors import InvalidArgument
from rewind.store.model import is_int

if TYPE_CHECKING:
    from rewind.engine.machine import MachineRecord


@dataclass(frozen=True)
class PointMeta:
    """What a point says of the machine it was: a checkpoint's `meta` (docs/format.md §2.6).
    The store keeps it as a JSON object; the engine reads it only through this record."""

    memory_mib: int
    cpus: int
    accel: str
    image_id: str
    disk_size_mib: int
    hostname: str = ""
    machine_id: str = ""
    mac: str = ""
    network: dict = field(default_factory=dict)  # NetworkRules, as JSON
    pause_s: float | None = None
    context: str | None = None
    imported: bool = False  # set by import: its network rules are not to be trusted
    # What its guest did and said first (gueststate.py), and the machine's labels: for diff.
    guest: dict | None = None
    machine_labels: dict | None = None
    # An image of the user's own: every command's defaults, and the default image its kernel,
    # initramfs and runtime disk are (a host without that image runs the point on those).
    exec: dict = field(default_factory=dict)
    image_base: str | None = None
    image_digest: str | None = None
    board: str = LEGACY_BOARD  # the versioned QEMU board it was saved from
    # Set when it is stored (checkpoint.commit_capture): how many disk layers it has, and the
    # point whose memory file its unchanged memory was taken from.
    layers: int | None = None
    ram_base: str | None = None

    @classmethod
    def of_record(cls, r: MachineRecord, pause_s: float | None, context: str | None,
                  guest: dict | None = None) -> PointMeta:
        return cls(memory_mib=r.memory_mib, cpus=r.cpus, accel=r.accel, image_id=r.image_id,
                   disk_size_mib=r.disk_size_mib, hostname=r.hostname, machine_id=r.machine_id, mac=r.mac,
                   network=r.network, pause_s=pause_s, context=context, guest=guest,
                   machine_labels=dict(r.labels), exec=dict(r.exec), image_base=r.image_base,
                   image_digest=r.image_digest, board=r.board)

    def to_json(self) -> dict:
        data = asdict(self)
        for key, unset in (("context", None), ("imported", False), ("guest", None), ("machine_labels", None),
                           ("exec", {}), ("image_base", None), ("image_digest", None), ("layers", None),
                           ("ram_base", None)):
            if data[key] == unset:
                del data[key]
        return data

    @classmethod
    def from_json(cls, point_id: str, meta: dict) -> PointMeta:
        """Read and check a point's meta before its values become QEMU options and file
        names: the point may come from an imported file."""
        memory, cpus, disk, accel = (meta.get(k) for k in ("memory_mib", "cpus", "disk_size_mib", "accel"))
        host_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        problems = [what for what, ok in (
            ("memory", is_int(memory) and MIN_MEMORY_MIB <= memory <= host_mib),
            ("vCPUs", is_int(cpus) and 1 <= cpus <= MAX_CPUS),
            ("disk size", is_int(disk) and 0 < disk <= MAX_DISK_MIB),
            ("accelerator", accel in ACCELS),
            ("image id", isinstance(meta.get("image_id"), str))) if not ok]
        if problems:
            raise InvalidArgument(f"checkpoint {point_id[:12]} describes a machine rewind cannot run: "
                                  f"bad {', '.join(problems)}")
        def text(key: str) -> str:
            value = meta.get(key)
            return value if isinstance(value, str) else ""
        network, pause_s, context = meta.get("network"), meta.get("pause_s"), meta.get("context")
        guest, labels, layers = meta.get("guest"), meta.get("machine_labels"), meta.get("layers")
        return cls(memory_mib=memory, cpus=cpus, accel=accel, image_id=meta["image_id"], disk_size_mib=disk,
                   hostname=text("hostname"), machine_id=text("machine_id"), mac=text("mac"),
                   network=network if isinstance(network, dict) else {},
                   pause_s=float(pause_s) if isinstance(pause_s, int | float) else None,
                   context=context if isinstance(context, str) else None,
                   imported=meta.get("imported") is True, guest=guest if isinstance(guest, dict) else None,
                   machine_labels=labels if isinstance(labels, dict) else None,
                   exec=ExecDefaults.from_json(meta.get("exec")).to_json() if meta.get("exec") else {},
                   image_base=text("image_base") or None, image_digest=text("image_digest") or None,
                   board=board_of(meta), layers=layers if is_int(layers) and layers >= 0 else None,
                   ram_base=text("ram_base") or None)

    def disk_layers(self, point_id: str) -> int:
        """How many disk layers the stored point has; an error for one that says none."""
        if self.layers is None:
            raise InvalidArgument(f"checkpoint {point_id[:12]} is damaged: its meta names no disk layers")
        return self.layers

    def rules(self) -> NetworkRules:
        """The network rules a new machine from this point starts with, unless its caller gives
        some: an imported point brings none (a file must not grant itself the internet or the
        host), so its machines start offline."""
        return NetworkRules(internet=False) if self.imported else NetworkRules.from_json(self.network)
