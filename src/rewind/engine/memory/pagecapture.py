"""Capturing a machine whose memory is a file it maps copy-on-write, by the pages it wrote.

A machine started from a point (or from its image's template) maps that memory file
privately: each page its guest has written is its own copy, every other page is still the
file's, and pagemap.py tells which. Its memory at an instant is therefore the file with
those pages over it. So a capture need not migrate all memory: the guest is stopped while
QEMU saves its devices alone and the pages it wrote are copied out of QEMU's memory into the
new image, at their offsets, then it runs on (or stays stopped, for a restore). The rest of
the image, the file's unchanged data, is filled in afterwards by a detached assembler
(`main`). Until then the point runs from the file QEMU mapped with the pages loaded over it
(snapshot.PageOverlay), so nothing waits for the fill. Whoever fills it
writes the capture's result last, as the splitter does for a migrated capture, and holds
the device-state file locked until then (see snapshot.splitter_ended).

Measured here on a 512 MiB guest just restored that had written 8 MiB: paused 14 ms, the
image filled in 0.07-0.25 s; a held migration paused it 0.66-0.86 s, and a background one
needs all memory populated first. Past WRITTEN_LIMIT a live capture migrates instead (see
snapshot.capture): copying more would pause the guest longer than a background snapshot.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

from rewind import crashpoints
from rewind.engine.memory import pagemap
from rewind.engine.memory.migstream import SplitResult, StreamError, write_result
from rewind.engine.memory.prefault import PAGE
from rewind.engine.process import spawner
from rewind.engine.process.qemu import start_detached
from rewind.store.locks import acquire

# Pages copied while the guest is stopped go at about 1 GiB/s here (8 MiB in 9 ms).
WRITTEN_LIMIT = 64 << 20
_BLOCK = 4 << 20
_PIECE = 64 << 10
_ZEROS = bytes(_PIECE)


@dataclass(frozen=True)
class MappedMemory:
    """Guest memory that QEMU `pid` maps copy-on-write from `file`, at address `start`."""

    pid: int
    file: Path
    start: int
    size: int


def mapped_memory(pid: int, file: Path, size: int, limit: int | None) -> MappedMemory | None:
    """How QEMU `pid` maps `file` as its `size` bytes of guest memory, if a capture by pages
    suits it: it does map it, and has written at most `limit` bytes of it (None: any)."""
    try:
        memory = MappedMemory(pid, file, pagemap.file_mapping(pid, size, file), size)
        written = sum(last - first for first, last in pagemap.changed_pages(pid, memory.start, size)) * PAGE
    except (LookupError, OSError):
        return None
    return memory if limit is None or written <= limit else None


class PageImage:
    """The memory image of one capture by pages, from the moment its device state is about to
    be saved until it is handed to an assembler that fills it (fill_detached)."""

    def __init__(self, memory: MappedMemory, ram_out: Path, devstate_out: Path, done: Path) -> None:
        self.memory, self.done = memory, done
        self.cpu_s = time.process_time()
        self.runs: list[tuple[int, int]] = []
        # Locked until the result is written: a waiter that finds it unlocked with no result
        # knows its filler died. Made here 0600; QEMU's save truncates it and keeps the mode.
        lock = acquire(devstate_out, exclusive=True, timeout=0)
        if lock is None:
            raise StreamError(f"another capture is writing {devstate_out}")
        self._lock = lock
        # Open from here on: a cache trim may take its name once no QEMU maps it.
        self._base = os.open(memory.file, os.O_RDONLY | os.O_CLOEXEC)
        self._ram = os.open(ram_out, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._ram, memory.size)
        self._devstate = devstate_out
        self._runtime = ram_out.parent.parent  # the spawner's (see checkpoint.Caches)

    def copy_written(self) -> None:
        """Copy the pages the guest wrote into the image. Only while its guest is stopped."""
        m = self.memory
        self.runs = pagemap.copy_changed(m.pid, m.start, m.size, self._ram)

    def fill_detached(self) -> None:
        """Have a detached assembler fill the image and write the result: it outlives this
        process. Its runs go through a memfd, with the file, the image and the lock."""
        runs = os.memfd_create("rewind-runs", os.MFD_CLOEXEC)
        try:
            os.write(runs, array("Q", [n for run in self.runs for n in run]).tobytes())
            args = [str(self.done), str(self._devstate), f"{time.process_time() - self.cpu_s:.4f}"]
            fds = (self._base, self._ram, self._lock, runs)
            request = spawner.Request("assemble", ["{fd0}", "{fd1}", "{fd2}", "{fd3}", *args])
            if spawner.spawn(self._runtime, request, fds=fds) is None:
                start_detached([sys.executable, "-m", "rewind.engine.memory.pagecapture", *map(str, fds),
                                *args], pass_fds=fds)
        finally:
            os.close(runs)

    def close(self) -> None:
        """Let go of this process's hold (an assembler keeps its own)."""
        for fd in (self._base, self._ram, self._lock):
            with contextlib.suppress(OSError):
                os.close(fd)


