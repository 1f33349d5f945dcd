"""Capturing a running machine's memory, devices and disk as of one instant.

The guest is stopped (QEMU drains its disk requests), the disk's top layer is
frozen for good (a new empty layer takes later writes), and QEMU's background
snapshot starts: it saves CPU and device state, write-protects memory and lets
the guest run again, then streams memory while the guest runs on, saving each
page before the guest first writes to it. Memory, devices and disk are all from
the moment the guest stopped, whatever the guest was doing, and nothing inside
it needs to answer.

The stream goes to a splitter (see migstream.py), a detached process started
first and listening on a unix socket, so that no process is started while the
guest is stopped and the split finishes even if the caller dies. It writes a
raw memory image on tmpfs and a small device-state stream.

A restore saves the state it leaves differently: that guest never runs again, so it
stays stopped and its memory is written later (write_out), by a plain migration,
once the machine that replaces it is running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rewind.engine.memory import prefault
from rewind.engine.memory.migstream import PIPE_SIZE, SplitResult, StreamError, write_with_pages
from rewind.engine.memory.pagecapture import MappedMemory, PageImage
from rewind.engine.process import spawner
from rewind.engine.process.qemu import guest_ram_ranges, start_detached
from rewind.engine.process.qmp import Monitor, MonitorError
from rewind.store.locks import is_held

RAM_BLOCK = "ram0"  # the memory backend's id on the QEMU command line
CAPTURE_TIMEOUT = 300.0
SPLITTER_START_TIMEOUT = 30.0
MIGRATION_FD = "rewind-capture"  # the pipe's write end, as QEMU knows it (getfd)
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, Python 3.10+ on Linux
POPULATE_SLICE = 16 << 20  # about 10 ms of QEMU's main loop each (see populate)
# QEMU caps migration at 128 MiB/s by default (meant for live migration over a shared
# network); a capture written to local tmpfs has no reason to wait for that.
UNLIMITED_BANDWIDTH = {"max-bandwidth": 1 << 40}
KEEPS_RUN_STATE = (9, 0, 0)  # QEMU from here leaves a guest stopped after a background snapshot


@dataclass(frozen=True)
class PageOverlay:
    """The pages a capture by pages copied, loaded over the memory file its QEMU mapped: how a
    point runs before its own image is filled (see pagecapture.py)."""

    image: Path  # the capture's image, whose pages at `pages` are already written
    pages: list[tuple[int, int]]  # [first, last) page ranges
    ram_point: str | None  # the checkpoint whose memory file it goes over (None: a template's)


@dataclass(frozen=True)
class SavedState:
    """A running machine as saved: what a new QEMU needs to carry on from that moment."""

    ram: Path  # raw memory image on tmpfs, mapped copy-on-write
    devstate: Path  # device state, loaded with x-ignore-shared
    disks: list[Path]  # the disk's frozen layers, base first
    board: str  # the versioned QEMU board it was saved from (see qemu.QemuBuild)
    point: str | None = None  # the checkpoint it is (None: an image's booted template)
    over: PageOverlay | None = None  # pages loaded over `ram` with the device state

    @property
    def ram_point(self) -> str | None:
        """The checkpoint whose memory file `ram` is."""
        return self.point if self.over is None else self.over.ram_point


@contextlib.contextmanager
def incoming(state: SavedState, ram_bytes: int) -> Iterator[int]:
    """A descriptor of the stream a new QEMU loads to run `state`: its device-state file, or,
    with pages over its memory file, a pipe a thread fills (see migstream.write_with_pages)."""
    if state.over is None:
        with open(state.devstate, "rb") as f:
            yield f.fileno()
        return
    over = state.over
    image = os.open(over.image, os.O_RDONLY | os.O_CLOEXEC)
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    fcntl.fcntl(write_end, F_SETPIPE_SZ, PIPE_SIZE)
    failed: list[BaseException] = []

    def feed() -> None:
        try:
            write_with_pages(state.devstate, RAM_BLOCK, ram_bytes, image, over.pages, write_end)
        except BrokenPipeError:
            pass  # QEMU stopped reading: it says why
        except (OSError, StreamError) as e:  # said on the caller's thread, in place of QEMU's error
            failed.append(e)
        finally:
            os.close(write_end)
    feeder = threading.Thread(target=feed, name="rewind-overlay", daemon=True)
    try:
        feeder.start()
        yield read_end
    finally:
        os.close(read_end)  # a feeder still writing gets EPIPE
        feeder.join()
        os.close(image)
        if failed:  # the cause of a load that failed for want of its pages
            raise StreamError(f"the pages of {over.image} could not be sent to QEMU: {failed[0]}") \
                from failed[0]


@dataclass(frozen=True)
class Capture:
    """A capture under way: QEMU may still be writing memory out (see wait_written)."""

    ram: Path  # raw memory image (zero pages are holes)
    devstate: Path  # device state, loaded with x-ignore-shared over `ram`
    done: Path  # written by the splitter when the stream has ended, with its result
    pause_s: float | None  # how long the guest was paused (STOP to RESUME); None: stopped for good
    # Captured by pages (pagecapture.py): the [first, last) page ranges copied over the file
    # QEMU maps, read while the guest was stopped. None: migrated.
    written: list[tuple[int, int]] | None = None


def capture(mon: Monitor, *, live: bool, top_node: str, new_top_file: Path, new_top_node: str,
            ram_out: Path, devstate_out: Path, held: bool = False,
            by_pages: MappedMemory | None = None) -> Capture:
    """Capture the machine; its disk's writes go to `new_top_file` (an empty qcow2 without a
    backing file) afterwards. Returns once the moment is fixed.

    `live`: the guest runs on (returns when it does) while its memory is written out
    (wait_written waits for that). Otherwise the guest stays stopped for good and nothing
    is written yet: `write_out` does that later, for a caller that ends this QEMU (a
    restore, which saves the state it leaves once its new QEMU runs).

    `held` (with `live`): the guest stays stopped until its memory is all written, by a plain
    migration, and then runs on; for a caller that waits for the memory anyway (a trial's
    copy). It needs no populate() and is quicker: 0.75-0.86 s for an idle 512 MiB guest just
    restored, against 0.3 s of populate and 1.1-1.3 s of background write-out.

    `by_pages`: how QEMU maps the file its guest memory is copied-on-write from (see
    pagecapture.py); nothing is migrated then, `held` or not. The guest is stopped only while
    QEMU saves its devices alone and the pages it wrote are copied out; the image is filled
    from the file afterwards, in the background (until then the point runs from the file with
    those pages loaded over it: see PageOverlay)."""
    done = _done_file(devstate_out)
    done.unlink(missing_ok=True)
    if by_pages is not None:
        return _capture_by_pages(mon, by_pages, live=live, top_node=top_node,
                                 new_top_file=new_top_file, new_top_node=new_top_node, ram_out=ram_out,
                                 devstate_out=devstate_out)
    # The splitter, a Python process, starts while QEMU is set up below: waiting for it to be
    # ready took 70 ms of a 172 ms checkpoint call, and 37 ms of 157 ms started here.
    splitter = _Splitter.start(ram_out, devstate_out) if live else None
    try:
        if live:  # a capture that stops the guest for good writes nothing yet: it need not wait
            _finish_migration(mon)
        _attach_top(mon, new_top_file, new_top_node)
        uri = _prepare_migration(mon, splitter, background=not held) if splitter else None
    finally:
        if splitter is not None:
            splitter.close()  # QEMU has the pipe now (or, on an error, the splitter sees it end)

    mon.cmd("stop")
    try:
        mon.cmd("blockdev-snapshot", node=top_node, overlay=new_top_node)
        if uri is not None:
            mon.cmd("migrate", uri=uri)
    except BaseException:
        with contextlib.suppress(MonitorError):
            mon.cmd("cont")  # the machine survives a capture that failed
        raise
    if not live:
        return Capture(ram=ram_out, devstate=devstate_out, done=done, pause_s=None)
    stop = mon.wait_event("STOP", CAPTURE_TIMEOUT)
    if held:
        try:
            wait_written(done)
            mon.wait_migration(CAPTURE_TIMEOUT)
        finally:
            mon.cmd("cont")  # also when the write-out failed: the machine survives it
    elif mon.version >= KEEPS_RUN_STATE:
        try:
            _wait_tracking(devstate_out, done)
        finally:
            mon.cmd("cont")
    resume = mon.wait_event("RESUME", CAPTURE_TIMEOUT)
    return Capture(ram=ram_out, devstate=devstate_out, done=done,
                   pause_s=_event_time(resume) - _event_time(stop))


def _wait_tracking(devstate_out: Path, done: Path) -> None:
    """Wait until a background snapshot streams memory: its devices are saved and guest memory
    write-protected by then, so the guest may run. QEMU 7.2 restarted the guest itself at that
    point; from 9.0 it restores the run state it found (vm_resume of the state before the
    snapshot), and a guest we stopped stays stopped: no RESUME ever came (seen on 10.0.2)."""
    front, deadline, poll = front_file(devstate_out), time.monotonic() + CAPTURE_TIMEOUT, 0.0005
    while not done.exists():
        with contextlib.suppress(FileNotFoundError):
            if front.stat().st_size > 0:  # the splitter has the first pages
                return
        if time.monotonic() > deadline:
            raise StreamError(f"no memory came from QEMU within {CAPTURE_TIMEOUT:.0f} s")
        time.sleep(poll)
        poll = min(poll * 2, 0.005)


def _capture_by_pages(mon: Monitor, memory: MappedMemory, *, live: bool, top_node: str,
                      new_top_file: Path, new_top_node: str, ram_out: Path, devstate_out: Path) -> Capture:
    """capture() of memory mapped from a file: see capture and pagecapture.py. QEMU's
    device-only save is the QMP command `xen-save-devices-state`, generic despite its name;
    its stream has no RAM and no configuration section (see migstream.has_configuration)."""
    _finish_migration(mon)
    _attach_top(mon, new_top_file, new_top_node)
    image = PageImage(memory, ram_out, devstate_out, _done_file(devstate_out))
    try:
        mon.cmd("stop")
        try:
            mon.cmd("blockdev-snapshot", node=top_node, overlay=new_top_node)
            mon.cmd("xen-save-devices-state", filename=os.fspath(devstate_out), live=False)
            image.copy_written()
        except BaseException:
            with contextlib.suppress(MonitorError):
                mon.cmd("cont")  # the machine survives a capture that failed
            raise
        if live:
            mon.cmd("cont")
        image.fill_detached()
    finally:
        image.close()
    if not live:
        return Capture(ram=ram_out, devstate=devstate_out, done=image.done, pause_s=None, written=image.runs)
    stop, resume = mon.wait_event("STOP", CAPTURE_TIMEOUT), mon.wait_event("RESUME", CAPTURE_TIMEOUT)
    return Capture(ram=ram_out, devstate=devstate_out, done=image.done,
                   pause_s=_event_time(resume) - _event_time(stop), written=image.runs)


def _attach_top(mon: Monitor, new_top_file: Path, new_top_node: str) -> None:
    """Attach the empty layer a capture makes the disk's new top. By node, not by a backing
    file name written into it: layers move between directories, and QEMU's name for an
    explicit chain outgrows qcow2's field."""
    with contextlib.suppress(MonitorError):  # left attached by an interrupted checkpoint
        mon.cmd("blockdev-del", **{"node-name": new_top_node})
    mon.cmd("blockdev-add", driver="qcow2", backing=None,
            file={"driver": "file", "filename": os.fspath(new_top_file)}, **{"node-name": new_top_node})


