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
    ram: Path  # raw memory image (zero pages are holes)
    devstate: Path  # device state, loaded with x-ignore-shared over `ram`
    pause_s: float  # how long the guest was paused (QEMU's STOP to RESUME)
    seconds: float  # from the start of the capture until everything was written
    split: SplitResult


def capture(mon: Monitor, agent: AgentClient | None, *, top_node: str, new_top_file: Path,
            new_top_node: str, ram_out: Path, devstate_out: Path) -> Capture:
    """Capture the machine; its disk's writes go to `new_top_file` (an empty qcow2 without a
    backing file) afterwards.

    With the guest agent, the capture is live (the guest runs on). Without it, the guest is
    stopped for good, for a caller that ends this QEMU next (a restore saving the state it
    leaves): a stopped guest's memory and disk agree as they are, and a plain migration of
    it is faster than a background one."""
    started = time.monotonic()
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
        stopped = time.time()
        try:
            start()
            mon.wait_migration(CAPTURE_TIMEOUT)
        except BaseException:
            with contextlib.suppress(MonitorError):
                mon.cmd("cont")  # the machine survives a capture that failed
            raise
        pause_s = time.time() - stopped
    else:
        with agent.frozen():
            start()
            stop = mon.wait_event("STOP", CAPTURE_TIMEOUT)
            resume = mon.wait_event("RESUME", CAPTURE_TIMEOUT)
        mon.wait_migration(CAPTURE_TIMEOUT)
        pause_s = _event_time(resume) - _event_time(stop)
    result = _wait_for(done, CAPTURE_TIMEOUT)
    if "error" in result:
        raise StreamError(f"splitting the memory stream failed: {result['error']}")
    return Capture(ram=ram_out, devstate=devstate_out, pause_s=pause_s,
                   seconds=time.monotonic() - started, split=SplitResult(**result))


def _wait_for(done: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise StreamError(f"the memory stream was not split within {timeout:.0f} s")
        time.sleep(0.005)
    result = json.loads(done.read_text())
    done.unlink()
    return result


def _event_time(event: dict) -> float:
    stamp = event["timestamp"]
    return stamp["seconds"] + stamp["microseconds"] / 1e6
