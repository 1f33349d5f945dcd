"""Splitting a QEMU migration stream into a raw RAM image and a small device-state stream.

A checkpoint is taken with QEMU's `background-snapshot` migration: the guest is
paused only while its devices are captured, then runs on while its RAM is
written out. That stream is one opaque file; restoring from it means loading
every page again, and nothing is shared between machines. So as the stream
arrives, the pages of the guest's main RAM block are written to a raw,
page-aligned file (sparse where pages are zero) and dropped from the stream;
everything else (small RAM blocks such as ROMs and ACPI tables, and the device
state QEMU appends after RAM) is kept. A new QEMU then maps the raw file
copy-on-write as its RAM and loads the small stream with `x-ignore-shared`,
which makes it expect the main block's pages from the file instead.

Format handled: QEMU 7.2 and 10.0 precopy without multifd, compression or xbzrle
(what rewind enables), file version 3, with section footers. Background snapshots
write the device state (saved at the pause) after all RAM, so once the RAM
sections end the rest is copied through unparsed. A plain migration on QEMU 10
sends a command (switchover start) before RAM's last part; it is kept in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rewind import crashpoints
from rewind.errors import RewindError
from rewind.store.locks import acquire

PAGE_SIZE = 4096
# The stream comes through a pipe, not a socket: a background snapshot flushes after every
# page (before it lifts that page's write protection), and through a unix socket each
# flush was one receive, 100,000 of them for an idle 512 MiB guest and 0.5 s of the
# splitter's 0.8 s of CPU. A pipe joins small writes into its pages.
PIPE_SIZE = 1 << 20
# A read smaller than this waits half a millisecond for more: enough to join an idle guest's
# page-by-page writes (its splitter's CPU went from 0.6 to 0.3 s); a 2 ms wait on reads under
# 128 KiB slowed a 1 GiB stream from 3.9 to 5.4 s.
SMALL_READ = 64 << 10
FILE_MAGIC = 0x5145564D
FILE_VERSION = 3
SECTION_START, SECTION_PART, SECTION_END = 0x01, 0x02, 0x03
SECTION_CONFIGURATION = 0x07
SECTION_COMMAND = 0x08
SECTION_FOOTER = 0x7E

FLAG_ZERO = 0x02
FLAG_MEM_SIZE = 0x04
FLAG_PAGE = 0x08
FLAG_EOS = 0x10
FLAG_CONTINUE = 0x20
FLAG_UNSUPPORTED = 0x40 | 0x80 | 0x100  # xbzrle, hook (rdma), compressed pages
FLAGS_MASK = PAGE_SIZE - 1


class StreamError(RewindError):
    """The migration stream is not one this module understands."""


@dataclass(frozen=True)
class SplitResult:
    ram_bytes: int  # size of the main RAM block
    pages_written: int  # non-zero pages written to the raw file
    zero_pages: int
    devstate_bytes: int  # size of the stream kept
    cpu_s: float = 0.0  # CPU the splitter process used
    # Pages the stream sent again after they were written (a migration's later pass): the
    # front it told was wrong, so what was read below it must be read again.
    pages_resent: int = 0


class _Reader:
    """Buffered reads with offsets into one large buffer (per-record slicing is the cost)."""

    def __init__(self, src: BinaryIO | PipeSource) -> None:
        self._src = src
        self.buf = b""
        self.pos = 0

    def ensure(self, n: int) -> None:
        """At least `n` bytes are buffered from `pos` on."""
        if self.pos + n <= len(self.buf):
            return
        parts = [self.buf[self.pos :]]
        have = len(parts[0])
        while have < n:
            more = self._src.read(max(n - have, 1 << 20))
            if not more:
                raise StreamError("the migration stream ended early")
            parts.append(more)
            have += len(more)
        self.buf, self.pos = b"".join(parts), 0

    def read(self, n: int) -> bytes:
        self.ensure(n)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def view(self, n: int) -> memoryview:
        """The next `n` bytes without copying them (valid while the caller holds the view)."""
        self.ensure(n)
        out = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        self.ensure(1)
        self.pos += 1
        return self.buf[self.pos - 1]

    def be32(self) -> int:
        self.ensure(4)
        self.pos += 4
        return _BE32.unpack_from(self.buf, self.pos - 4)[0]

    def be64(self) -> int:
        self.ensure(8)
        self.pos += 8
        return _BE64.unpack_from(self.buf, self.pos - 8)[0]

    def peek_u8(self) -> int:
        self.ensure(1)
        return self.buf[self.pos]

    def rest(self) -> bytes:
        """Everything left: what is buffered, then the source to its end."""
        out = self.buf[self.pos :] + self._src.read()
        self.buf, self.pos = b"", 0
        return out


class PipeSource:
    """Reads a pipe in large pieces: when it holds little, wait a moment for the writer to
    add more (QEMU writes a page at a time; the pipe holds up to PIPE_SIZE meanwhile)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, n: int = -1) -> bytes:
        parts, have = [], 0
        while n < 0 or have < n:
            chunk = os.read(self.fd, PIPE_SIZE if n < 0 else n - have)
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
            if len(chunk) < SMALL_READ:
                time.sleep(0.0005)
        return b"".join(parts)


