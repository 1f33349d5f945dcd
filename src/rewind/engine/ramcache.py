"""Memory images on tmpfs as a bounded cache.

Every capture writes a memory image to tmpfs (runtime/ram), and restoring a stored point
unpacks one there. tmpfs is RAM: images left behind starve the host (seen: 5 GiB in 37
files after an agent's loop, until the next run failed with ENOSPC). So images are a
cache under a budget. Never released: an image a QEMU maps (found in /proc, so a machine
started by any process counts), a capture not yet stored (its commit reads it; the caller
pins those), the booted templates, and any image used in the last GRACE_S seconds (a
machine about to start from it has not opened it yet). The rest go oldest first once the
cache is over budget; the store brings them back when needed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from rewind.errors import RewindError

GRACE_S = 20.0
TEMPLATE_PREFIX = "template-"
BUDGET_ENV = "REWIND_RAM_BUDGET_MIB"
DEFAULT_BUDGET_MIB = 4096  # and never more than a quarter of the file system
MARGIN = 64 << 20  # left free on tmpfs beyond what an operation needs


class NoRoom(RewindError):
    """tmpfs has too little free space for the memory an operation needs."""


@dataclass(frozen=True)
class RamUse:
    """What the memory images of one home take (`rewind doctor`)."""

    images: int
    bytes: int  # allocated, not apparent: images are sparse
    budget: int
    free: int  # on the file system that holds them

    def to_json(self) -> dict:
        mib = 1 << 20
        return {"images": self.images, "mib": round(self.bytes / mib, 1), "budget_mib": self.budget // mib,
                "free_mib": self.free // mib}


def budget(folder: Path) -> int:
    """The cache's budget in bytes: $REWIND_RAM_BUDGET_MIB, else 4 GiB or a quarter of tmpfs."""
    forced = os.environ.get(BUDGET_ENV)
    if forced:
        try:
            return max(0, int(forced)) << 20
        except ValueError as e:
            raise NoRoom(f"{BUDGET_ENV} must be a whole number of MiB (got {forced!r})") from e
    total = _fs(folder)[0]
    return min(DEFAULT_BUDGET_MIB << 20, total // 4)


def _fs(folder: Path) -> tuple[int, int]:
    """(size, free) of the file system holding `folder` (or its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    st = os.statvfs(folder)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


@dataclass
class _Image:
    paths: list[Path]  # one file may have two names (its point's and its content's)
    used: float
    size: int


def _images(folder: Path) -> dict[int, _Image]:
    found: dict[int, _Image] = {}
    for path in folder.glob("*.ram"):
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            image = found.setdefault(st.st_ino, _Image([], max(st.st_atime, st.st_mtime), st.st_blocks * 512))
            image.paths.append(path)
    return found


def usage(folder: Path) -> RamUse:
    images = _images(folder) if folder.is_dir() else {}
    return RamUse(images=len(images), bytes=sum(i.size for i in images.values()), budget=budget(folder),
                  free=_fs(folder)[1])


def mapped_inodes() -> set[int]:
    """Inodes of the files QEMU processes on this host have mapped."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if not (proc / "comm").read_text().startswith("qemu"):
                continue
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0":
                    inodes.add(int(fields[4]))
    return inodes


Pinned = Callable[[], Iterable[Path]]  # asked for only when something may be released


def trim(folder: Path, pinned: Pinned, limit: int | None = None) -> int:
    """Release images, oldest first, until the cache is within `limit` bytes (default: the
    budget); images QEMU maps and `pinned` ones stay. Returns the bytes released."""
    limit = budget(folder) if limit is None else limit
    images = _images(folder) if folder.is_dir() else {}
    total = sum(i.size for i in images.values())
    if total <= limit:
        return 0
    mapped, kept = mapped_inodes(), set(pinned())
    recent = time.time() - GRACE_S
    free = sorted((i for ino, i in images.items()
                   if i.used < recent and ino not in mapped and not kept.intersection(i.paths)
                   and not any(p.name.startswith(TEMPLATE_PREFIX) for p in i.paths)),
                  key=lambda i: i.used)
    released = 0
    for image in free:
        if total - released <= limit:
            break
        for path in image.paths:
            path.unlink(missing_ok=True)
        released += image.size
    return released


def fits(folder: Path, need: int) -> bool:
    """Whether `need` bytes can be written to the tmpfs holding `folder` as it is now."""
    return _fs(folder)[1] >= need + MARGIN


def ensure_room(folder: Path, need: int, pinned: Pinned, what: str) -> None:
    """Make sure `need` bytes can be written to tmpfs, releasing cached images if that helps;
    NoRoom, before anything is done, if they cannot be."""
    if fits(folder, need):
        return
    trim(folder, pinned, limit=0)
    free = _fs(folder)[1]
    if free < need + MARGIN:
        raise NoRoom(f"{what} needs up to {need >> 20} MiB of memory on {folder.parent} (tmpfs) and only "
                     f"{free >> 20} MiB is free: stop or delete machines, or free memory on this host")
