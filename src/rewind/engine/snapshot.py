"""Capturing a running machine's memory, devices and disk as of one instant.

The guest's root file system is frozen through the agent first (flushed; no
writes can start), so the disk cannot change until it is thawed. Then the
disk's top layer is frozen for good (a new empty layer takes the writes) and
QEMU's background snapshot starts: it pauses the guest only to save CPU and
device state and to write-protect memory, and streams memory while the guest
runs on. Once QEMU reports the guest running again, the file system is thawed.
Memory and devices are from the pause, the disk from the freeze, and nothing
reached the disk in between, so the two agree.

The stream is split as it arrives (see migstream.py), by a process QEMU itself
runs, into a raw memory image on tmpfs and a small device-state stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rewind.engine.agent import AgentClient
from rewind.engine.migstream import SplitResult, StreamError
from rewind.engine.qmp import Monitor, MonitorError

RAM_BLOCK = "ram0"  # the memory backend's id on the QEMU command line
CAPTURE_TIMEOUT = 300.0
# QEMU caps migration at 128 MiB/s by default (meant for live migration over a shared
# network); a capture written to local tmpfs has no reason to wait for that.
UNLIMITED_BANDWIDTH = {"max-bandwidth": 1 << 40}


@dataclass(frozen=True)
class SavedState:
    """A running machine as saved: what a new QEMU needs to carry on from that moment."""

    ram: Path  # raw memory image on tmpfs, mapped copy-on-write
    devstate: Path  # device state, loaded with x-ignore-shared
    disks: list[Path]  # the disk's frozen layers, base first


@dataclass(frozen=True)
class Capture:
    """A capture under way: QEMU may still be writing memory out (see wait_written)."""

    ram: Path  # raw memory image (zero pages are holes)
    devstate: Path  # device state, loaded with x-ignore-shared over `ram`
    done: Path  # written by the splitter when the stream has ended, with its result
    pause_s: float | None  # how long the guest was paused (STOP to RESUME); None: stopped for good


def capture(mon: Monitor, agent: AgentClient | None, *, top_node: str, new_top_file: Path,
            new_top_node: str, ram_out: Path, devstate_out: Path) -> Capture:
    """Capture the machine; its disk's writes go to `new_top_file` (an empty qcow2 without a
    backing file) afterwards. Returns once the moment is fixed; memory is still being written
    (wait_written waits for it).

    With the guest agent, the capture is live: it returns when the guest runs again. Without
    it, the guest is stopped for good, for a caller that ends this QEMU next (a restore saving
    the state it leaves): a stopped guest's memory and disk agree as they are, and a plain
    migration of it is faster than a background one."""
    done = devstate_out.with_name(devstate_out.name + ".done")
    done.unlink(missing_ok=True)
    splitter = " ".join(shlex.quote(str(a)) for a in (
        sys.executable, "-m", "rewind.engine.migstream", RAM_BLOCK, ram_out, devstate_out, done))
    # A capture whose requester died runs on inside QEMU; let it end first. (Never cancel a
    # background snapshot: QEMU 7.2 can then leave guest memory write-protected and hang.)
    if mon.cmd("query-migrate").get("status") in ("setup", "active"):
        with contextlib.suppress(MonitorError):
            mon.wait_migration(CAPTURE_TIMEOUT)
    mon.cmd("migrate-set-capabilities", capabilities=[
        {"capability": "background-snapshot", "state": agent is not None},
        {"capability": "x-ignore-shared", "state": True}])
    mon.cmd("migrate-set-parameters", **UNLIMITED_BANDWIDTH)
    # The new top is attached by node, not by a backing file name written into it: layers
    # move between directories, and QEMU's name for an explicit chain outgrows qcow2's field.
    with contextlib.suppress(MonitorError):  # left attached by an interrupted checkpoint
        mon.cmd("blockdev-del", **{"node-name": new_top_node})
    mon.cmd("blockdev-add", driver="qcow2", backing=None,
            file={"driver": "file", "filename": os.fspath(new_top_file)}, **{"node-name": new_top_node})

    def start() -> None:
        mon.cmd("blockdev-snapshot", node=top_node, overlay=new_top_node)
        mon.cmd("migrate", uri=f"exec:{splitter}")

    if agent is None:
        mon.cmd("stop")
        try:
            start()
        except BaseException:
            with contextlib.suppress(MonitorError):
                mon.cmd("cont")  # the machine survives a capture that failed
            raise
        return Capture(ram=ram_out, devstate=devstate_out, done=done, pause_s=None)
    with agent.frozen():
        start()
        stop = mon.wait_event("STOP", CAPTURE_TIMEOUT)
        resume = mon.wait_event("RESUME", CAPTURE_TIMEOUT)
    return Capture(ram=ram_out, devstate=devstate_out, done=done,
                   pause_s=_event_time(resume) - _event_time(stop))


def wait_written(done: Path, timeout: float = CAPTURE_TIMEOUT) -> SplitResult:
    """Wait until a capture's memory is all written; StreamError if that failed."""
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise StreamError(f"the memory stream was not written within {timeout:.0f} s")
        time.sleep(0.005)
    result = json.loads(done.read_text())
    if "error" in result:
        raise StreamError(f"splitting the memory stream failed: {result['error']}")
    return SplitResult(**result)


def _event_time(event: dict) -> float:
    stamp = event["timestamp"]
    return stamp["seconds"] + stamp["microseconds"] / 1e6
