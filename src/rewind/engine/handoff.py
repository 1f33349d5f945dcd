"""A restore hands a machine from one QEMU to the next: the record holds a Handoff (the old
QEMU stopped, its capture journaled) until the new QEMU runs. Here: running a machine from a
point's files in its next QEMU, and finishing a handoff a killed command left, which every
command that uses the machine does first (engine/machine.py). timeline.restore is the flow.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.engine.memory.memfiles import private_runtime
from rewind.engine.process.qemu import QMP_SOCKET
from rewind.errors import NotFound

if TYPE_CHECKING:
    from rewind.engine.checkpoint import Caches
    from rewind.engine.machine import Handoff, Machine, MachineRecord, NextQemu

log = logging.getLogger("rewind")


def handoff_monitor(caches: Caches, point_id: str) -> Path:
    """Where a restore moves its stopped QEMU's QMP socket for the point's committer."""
    return caches.devstate / f"{point_id}.qmp"


def run_state(machine: Machine, point_id: str, nxt: NextQemu) -> None:
    """Run `machine` from a point's files in the QEMU `nxt` started (its old one is stopped
    or gone), in a new generation: the guest reseeds its randomness."""
    machine.cleanup_runtime()
    machine.run_next(nxt)
    r = machine.record
    r.state, r.parent, r.handoff = "running", point_id, None
    machine.save()


def finish_interrupted_restore(machine: Machine) -> None:
    """If a restore of `machine` was killed between stopping its QEMU and saving the next one
    (its record still holds a Handoff), finish it: the machine runs on from the state it was
    captured in. If that capture never got its journal, the stopped QEMU simply goes on."""
    if machine.record.handoff is None and not machine.stray_starts():
        return
    # Loaded only when a restore was interrupted: they add 40-75 ms to every command that
    # loads a machine (python -X importtime).
    from rewind.engine.checkpoint import Caches
    from rewind.engine.points import locate
    from rewind.store import open_store

    with machine.locked():  # waits for a restore still under way
        machine.reload()
        machine.end_stray_qemu()  # a successor started but not yet recorded
        handoff = machine.record.handoff
        if handoff is None:
            return
        try:
            state = locate(machine.home, open_store(Path(handoff.store)), handoff.point).state()
        except NotFound:
            _resume_handed_off(machine, handoff, Caches.of(machine.home.root,
                                                           private_runtime(machine.home.runtime)))
            return
        run_state(machine, handoff.point, machine.next_qemu(lambda: state))
    log.warning("machine %s: a restore was interrupted; it runs on from the state it was in "
                "(checkpoint %s)", machine.name, handoff.point[:12])


def _resume_handed_off(machine: Machine, handoff: Handoff, caches: Caches) -> None:
    """The capture of an interrupted restore never got its journal: nothing will write it out
    or end its QEMU, so that QEMU goes on where it stopped."""
    monitor = handoff_monitor(caches, handoff.point)
    if monitor.exists():
        os.replace(monitor, machine.path / QMP_SOCKET)

    def undo(record: MachineRecord) -> None:
        record.disks.append(handoff.layer)
        record.parent, record.handoff = handoff.parent, None
    machine.update(undo)
    if machine.status() == "running":
        with machine.monitor() as mon:
            mon.cmd("cont")
