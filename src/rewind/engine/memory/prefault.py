"""Faulting a running QEMU's guest memory in from outside it, without QEMU's main lock.

QEMU 7.2's background snapshot write-protects only pages that are mapped, so all guest
memory must be faulted in before a capture (see snapshot.populate). Reading one byte of
each page of the QEMU process with process_vm_readv makes the kernel fault the pages into
QEMU's own page tables, as QEMU's own read would, while the guest runs on undisturbed.
Measured here for a 512 MiB guest just restored: 0.18-0.22 s, against 0.3-0.45 s through
QEMU (pmemsave copies every byte and holds QEMU's main lock for each slice, which delays
the guest's own I/O).
"""

from __future__ import annotations

import ctypes
import os
from array import array

PAGE = os.sysconf("SC_PAGE_SIZE")
IOV_MAX = 1024  # iovecs one process_vm_readv call takes (Linux's UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                              ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_process_vm_readv.restype = ctypes.c_ssize_t


def guest_ram_mapping(pid: int, size: int) -> int:
    """Where QEMU `pid` maps guest memory: its one private writable mapping of exactly `size`
    bytes (of the memory file, or anonymous). LookupError if there is not exactly one."""
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if end - start == size and perms == "rw-p":
                found.append(start)
    if len(found) != 1:
        raise LookupError(f"QEMU {pid} has {len(found)} mappings the size of its guest memory")
    return found[0]


def fault_in(pid: int, start: int, size: int) -> None:
    """Read one byte of every page of [start, start + size) in process `pid`. OSError if the
    kernel refuses (no permission to read that process, or a page it cannot map)."""
    pages = size // PAGE
    remote = array("Q", bytes(16 * pages))  # (address, length) pairs, as struct iovec
    remote[0::2] = array("Q", range(start, start + pages * PAGE, PAGE))
    remote[1::2] = array("Q", [1]) * pages
    sink = ctypes.create_string_buffer(IOV_MAX)
    local = _IoVec(ctypes.addressof(sink), IOV_MAX)
    base = remote.buffer_info()[0]
    for first in range(0, pages, IOV_MAX):
        count = min(IOV_MAX, pages - first)
        got = _process_vm_readv(pid, ctypes.byref(local), 1, base + first * 16, count, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot read the memory of process {pid}: {os.strerror(err)}")
        if got < count:
            raise OSError(0, f"process {pid}: page {first + got} of its guest memory cannot be read")


def fault_in_guest_ram(pid: int, memory_mib: int) -> None:
    """Fault all guest memory of QEMU `pid` in (see the module's docstring)."""
    size = memory_mib << 20
    fault_in(pid, guest_ram_mapping(pid, size), size)
