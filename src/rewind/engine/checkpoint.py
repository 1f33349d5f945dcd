"""Checkpoints of machines: capture into the store, and run again from the store.

A checkpoint holds these blobs: `ram` (the raw memory image), `devstate` (the
device state) and `disk.0` ... `disk.N` (the disk's layers, the image's root
disk first). Its meta says what the machine was (memory, vCPUs, accelerator,
image, identity). The store dedups everything: unchanged memory chunks and
disk layers cost nothing in later checkpoints.

Files a restore needs are kept materialised in local caches, named by the
digest of their blob index, so a point restored twice (or restored right after
it was taken here) is not unpacked again: memory images on tmpfs
(`runtime/ram`), disk layers and device states under `$REWIND_HOME/cache`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import blake3

from rewind.engine.snapshot import SavedState
from rewind.store import BlobIndex, CheckpointManifest, Store, StoreError

HISTORY = 32
# Memory is cut finer than disks: a guest changes scattered pages, and between two points
# 1 MiB of file changes apart here 3.2 MiB of pages differed, which touched 31 MiB of
# 256 KiB chunks but 15 MiB of 64 KiB ones.
RAM_CHUNK_SIZE = 64 << 10


def blob_digest(blob: BlobIndex) -> str:
    return blake3.blake3(json.dumps(blob.to_json(), sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caches:
    """Where materialised checkpoint files live on this host."""

    ram: Path  # on tmpfs
    layers: Path
    devstate: Path
    blobs: Path  # blob indexes of immutable files already stored, by file identity

    @classmethod
    def of(cls, root: Path, runtime: Path) -> Caches:
        return cls(ram=runtime / "ram", layers=root / "cache" / "layers",
                   devstate=root / "cache" / "devstate", blobs=root / "cache" / "blobs")


def put_immutable(store: Store, caches: Caches, path: Path) -> BlobIndex:
    """Store a file that never changes (a frozen disk layer), hashing it only once per host."""
    blob = _indexed_once(store, caches, path, store.chunk_size)
    _link_into(path, layer_path(caches, blob))
    return blob


def _indexed_once(store: Store, caches: Caches, path: Path, chunk_size: int) -> BlobIndex:
    """Store a file that never changes and return its index; the index is kept under the
    file's identity, so the next call for the same file reads nothing."""
    st = path.stat()
    key = caches.blobs / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{chunk_size}.json"
    try:
        blob = BlobIndex.from_json(json.loads(key.read_text()))
        if blob.chunk_size == chunk_size and store.has_chunks(blob):
            return blob
    except (OSError, ValueError, KeyError, TypeError):
        pass
    blob = store.put_blob(path, chunk_size=chunk_size)
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_name(f".{key.name}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(blob.to_json()))
    os.replace(tmp, key)
    return blob


def _link_into(path: Path, dest: Path) -> None:
    """Give an immutable file its cache name too, so restoring never unpacks a copy of it
    (the image's root disk, say). Across file systems it is unpacked when first needed."""
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}")
    try:
        os.link(path, tmp)
    except OSError:
        return
    os.replace(tmp, dest)


def commit_capture(store: Store, caches: Caches, checkpoint_id: str, state: SavedState, *, machine: str,
                   parent: str | None, name: str | None, labels: dict[str, str] | None, meta: dict,
                   history: int = HISTORY, started_from: Path | None = None) -> CheckpointManifest:
    """Put a captured state's files into the store and commit it as checkpoint `checkpoint_id`.
    The files keep their names (machines may run on them) and get their cache names too.
    `started_from` is the memory image the captured QEMU began from (see ram_base)."""
    with store.lock():
        blobs = {"ram": put_ram(store, state.ram, ram_base(store, caches, parent, started_from)),
                 "devstate": store.put_blob(state.devstate)}
        for i, layer in enumerate(state.disks):
            blobs[f"disk.{i}"] = put_immutable(store, caches, layer)
        common = {"name": name, "labels": labels, "meta": {**meta, "layers": len(state.disks)},
                  "history": history, "checkpoint_id": checkpoint_id}
        try:
            manifest = store.commit(machine, blobs, parent=parent, **common)
        except LookupError:  # the parent was deleted: a new history starts here
            manifest = store.commit(machine, blobs, parent=None, **common)
    _link_into(state.ram, caches.ram / f"{blob_digest(blobs['ram'])}.ram")
    _link_into(state.devstate, caches.devstate / blob_digest(blobs["devstate"]))
    return manifest


@dataclass(frozen=True)
class RamBase:
    """A memory image on this host and its index in the store: what a new image is compared with."""

    path: Path
    blob: BlobIndex