def write_out(mon: Monitor, ram_out: Path, devstate_out: Path) -> None:
    """Start writing out the memory of a guest that capture(live=False) stopped for good, by
    a plain migration (faster than a background one); wait_written waits for it."""
    _finish_migration(mon)  # an earlier point's capture may still be writing (see restore)
    splitter = _Splitter.start(ram_out, devstate_out)
    try:
        mon.cmd("migrate", uri=_prepare_migration(mon, splitter, background=False))
    finally:
        splitter.close()


def _finish_migration(mon: Monitor) -> None:
    """Let a capture still running inside QEMU end first: one whose requester died, or a
    restored point's, whose guest a restore stopped for good meanwhile. (Never cancel a
    background snapshot: QEMU 7.2 can then leave guest memory write-protected and hang.)"""
    if mon.cmd("query-migrate").get("status") in ("setup", "active"):
        with contextlib.suppress(MonitorError):
            mon.wait_migration(CAPTURE_TIMEOUT)


def splitter_ended(devstate_out: Path) -> bool:
    """True if the splitter of this capture ended without writing its result (killed): it
    keeps its device state file locked while it runs (see migstream.main). False while none
    was started yet."""
    done = _done_file(devstate_out)
    try:
        # Looked for again after the lock: a splitter may write its result and exit between.
        return not done.exists() and not is_held(devstate_out) and not done.exists()
    except FileNotFoundError:
        return False


