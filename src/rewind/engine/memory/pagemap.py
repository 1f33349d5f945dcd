"""Which parts of a running QEMU's guest memory can differ from the memory file it maps.

A machine's QEMU maps its memory file copy-on-write (share=off): a page the guest has
written is an anonymous copy, and every other page still reads from the file. The kernel's
pagemap (/proc/PID/pagemap, one 64-bit entry per page) tells which: bit 63 present, 62
swapped, 61 a page of the file. So the chunks of a capture that can differ from the file
it was started from are known without reading either, and a commit hashes only those (see
Store.put_blob's `unchanged`). A page only goes from the file's to an anonymous copy, never
back (rewind's QEMUs have no balloon and discard no guest memory), so a map read after the
capture's instant gives all that changed before it, and perhaps a little more.
"""

from __future__ import annotations

import os
from pathlib import Path

from rewind.engine.memory.prefault import PAGE

_COPY_PAGES = 1024  # pages per read and write of copy_changed (4 MiB)

# The top byte of a pagemap entry (bits 56-63) decides: 0x80 present, 0x40 swapped, 0x20 a
# page of the file. A page may differ from the file when it is swapped, or present and not
# the file's. One flag byte per page, made by bytes.translate at C speed: 131,072 pages of
# a 512 MiB guest take 2 ms here, where a Python loop over them took 30 ms.
_MAY_DIFFER = bytes(1 if top & 0x40 or (top & 0x80 and not top & 0x20) else 0 for top in range(256))


def file_mapping(pid: int, size: int, path: Path) -> int:
    """Where QEMU `pid` maps `path` as guest memory of `size` bytes, copy-on-write from its
    start. LookupError unless exactly one such mapping of that very file exists."""
    st = os.stat(path)
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            device_ok = os.makedev(*(int(x, 16) for x in fields[3].split(":"))) == st.st_dev
            if (end - start == size and fields[1] == "rw-p" and int(fields[2], 16) == 0
                    and device_ok and int(fields[4]) == st.st_ino):
                found.append(start)
    if len(found) != 1:
        raise LookupError(f"QEMU {pid} does not map {path} once as its guest memory")
    return found[0]


def changed_chunks(pid: int, size: int, path: Path, chunk_size: int) -> list[tuple[int, int]]:
    """The chunks of QEMU `pid`'s guest memory (`size` bytes, mapped from `path`) that may
    differ from the file now, as [first, last) ranges of chunk numbers. LookupError if QEMU
    does not map that file (see file_mapping), OSError if its pagemap cannot be read."""
    if chunk_size % PAGE or size % chunk_size:
        raise LookupError(f"guest memory of {size} bytes is not whole chunks of {chunk_size}")
    return chunks_of(changed_pages(pid, file_mapping(pid, size, path), size), chunk_size // PAGE)


def chunks_of(pages: list[tuple[int, int]], per_chunk: int) -> list[tuple[int, int]]:
    """The chunks of `per_chunk` pages that [first, last) page ranges touch, as [first, last)
    ranges of chunk numbers."""
    ranges: list[tuple[int, int]] = []
    for first, last in pages:
        low, high = first // per_chunk, (last - 1) // per_chunk + 1
        if ranges and ranges[-1][1] >= low:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], high))
        else:
            ranges.append((low, high))
    return ranges


def changed_pages(pid: int, start: int, size: int) -> list[tuple[int, int]]:
    """The pages of the guest memory QEMU `pid` maps at `start` (see file_mapping) that may
    differ from its file, as [first, last) ranges of page numbers. OSError as changed_chunks."""
    flags = _may_differ(pid, start, size)
    ranges: list[tuple[int, int]] = []
    first = flags.find(1)
    while first != -1:
        last = flags.find(0, first)
        last = len(flags) if last == -1 else last
        ranges.append((first, last))
        first = flags.find(1, last)
    return ranges


def _may_differ(pid: int, start: int, size: int) -> bytes:
    """One byte per page of the mapping at `start`: 1 where it may differ from the file."""
    pages = size // PAGE
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        pagemap.seek(start // PAGE * 8)
        entries = bytearray()
        while len(entries) < pages * 8:
            got = pagemap.read(pages * 8 - len(entries))
            if not got:
                raise OSError(f"the pagemap of process {pid} ended early")
            entries += got
    return bytes(entries[7::8]).translate(_MAY_DIFFER)


def copy_changed(pid: int, start: int, size: int, dest_fd: int) -> list[tuple[int, int]]:
    """Copy the pages of QEMU `pid`'s guest memory (mapped at `start`) that may differ from
    its file to the same offsets of `dest_fd`; returns them as changed_pages does. Only
    meaningful while its guest is stopped. OSError if its memory cannot be read."""
    runs = changed_pages(pid, start, size)
    memory = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for first, last in runs:
            for page in range(first, last, _COPY_PAGES):
                count = min(_COPY_PAGES, last - page)
                data = os.pread(memory, count * PAGE, start + page * PAGE)
                if len(data) != count * PAGE:
                    raise OSError(f"process {pid}: its guest memory at page {page} cannot be read")
                os.pwrite(dest_fd, data, page * PAGE)
    finally:
        os.close(memory)
    return runs