_BE32, _BE64 = struct.Struct(">I"), struct.Struct(">Q")
_IOV_MAX = 1024


# The front is told at most this often (in pages): 4 MiB, a few milliseconds of the stream.
FRONT_STEP = (4 << 20) // PAGE_SIZE


class _Front:
    """Which pages of the main block are final in the image, and how much of the image from its
    start is: told to `tell` (in bytes) every FRONT_STEP pages and at the end. A committer
    stores memory up to the front while the rest is still coming (see pending.py): QEMU sends
    RAM in address order, a page a guest writes meanwhile ahead of its turn, each page once."""

    def __init__(self, tell: Callable[[int], None]) -> None:
        self._tell = tell
        self.pages = bytearray()  # 1 for a page written (or a hole that stays one)
        self.front = self.told = 0  # in pages
        self.resent = 0

    def size(self, pages: int) -> None:
        self.pages = bytearray(pages)

    def mark(self, first: int, last: int) -> None:
        """Pages [first, last) are final."""
        if last > len(self.pages):
            raise StreamError(f"a page at {last * PAGE_SIZE:#x} lies past the end of the RAM block")
        self.resent += self.pages.count(1, first, last)
        self.pages[first:last] = b"\x01" * (last - first)
        if first <= self.front:
            found = self.pages.find(0, self.front)
            self.front = len(self.pages) if found < 0 else found
            if self.front - self.told >= FRONT_STEP:
                self.tell()

    def tell(self) -> None:
        self._tell(self.front * PAGE_SIZE)
        self.told = self.front