def write_out_started(ram_out: Path, devstate_out: Path) -> bool:
    """True once a splitter was started for this capture (its memory file or result exists):
    the memory is written, or being written, or that attempt failed for good."""
    return any(p.exists() for p in (ram_out, _done_file(devstate_out)))


def _prepare_migration(mon: Monitor, splitter: _Splitter, background: bool) -> str:
    """Set QEMU's migration up to stream to `splitter` once it is ready; returns the URI."""
    mon.cmd("migrate-set-capabilities", capabilities=[
        {"capability": "background-snapshot", "state": background},
        {"capability": "x-ignore-shared", "state": True}])
    mon.cmd("migrate-set-parameters", **UNLIMITED_BANDWIDTH)
    splitter.wait_ready()
    mon.send_fd(splitter.write_end, MIGRATION_FD)
    return f"fd:{MIGRATION_FD}"


def _done_file(devstate_out: Path) -> Path:
    return devstate_out.with_name(devstate_out.name + ".done")


def front_file(devstate_out: Path) -> Path:
    """Where a capture's splitter tells how much of its memory image is final (migstream's
    _Front); gone with the capture's result."""
    return devstate_out.with_name(devstate_out.name + ".front")


def populate(mon: Monitor, pid: int, memory_mib: int) -> None:
    """Have all guest memory of QEMU `pid` mapped while the guest runs. QEMU 7.2's background
    snapshot maps every page of memory before write-protecting it, with the guest stopped (we
    stop it to freeze the disk at the same moment): the first time in a QEMU process that
    takes about 0.2 s for 512 MiB, later a few ms. Doing it here first keeps that out of the
    pause. (QEMU 10.0.2 does the same read, measured here: 0.89 s of pause without this.)

    From outside QEMU (prefault.py) where this process may read QEMU's memory; else through
    QEMU, in slices that each hold its main lock briefly."""
    try:
        prefault.fault_in_guest_ram(pid, memory_mib)
        return
    except (LookupError, OSError):
        pass  # its memory not found by size, or no right to read it: QEMU reads it itself
    for start, size in guest_ram_ranges(memory_mib):
        for at in range(start, start + size, POPULATE_SLICE):
            mon.cmd("pmemsave", val=at, size=min(POPULATE_SLICE, start + size - at), filename="/dev/null")