def _fill_and_report(base: int, image: int, runs: list[tuple[int, int]], done: Path, devstate: Path,
                     cpu_s: float) -> None:
    """Copy the data of file `base` outside `runs` (pages already written) into `image`;
    write the result."""
    try:
        _fill(base, image, runs)
        result: dict = asdict(SplitResult(
            ram_bytes=os.fstat(image).st_size, pages_written=sum(last - first for first, last in runs),
            zero_pages=0, devstate_bytes=devstate.stat().st_size, cpu_s=round(cpu_s, 4)))
    except OSError as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    write_result(done, result)


def _fill(source: int, image: int, runs: list[tuple[int, int]]) -> None:
    size = os.fstat(image).st_size
    gaps = zip([0, *(last * PAGE for _, last in runs)], [*(first * PAGE for first, _ in runs), size],
               strict=True)
    for start, end in gaps:
        pos = start
        while pos < end:
            try:
                data = os.lseek(source, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                return
            if data >= end:
                break
            hole = min(os.lseek(source, data, os.SEEK_HOLE), end)
            for at in range(data, hole, _BLOCK):
                _write_nonzero(image, os.pread(source, min(_BLOCK, hole - at), at), at)
            pos = hole


def _write_nonzero(image: int, block: bytes, at: int) -> None:
    """Write `block` at `at`, its zero pieces left as holes: a file that was read through a
    mapping is dense, zero pages and all, and the image would be too (a splitter leaves zero
    pages out). Comparing 64 KiB slices costs about 25 ms per 512 MiB here."""
    start = None
    for off in range(0, len(block) + _PIECE, _PIECE):
        zero = off >= len(block) or block[off:off + _PIECE] == _ZEROS[:len(block) - off]
        if zero and start is not None:
            os.pwrite(image, block[start:off], at + start)
            start = None
        elif not zero and start is None:
            start = off


def main(argv: list[str]) -> int:
    """The assembler: `python -m rewind.engine.memory.pagecapture BASE_FD IMAGE_FD LOCK_FD RUNS_FD DONE
    DEVSTATE CPU_S`, with the mapped file and the image open, the device state's lock held and
    the written pages' runs in a memfd (see PageImage.fill_detached)."""
    crashpoints.arm("split")
    base, image, lock, runs_fd = (int(a) for a in argv[:4])
    done, devstate, cpu_s = argv[4:7]
    flat = array("Q", os.pread(runs_fd, os.fstat(runs_fd).st_size, 0))
    os.close(runs_fd)
    runs = list(zip(flat[0::2], flat[1::2], strict=True))
    started = time.process_time()
    _fill_and_report(base, image, runs, Path(done), Path(devstate),
                     float(cpu_s) + time.process_time() - started)
    for fd in (base, image, lock):
        os.close(fd)
    return 0


def run() -> None:
    """main() with this process's arguments (`python -m`, or forked by the spawner)."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
