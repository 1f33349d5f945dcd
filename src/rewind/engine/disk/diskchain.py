"""A disk's chain of qcow2 layers as QEMU opens it: frozen layers merged into one file.

Every capture freezes the disk's top layer and gives QEMU a new one, so a machine's chain
gains a layer per point: 61 layers after the agent loop's 20 rounds (four points a round).
QEMU opens every layer when it starts and activates every one again when an incoming
migration ends: starting a restore's QEMU took 80-150 ms at 4 layers and 250-285 ms at
55-61, loading its state 30-80 ms and 110-140 ms (bench loop, timed by stage).

So a committer that has stored a point whose chain has grown MERGE_AFTER layers past its
longest merged prefix writes a merged file: the layers above the image's root disk, as one
qcow2 over that disk (`qemu-img commit` of them into a copy of the previous merged file, or
into an empty file). A start then opens the root disk, the merged file in place of the
layers it stands for, and the layers above it (`for_qemu`). Records, journals and manifests
go on naming every layer and the store keeps them as before: merged files are a cache on
this host, named by the identity of the layers they stand for (frozen layers never change),
and one that is missing only makes a start open the longer chain.

Merged files no QEMU has open and no start picked in the last GRACE_S are removed once more
than KEEP are there. Not yet bounded: a merge copies the previous merged file, so a machine
that has written gigabytes would copy them every MERGE_AFTER points.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from rewind.engine.disk.qcow2 import Layer, LayerId
from rewind.engine.process.qemu import qemu_processes
from rewind.home import Home
from rewind.store.durable import fsync_dir, fsync_file
from rewind.store.locks import acquire

MERGE_AFTER = 8  # layers past the longest merged prefix before a merged file is made
KEEP = 8  # merged files kept beyond those in use
GRACE_S = 600.0  # a file a start picked stays this long, so QEMU finds it when it opens it
SUFFIX = ".qcow2"


def folder(home: Home) -> Path:
    return home.root / "cache" / "merged"


def _keys(chain: list[Path]) -> list[str]:
    """keys[k] names the layers chain[0..k] (each file's identity, in order)."""
    digest, keys = hashlib.sha256(), []
    for path in chain:
        digest.update(LayerId.of(path).key().encode() + b"\n")
        keys.append(digest.hexdigest()[:32])
    return keys


def _longest_merged(keys: list[str], where: Path) -> tuple[int, Path | None]:
    """The longest prefix chain[0..k] (named by `keys`, see _keys) with a merged file, as
    (k, file); (0, None) if none."""
    for k in range(len(keys) - 1, 1, -1):
        merged = where / f"{keys[k]}{SUFFIX}"
        if merged.exists():
            return k, merged
    return 0, None


def for_qemu(chain: list[Path], home: Home) -> list[tuple[int, Path]]:
    """The files QEMU opens for a chain of frozen layers (root disk first), each with its
    place in the chain: the longest merged prefix stands as one file, at its last layer's
    place (so the top's node keeps its name)."""
    with contextlib.suppress(OSError):  # a layer gone is said by QEMU, or by the caller's check
        k, merged = _longest_merged(_keys(chain), folder(home)) if folder(home).is_dir() else (0, None)
        if merged is not None:
            now = time.time()
            os.utime(merged, (now, now))  # picked: kept for GRACE_S
            return [(0, chain[0]), (k, merged), *((i, chain[i]) for i in range(k + 1, len(chain)))]
    return list(enumerate(chain))


def reading_files(chain: list[Path], home: Home) -> list[Path]:
    """The files a reader on the host opens for a chain of frozen layers: QEMU's."""
    return [path for _, path in for_qemu(chain, home)]


def merge_if_deep(chain: list[Path], home: Home) -> Path | None:
    """Write the merged file for the frozen `chain` if it has grown MERGE_AFTER layers past
    its longest merged prefix (and another process is not writing it already); the file
    written, or None."""
    if len(chain) - 2 < MERGE_AFTER:  # not deep enough whatever is merged (most commits)
        return None
    where, keys = folder(home), _keys(chain)
    k, base = _longest_merged(keys, where)
    if len(chain) - 1 - max(k, 1) < MERGE_AFTER:
        return None
    where.mkdir(parents=True, exist_ok=True)
    target = where / f"{keys[-1]}{SUFFIX}"
    lock = acquire(where / f".{target.stem}.lock", exclusive=True, timeout=0)
    if lock is None:
        return None
    try:
        if not target.exists():
            _write_merged(chain, k, base, target)
        return target
    finally:
        os.close(lock)
        (where / f".{target.stem}.lock").unlink(missing_ok=True)
        remove_unused(home)


def _write_merged(chain: list[Path], k: int, base: Path | None, target: Path) -> None:
    """`target`: chain[1..] as one layer over chain[0]. Starts from `base`, the merged file
    of chain[0..k], if there is one, and commits the layers above it into a copy of it."""
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(4)}.tmp")
    top = tmp.with_suffix(".top")
    try:
        size = _virtual_size(chain[-1])
        if base is not None:
            shutil.copyfile(base, tmp)
        else:
            _qemu_img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(chain[0]), str(tmp), str(size))
        _qemu_img("create", "-q", "-f", "qcow2", str(top), str(size))
        # The chain is spelt out (the backing paths inside the files are stale: layers are
        # moved and linked), and unlocked: its frozen layers are open in running QEMUs, and
        # a commit job asks for them alone; they never change, and tmp and top are ours.
        layers = [chain[0], tmp, *chain[k + 1:], top]
        _qemu_img("commit", "-q", "-d", "-b", str(tmp), f"json:{json.dumps(blockdev(layers))}")
        fsync_file(tmp)  # a merged file under its name is whole, even after the host restarts
        os.rename(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
        top.unlink(missing_ok=True)


def blockdev(layers: list[Path]) -> dict:
    """QEMU's options for `layers` (root first) as one chain, each file unlocked."""
    node = None
    for path in layers:
        node = {"driver": "qcow2", "file": {"driver": "file", "filename": str(path), "locking": "off"},
                "backing": node}
    assert node is not None
    return node


def _virtual_size(path: Path) -> int:
    layer = Layer.open(path)
    try:
        return layer.virtual_size
    finally:
        layer.close()


def _qemu_img(*args: str) -> None:
    result = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise OSError(f"qemu-img {args[0]} failed: {result.stderr.strip()}")


def usage(home: Home) -> dict[str, float]:
    """What the merged files of a home take (`rewind doctor`)."""
    sizes = [f.stat().st_size for f in folder(home).glob(f"*{SUFFIX}")]  # none if no folder
    return {"files": len(sizes), "mib": round(sum(sizes) / (1 << 20), 1)}


def remove_unused(home: Home) -> int:
    """Remove merged files beyond the KEEP newest that no QEMU has open and no start picked
    in the last GRACE_S, and what a merge killed midway left (older than GRACE_S: a merge
    takes seconds); returns how many merged files went."""
    where = folder(home)
    if not where.is_dir():
        return 0
    recent = time.time() - GRACE_S
    for left in where.glob(".*"):  # temporary files and locks
        with contextlib.suppress(OSError):
            if left.stat().st_mtime < recent:
                left.unlink()
    files = sorted(where.glob(f"*{SUFFIX}"), key=_picked, reverse=True)[KEEP:]
    stale = [f for f in files if _picked(f) < recent]  # for_qemu sets the time it picks one
    if not stale:
        return 0
    in_use = _open_by_qemu()
    removed = 0
    for path in stale:
        with contextlib.suppress(OSError):
            if path.stat().st_ino not in in_use:
                path.unlink()
                removed += 1
    return removed


def _picked(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _open_by_qemu() -> set[int]:
    """Inodes of the files QEMU processes on this host have open."""
    inodes = set()
    for proc in qemu_processes():
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    inodes.add(fd.stat().st_ino)
    return inodes