def _populated_marker(state_dir: Path) -> Path:
    return state_dir / "populated"  # holds the PID of the QEMU whose memory was read


def populates_itself(qemu: tuple[int, int, int]) -> bool:
    """True where populate() would only lengthen the call: QEMU from 9 maps all guest memory
    itself in the pause too, but quickly. Measured on 10.0.2 (Linux 6.18), the first
    checkpoint past the by-pages limit, populate() against none: 512 MiB with 100 MiB written,
    call 0.18 against 0.13 s, pause 30 against 41 ms; 1536 MiB with 1 GiB written, call 0.29
    against 0.17 s, pause 39 against 49 ms."""
    return qemu >= KEEPS_RUN_STATE


def ensure_populated(mon: Monitor, state_dir: Path, pid: int, memory_mib: int) -> None:
    """populate() once per QEMU process where it needs it: `state_dir` (the machine's, kept
    across renames) says which QEMU was done. Only a background snapshot needs it: a machine
    whose memory is a file and that wrote little of it is captured by pages (pagecapture.py)."""
    if populates_itself(mon.version):
        return
    if _reads(_populated_marker(state_dir)) != str(pid):
        populate(mon, pid, memory_mib)
        mark_populated(state_dir, pid)


def mark_populated(state_dir: Path, pid: int) -> None:
    """Say that QEMU `pid` has all guest memory mapped: populated, or just migrated whole (a
    held capture reads every page)."""
    _populated_marker(state_dir).write_text(str(pid))


def populate_need(mon: Monitor, state_dir: Path, pid: int, ram_file: str | None) -> int:
    """The bytes of tmpfs populate() would take: a fault on a hole of the memory file QEMU
    maps allocates a page there, even a read fault of a copy-on-write mapping, and a QEMU
    whose file cannot grow dies of SIGBUS (seen: populating a machine on a 420 MiB tmpfs).
    0 once this QEMU is populated, where it needs none, or when its memory is not a file."""
    if ram_file is None or populates_itself(mon.version) or _reads(_populated_marker(state_dir)) == str(pid):
        return 0
    try:
        st = os.stat(ram_file)
    except OSError:
        return 0
    return max(0, st.st_size - st.st_blocks * 512)