def ram_base(store: Store, caches: Caches, parent: str | None, started_from: Path | None) -> RamBase | None:
    """The stored memory image a new one is most like: its parent point's, if that image is
    still on this host, else the one its QEMU started from (the booted template, say; stored
    once per host, then known by the file's identity)."""
    if parent is not None:
        with contextlib.suppress(StoreError, KeyError):
            blob = store.get(parent).blobs["ram"]
            for path in (caches.ram / f"{parent}.ram", caches.ram / f"{blob_digest(blob)}.ram"):
                if path.exists():
                    return RamBase(path, blob)
    if started_from is not None:
        with contextlib.suppress(FileNotFoundError):
            return RamBase(started_from, _indexed_once(store, caches, started_from, RAM_CHUNK_SIZE))
    return None


def put_ram(store: Store, ram: Path, base: RamBase | None) -> BlobIndex:
    """Store a memory image, hashing and compressing only the chunks that differ from `base`.
    A guest changes little of its memory between two points: with 1 MiB of files written,
    a few MiB of 512 differ. Comparing costs a read of both images (about 0.1 s here);
    hashing and compressing all of it cost 1.2 s of CPU per point."""
    unchanged = None
    if base is not None and base.blob.chunk_size == RAM_CHUNK_SIZE:
        unchanged = unchanged_chunks(ram, base.path, RAM_CHUNK_SIZE, base.blob.size)
    return store.put_blob(ram, chunk_size=RAM_CHUNK_SIZE, known=base.blob if unchanged else None,
                          unchanged=unchanged)


def _data_map(fd: int, size: int, chunk_size: int) -> bytearray:
    """Which chunks of a sparse file hold any data (1) or are holes only (0)."""
    has_data = bytearray((size + chunk_size - 1) // chunk_size)
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole from pos on
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        has_data[start // chunk_size:(end - 1) // chunk_size + 1] = b"\x01" * ((end - 1) // chunk_size
                                                                                - start // chunk_size + 1)
        pos = end
    return has_data


COMPARE_BLOCK = 4 << 20  # read and compared whole first; most blocks of two points are equal


def unchanged_chunks(path: Path, base: Path, chunk_size: int, size: int) -> set[int] | None:
    """The chunks of `path` whose bytes equal `base`'s at the same offset (both `size` bytes
    long; None if either is not). Chunks that are holes in both are not even read. Read with
    pread, never mapped: a mapped read of a hole in a tmpfs file allocates a page there."""
    try:
        fd, base_fd = os.open(path, os.O_RDONLY), os.open(base, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != size or os.fstat(base_fd).st_size != size or size == 0:
            return None
        ours, theirs = _data_map(fd, size, chunk_size), _data_map(base_fd, size, chunk_size)
        per_block = COMPARE_BLOCK // chunk_size
        same = set()
        for first in range(0, len(ours), per_block):
            last = min(first + per_block, len(ours))
            if not any(ours[first:last]) and not any(theirs[first:last]):
                same.update(range(first, last))
                continue
            offset, length = first * chunk_size, min(COMPARE_BLOCK, size - first * chunk_size)
            a, b = os.pread(fd, length, offset), os.pread(base_fd, length, offset)
            if len(a) != length or len(b) != length:
                return None  # changed under us: nothing is taken as unchanged
            if a == b:
                same.update(range(first, last))
                continue
            same.update(i for i in range(first, last)
                        if a[(i - first) * chunk_size:(i - first + 1) * chunk_size]
                        == b[(i - first) * chunk_size:(i - first + 1) * chunk_size])
        return same
    finally:
        os.close(fd)
        os.close(base_fd)


def layer_path(caches: Caches, blob: BlobIndex) -> Path:
    """Where a disk layer is kept, unpacked, on this host."""
    return caches.layers / f"{blob_digest(blob)}.qcow2"


def state_of(store: Store, caches: Caches, manifest: CheckpointManifest) -> SavedState:
    """The files to run a checkpoint, unpacked from the store where not cached."""
    def cached(blob: BlobIndex, dest: Path) -> Path:
        try:
            # Just used: ramcache.trim leaves it alone for a while. Only the access time, so
            # the file keeps its identity for _indexed_once.
            os.utime(dest, ns=(time.time_ns(), dest.stat().st_mtime_ns))
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.materialize(blob, dest)
        return dest

    blobs = manifest.blobs
    ram = cached(blobs["ram"], caches.ram / f"{blob_digest(blobs['ram'])}.ram")
    devstate = cached(blobs["devstate"], caches.devstate / blob_digest(blobs["devstate"]))
    disks = [cached(blobs[f"disk.{i}"], layer_path(caches, blobs[f"disk.{i}"]))
             for i in range(manifest.meta["layers"])]
    return SavedState(ram=ram, devstate=devstate, disks=disks)
