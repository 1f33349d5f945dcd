"""Memory images on tmpfs as a bounded cache.

Every capture writes a memory image to tmpfs (runtime/ram), and restoring a stored point
unpacks one there. tmpfs is RAM: images left behind starve the host (seen: 5 GiB in 37
files after an agent's loop, until the next run failed with ENOSPC). So images are a
cache under a budget. Never released: an image a QEMU maps (found in /proc, so a machine
started by any process counts), one a QEMU is being started from (`starting` holds it
until QEMU maps it), a capture not yet stored (its commit reads it; the caller pins those),
the booted templates. The rest go oldest first once the cache is over budget, or all of
them when the home has no machine left or tmpfs is short; the store brings them back when
needed. Trimmed to the budget, an image used in the last GRACE_S seconds stays too (picked
for a start a moment before `starting` holds it); otherwise a start that finds its image
released picks it again (engine.machine.NextQemu), which brings it back from the store.

The hold is a shared flock on the image; a release takes it exclusively, without waiting,
and looks at /proc once more before it unlinks: an image is never taken from a QEMU that
started from it after the first look.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rewind.engine.process.qemu import qemu_processes
from rewind.errors import RewindError
from rewind.store.locks import acquire

# Covers the moment between picking an image for a start and `starting` holding it (a
# restore's capture of the state it leaves, 0.1-0.3 s here). It was 20 s, which alone kept
# 4.3 GiB of images over a 4 GiB budget in an agent's loop of tries and restores.
GRACE_S = 5.0
START_WAIT_S = 10.0  # a start waits this long for a release under way to finish
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
    for proc in qemu_processes():
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0":
                    inodes.add(int(fields[4]))
    return inodes


Pinned = Callable[[], Iterable[Path]]  # asked for only when something may be released


def trim(folder: Path, pinned: Pinned, limit: int | None = None) -> int:
    """Release images, oldest first, until the cache is within `limit` bytes (default: the
    budget); images QEMU maps and `pinned` ones stay, and so do those used in the last GRACE_S
    unless `limit` is 0 (a start that loses one picks it again). Returns the bytes released."""
    limit = budget(folder) if limit is None else limit
    images = _images(folder) if folder.is_dir() else {}
    total = sum(i.size for i in images.values())
    if total <= limit:
        return 0
    mapped, kept = mapped_inodes(), set(pinned())
    recent = time.time() - (GRACE_S if limit else 0.0)
    free = sorted(((ino, i) for ino, i in images.items()
                   if i.used < recent and ino not in mapped and not kept.intersection(i.paths)
                   and not any(p.name.startswith(TEMPLATE_PREFIX) for p in i.paths)),
                  key=lambda item: item[1].used)
    chosen: dict[int, tuple[_Image, int]] = {}  # inode: (image, fd holding it exclusively)
    try:
        for ino, image in free:
            if total - sum(i.size for i, _ in chosen.values()) <= limit:
                break
            fd = _lock_for_release(image)
            if fd is not None:
                chosen[ino] = (image, fd)
        if not chosen:
            return 0
        mapped = mapped_inodes()  # a QEMU may have started from one since the first look
        released = 0
        for ino, (image, _) in chosen.items():
            if ino not in mapped:
                for path in image.paths:
                    path.unlink(missing_ok=True)
                released += image.size
        return released
    finally:
        for _, fd in chosen.values():
            os.close(fd)


def _lock_for_release(image: _Image) -> int | None:
    """An fd holding `image` exclusively, or None if a start holds it or it is gone."""
    try:
        return acquire(image.paths[0], exclusive=True, timeout=0, create=False)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def starting(image: Path) -> Iterator[None]:
    """Hold `image` against release while a QEMU is started from it (until QEMU maps it).
    FileNotFoundError if it is gone, or was released while this waited for the hold."""
    fd = acquire(image, exclusive=False, timeout=START_WAIT_S, create=False)
    if fd is None:
        raise FileNotFoundError(f"{image} is held by a release for more than {START_WAIT_S:.0f} s")
    try:
        if os.fstat(fd).st_ino != os.stat(image).st_ino:  # released, and a new one made since
            raise FileNotFoundError(f"{image} was released")
        yield
    finally:
        os.close(fd)


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