def _reads(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class _Splitter:
    """The detached process that splits a migration stream (migstream.py), reading a pipe
    whose write end goes to QEMU. Its memory file is opened here (made now, so a second
    write-out sees this one; open, so nothing can take it from under the splitter)."""

    def __init__(self, write_end: int, ready: int) -> None:
        self.write_end = write_end
        self._ready = ready

    @classmethod
    def start(cls, ram_out: Path, devstate_out: Path) -> _Splitter:
        for stale in (_done_file(devstate_out), front_file(devstate_out)):
            stale.unlink(missing_ok=True)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a bigger pipe if this host allows it
            fcntl.fcntl(write_end, F_SETPIPE_SZ, PIPE_SIZE)
        ram_fd = os.open(ram_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        args = [RAM_BLOCK, str(devstate_out), str(_done_file(devstate_out)), str(front_file(devstate_out))]
        try:
            # Forked by the home's spawner (ram_out lies in its runtime folder's ram/, see
            # checkpoint.Caches) where it answers: a fresh Python took 0.07 s of CPU here,
            # as the guest was about to be stopped.
            request = spawner.Request("split", ["{fd0}", "{fd1}", *args, "{fd2}"])
            forked = spawner.spawn(ram_out.parent.parent, request, fds=(read_end, ram_fd, ready_w))
            if forked is None:
                start_detached([sys.executable, "-m", "rewind.engine.memory.migstream", str(read_end),
                                str(ram_fd), *args, str(ready_w)], pass_fds=(read_end, ram_fd, ready_w))
        except BaseException:
            for fd in (write_end, ready_r):
                os.close(fd)
            raise
        finally:
            for fd in (read_end, ram_fd, ready_w):
                os.close(fd)
        return cls(write_end, ready_r)

    def wait_ready(self) -> None:
        """Return once it reads: one still starting while the guest is stopped competed for
        the CPU and lengthened the pause (80 ms against 50 ms with 1 GiB in use)."""
        if not select.select([self._ready], [], [], SPLITTER_START_TIMEOUT)[0]:
            raise StreamError(f"the memory splitter did not start within {SPLITTER_START_TIMEOUT:.0f} s")
        if os.read(self._ready, 1) != b"r":
            raise StreamError("the memory splitter ended as it started")

    def close(self) -> None:
        """Let go of our ends: QEMU holds the stream's once it was given it."""
        for fd in (self.write_end, self._ready):
            with contextlib.suppress(OSError):
                os.close(fd)


def wait_written(done: Path, timeout: float = CAPTURE_TIMEOUT,
                 check: Callable[[], None] = lambda: None) -> SplitResult:
    """Wait until a capture's memory is all written; StreamError if that failed. `check`
    raises if it never will be."""
    deadline = time.monotonic() + timeout
    while not done.exists():
        _waited(check, deadline, timeout)
    result = json.loads(done.read_text())
    if "error" in result:
        raise StreamError(f"splitting the memory stream failed: {result['error']}")
    return SplitResult(**result)


def follow_written(devstate: Path, timeout: float = CAPTURE_TIMEOUT,
                   check: Callable[[], None] = lambda: None) -> Callable[[int], int] | None:
    """For a capture whose memory is still being written out by its splitter: a function that
    waits until the first n bytes of its image are final and returns how many are (all, once
    the write-out has ended; StreamError if it failed), for a committer that stores memory as
    it comes. None once the memory is all written, or if it never tells a front (a capture by
    pages: its image is filled otherwise). Waits for one or the other; `check` raises if
    neither will come."""
    done, front = _done_file(devstate), front_file(devstate)
    deadline = time.monotonic() + timeout
    while not front.exists():
        if done.exists():
            return None
        _waited(check, deadline, timeout)

    def written(n: int) -> int:
        while True:
            try:
                at = os.stat(front).st_size
            except FileNotFoundError:
                at = 0
            if at >= n:
                return at
            if done.exists():
                wait_written(done)  # raises if the write-out failed
                return sys.maxsize
            _waited(check, deadline, timeout)
    return written


def _waited(check: Callable[[], None], deadline: float, timeout: float) -> None:
    """A poll's pause, after `check`; StreamError past `deadline`."""
    check()
    if time.monotonic() > deadline:
        raise StreamError(f"the memory stream was not written within {timeout:.0f} s")
    time.sleep(0.005)


def _event_time(event: dict) -> float:
    stamp = event["timestamp"]
    return stamp["seconds"] + stamp["microseconds"] / 1e6