class _RunWriter:
    """Writes pages to the raw file, one pwritev per run of consecutive pages."""

    def __init__(self, fd: int, front: _Front) -> None:
        self.fd = fd
        self.start = self.next = -1
        self.parts: list[memoryview | bytes] = []
        self.front = front

    def page(self, addr: int, data: memoryview | bytes) -> None:
        if addr != self.next or len(self.parts) == _IOV_MAX:
            self.flush()
            self.start = addr
        self.parts.append(data)
        self.next = addr + PAGE_SIZE

    def flush(self) -> None:
        if self.parts:
            os.pwritev(self.fd, self.parts, self.start)
            self.front.mark(self.start // PAGE_SIZE, self.next // PAGE_SIZE)
            self.parts.clear()
        self.next = -1


_CONTINUED_ZERO, _CONTINUED_PAGE = FLAG_CONTINUE | FLAG_ZERO, FLAG_CONTINUE | FLAG_PAGE
# A run of zero-page records continuing the main block, matched in C rather than record by
# record in Python: each is 9 bytes, a big-endian word whose low 12 bits are the flags
# (0x022: the last byte, and the low half of the one before) and a fill byte of 0. Most of
# a guest's memory is zero pages: record by record they took most of the splitter's time.
_ZERO_RUN = re.compile(b"(?:.{6}[" + b"".join(b"\\x%02x" % (i << 4) for i in range(16)) + b"]\\x22\\x00)+",
                       re.DOTALL)


def _main_block_run(r: _Reader, pages_out: _RunWriter, zeros: int, pages: int) -> tuple[int, int]:
    """The common case, in a tight loop: buffered records continuing the main block, each a
    zero page or a whole page. Stops at anything else, for the general loop to handle."""
    buf, pos = r.buf, r.pos
    view, last = memoryview(buf), len(buf) - (8 + PAGE_SIZE)
    unpack, page, zero_run = _BE64.unpack_from, pages_out.page, _ZERO_RUN.match
    while pos <= last:
        word = unpack(buf, pos)[0]
        flags = word & FLAGS_MASK
        if flags == _CONTINUED_ZERO and buf[pos + 8] == 0:
            end = zero_run(buf, pos).end()  # matches: this record is one
            zeros += (end - pos) // 9
            _mark_zero_run(buf, pos, end, pages_out.front)
            pos = end
        elif flags == _CONTINUED_PAGE:
            page(word & ~FLAGS_MASK, view[pos + 8 : pos + 8 + PAGE_SIZE])
            pages += 1
            pos += 8 + PAGE_SIZE
        else:
            break
    r.pos = pos
    return zeros, pages


def _mark_zero_run(buf: bytes, pos: int, end: int, front: _Front) -> None:
    """Mark the zero pages of the records in buf[pos:end]: at once if their addresses follow
    each other (the usual case), else one by one."""
    first, last = (_BE64.unpack_from(buf, at)[0] // PAGE_SIZE for at in (pos, end - 9))
    if last - first == (end - pos) // 9 - 1:
        front.mark(first, last + 1)
        return
    for at in range(pos, end, 9):
        page = _BE64.unpack_from(buf, at)[0] // PAGE_SIZE
        front.mark(page, page + 1)


def split_stream(src: BinaryIO | PipeSource, ram_block: str, ram_out: int,
                 devstate_out: BinaryIO, front: Callable[[int], None] = lambda _: None) -> SplitResult:
    """Read a migration stream from `src`; write the pages of `ram_block` into the file
    descriptor `ram_out` (which must be empty; it is given the block's size first, and zero
    pages are left as holes) and the rest of the stream to `devstate_out`. `front` is told,
    in order, how many bytes of the image from its start are final (see _Front)."""
    r = _Reader(src)
    out = devstate_out
    kept = 0

    def put(data: bytes) -> None:
        nonlocal kept
        out.write(data)
        kept += len(data)

    if r.be32() != FILE_MAGIC or r.be32() != FILE_VERSION:
        raise StreamError("not a QEMU migration stream (bad magic or version)")
    put(struct.pack(">II", FILE_MAGIC, FILE_VERSION))
    # The configuration section (machine type, capabilities) holds nested
    # structures; copy bytes through until the RAM section starts.
    marker = bytes([len("ram")]) + b"ram"
    head = b""
    while True:
        head += r.read(1)
        if head.endswith(marker) and len(head) >= 9 and head[-9] == SECTION_START:
            break
        if len(head) > 4096:
            raise StreamError("no RAM section at the start of the migration stream")
    put(head[:-9])
    ram_section = struct.unpack(">I", head[-8:-4])[0]
    put(head[-9:])
    put(r.read(8))  # instance id, version id

    ram_bytes = pages = zeros = 0
    progress = _Front(front)
    pages_out = _RunWriter(ram_out, progress)
    block = b""
    in_main = False
    section_type = SECTION_START
    while True:
        # One RAM section's payload, up to its EOS.
        while True:
            if in_main:
                zeros, pages = _main_block_run(r, pages_out, zeros, pages)
            word = r.be64()
            flags, addr = word & FLAGS_MASK, word & ~FLAGS_MASK
            if flags & FLAG_UNSUPPORTED:
                raise StreamError(f"unsupported RAM record flags {flags:#x} (compression or xbzrle?)")
            if flags & FLAG_MEM_SIZE:
                put(struct.pack(">Q", word))
                total = 0
                while total < addr:
                    name = r.read(r.u8())
                    length = r.be64()
                    put(bytes([len(name)]) + name + struct.pack(">Q", length))
                    put(r.read(8))  # block address, sent because x-ignore-shared is on
                    if name.decode() == ram_block:
                        ram_bytes = length
                    total += length
                if not ram_bytes:
                    raise StreamError(f"the stream has no RAM block named {ram_block!r}")
                os.ftruncate(ram_out, ram_bytes)  # before any front is told (see follow_written)
                progress.size(ram_bytes // PAGE_SIZE)
            if flags & (FLAG_ZERO | FLAG_PAGE):
                if not flags & FLAG_CONTINUE:
                    block = r.read(r.u8())
                    in_main = block.decode() == ram_block
                if flags & FLAG_ZERO:
                    fill = r.read(1)
                    if in_main:
                        if fill != b"\0":
                            pages_out.page(addr, fill * PAGE_SIZE)
                        else:
                            progress.mark(addr // PAGE_SIZE, addr // PAGE_SIZE + 1)
                        zeros += 1
                    else:
                        put(struct.pack(">QB", addr | FLAG_ZERO, len(block)) + block + fill)
                elif in_main:
                    pages_out.page(addr, r.view(PAGE_SIZE))
                    pages += 1
                else:
                    put(struct.pack(">QB", addr | FLAG_PAGE, len(block)) + block + r.read(PAGE_SIZE))
            if flags & FLAG_EOS:
                put(struct.pack(">Q", FLAG_EOS))
                break
        if r.peek_u8() == SECTION_FOOTER:
            put(r.read(5))
        while r.peek_u8() == SECTION_COMMAND:  # QEMU 10's switchover start, before RAM's last part
            command = r.read(5)  # type, command (be16), length (be16), then its data
            put(command + r.read(struct.unpack(">H", command[3:])[0]))
        if section_type == SECTION_END or r.peek_u8() not in (SECTION_PART, SECTION_END):
            break  # a background snapshot goes from its last RAM part straight to the devices
        section_type = r.u8()
        if r.be32() != ram_section:
            raise StreamError("a section of another device interrupts the RAM data")
        put(bytes([section_type]) + struct.pack(">I", ram_section))
    pages_out.flush()
    progress.tell()
    put(r.rest())
    os.ftruncate(ram_out, ram_bytes)
    return SplitResult(ram_bytes=ram_bytes, pages_written=pages, zero_pages=zeros, devstate_bytes=kept,
                       pages_resent=progress.resent)


_RAM_SECTION = 0xFFFF0000  # a section id no device of a device-only save has
_PAGE_BATCH = 256  # pages per writev


def write_with_pages(devstate: Path, ram_block: str, ram_bytes: int, image: int,
                     pages: list[tuple[int, int]], out: int) -> None:
    """Write to `out` a migration stream that loads the device-only stream `devstate` after the
    pages `pages` ([first, last) page ranges) of the file descriptor `image` into `ram_block`:
    a QEMU whose memory maps another file copy-on-write then runs what a capture by pages saved
    (see pagecapture.py) before that image is filled. The pages go first, as in a migration:
    devices read guest memory as they load (virtio checks its rings). Zero pages go as 9-byte
    records; QEMU writes those only where its memory is not zero already."""
    with open(devstate, "rb") as f:
        state = f.read()
    if len(state) < 9 or struct.unpack(">II", state[:8]) != (FILE_MAGIC, FILE_VERSION) \
            or state[8] == SECTION_CONFIGURATION:
        raise StreamError(f"{devstate} is not a device-only QEMU stream")
    name = bytes([len(ram_block)]) + ram_block.encode()
    footer = struct.pack(">BI", SECTION_FOOTER, _RAM_SECTION)
    head = b"".join([
        state[:8],
        struct.pack(">BI", SECTION_START, _RAM_SECTION), b"\x03ram", struct.pack(">II", 0, 4),
        # The block list; with x-ignore-shared on, each block's guest address follows its length.
        struct.pack(">Q", ram_bytes | FLAG_MEM_SIZE), name, struct.pack(">QQ", ram_bytes, 0),
        struct.pack(">Q", FLAG_EOS), footer,
        struct.pack(">BI", SECTION_END, _RAM_SECTION)])
    _write_all(out, [head])
    first = True
    for start, end in pages:
        for batch in range(start, end, _PAGE_BATCH):
            count = min(_PAGE_BATCH, end - batch)
            data = os.pread(image, count * PAGE_SIZE, batch * PAGE_SIZE).ljust(count * PAGE_SIZE, b"\0")
            parts: list[bytes | memoryview] = []
            view = memoryview(data)
            for i in range(count):
                page = view[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
                addr = (batch + i) * PAGE_SIZE
                zero = page == _ZERO_PAGE
                flags = (FLAG_ZERO if zero else FLAG_PAGE) | (0 if first else FLAG_CONTINUE)
                parts.append(struct.pack(">Q", addr | flags) + (name if first else b""))
                parts.append(b"\0" if zero else page)
                first = False
            _write_all(out, parts)
    _write_all(out, [struct.pack(">Q", FLAG_EOS), footer, state[8:]])


_ZERO_PAGE = bytes(PAGE_SIZE)


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    """writev all of `parts` to `fd` (a pipe takes part of a large write at a time)."""
    i = 0
    while i < len(parts):
        done = os.writev(fd, parts[i:i + _IOV_MAX])
        while i < len(parts) and done >= len(parts[i]):
            done -= len(parts[i])
            i += 1
        if done:
            parts[i] = memoryview(parts[i])[done:]


class _FrontFile:
    """Tells a front as the size of a file (an atomic update its readers see whole), made on
    the first: the file's existence says the memory file has its size."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> Callable[[int], None]:
        return self.tell

    def __exit__(self, *_: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def tell(self, front: int) -> None:
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.fd, front)


def write_result(done: Path, result: dict) -> None:
    """Write a capture's result (a SplitResult's fields, or {"error": ...}) as `done`, whole:
    its waiters take the file's appearance for the end of the write-out."""
    tmp = done.with_name(done.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, done)


def has_configuration(devstate: Path) -> bool:
    """Whether a device-state stream starts with QEMU's configuration section (a migration's
    does; a device-only save's does not, and QEMU loads it only with send-configuration off).
    StreamError if it is not a migration stream at all."""
    with open(devstate, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or struct.unpack(">II", head[:8]) != (FILE_MAGIC, FILE_VERSION):
        raise StreamError(f"{devstate} is not a QEMU migration stream (bad magic or version)")
    return head[8] == SECTION_CONFIGURATION


def main(argv: list[str]) -> int:
    """`python -m rewind.engine.memory.migstream FD RAM_FD BLOCK DEVSTATE_OUT DONE FRONT READY_FD`:
    split the stream QEMU writes into the pipe whose read end is FD (QEMU holds the write end:
    `migrate fd:`), memory into the open file RAM_FD (made by the requester: see
    write_out_started). One byte on READY_FD says it is ready to read. FRONT is made once the
    memory file has its size; its own size is then how much of that file is final (see _Front).

    It runs detached, so the split finishes even if the rewind process that asked for the
    checkpoint dies. Whatever goes wrong, it reads the pipe to its end: a QEMU 7.2 whose
    background snapshot loses its reader mid-stream leaves guest memory write-protected and
    hangs for good. A requester that dies before QEMU has the write end leaves it no writer:
    the read ends at once. DONE is written last, atomically, with the result."""
    crashpoints.arm("split")
    fd_in, ram_fd, block, devstate_out, done, front, ready = argv
    source = PipeSource(int(fd_in))
    # The device state file is locked for as long as this process lives, from before it
    # appears under its name: a waiter that finds it unlocked and no result written knows
    # this process died (a kill, the OOM killer) and stops waiting (see splitter_ended).
    try:
        out_fd = acquire(Path(devstate_out + ".tmp"), exclusive=True, timeout=0)  # 0600, as the memory
        if out_fd is None:
            raise StreamError(f"another splitter is writing {devstate_out}")
        os.ftruncate(out_fd, 0)
        os.replace(devstate_out + ".tmp", devstate_out)
    except (OSError, StreamError):
        os.close(int(ready))  # with no byte sent: its requester says it ended as it started
        return 1
    os.write(int(ready), b"r")
    os.close(int(ready))
    try:
        with open(out_fd, "wb", closefd=False) as dst, _FrontFile(Path(front)) as tell:
            result: dict = split_stream(source, block, int(ram_fd), dst, tell).__dict__
    except Exception as e:  # noqa: BLE001 - reported to the waiting rewind process
        result = {"error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(OSError):
            while os.read(int(fd_in), PIPE_SIZE):
                pass
    result["cpu_s"] = round(time.process_time(), 4)
    write_result(Path(done), result)
    os.close(out_fd)
    return 1 if "error" in result else 0


def run() -> None:
    """main() with this process's arguments (`python -m`, or forked by the spawner)."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
