"""Checkpoints of machines: capture into the store, and run again from the store.

A checkpoint holds these blobs: `ram` (the raw memory image), `devstate` (the
device state) and `disk.0` ... `disk.N` (the disk's layers, the image's root
disk first). Its meta says what the machine was (memory, vCPUs, accelerator,
image, identity). The store dedups everything: unchanged memory chunks and
disk layers cost nothing in later checkpoints.

Files a restore needs are kept materialised in local caches, named by the
digest of their blob index, so a point restored twice (or restored right after
it was taken here) is not unpacked again: memory images on tmpfs
(`runtime/ram`), disk layers and device states under `$REWIND_HOME/cache`. A
cached file is trusted because it exists, so those on disk are fsync'ed before
they get their cache name: after a power loss they are whole or absent.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import blake3

from rewind.engine.memory.memfiles import private_runtime
from rewind.engine.memory.migstream import SplitResult
from rewind.engine.memory.snapshot import SavedState
from rewind.engine.pointmeta import PointMeta
from rewind.store import DEFAULT_HISTORY, BlobIndex, CheckpointManifest, Store
from rewind.store.durable import fsync_file, replace_durably

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


def put_immutable(store: Store, caches: Caches, path: Path, chunk_size: int | None = None,
                  cache_name: Callable[[BlobIndex], Path] | None = None,
                  stored: AbstractSet[str] = frozenset()) -> BlobIndex:
    """Store a file that never changes (a frozen disk layer, a template's memory), hashing it
    only once per host; `cache_name` gives it a name in a local cache too (see _link_into).
    `stored`: chunks known to be in the store, not looked for again."""
    chunk_size = store.chunk_size if chunk_size is None else chunk_size
    st = path.stat()
    key = caches.blobs / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{chunk_size}.json"
    try:
        blob = BlobIndex.from_json(json.loads(key.read_text()))
        if blob.chunk_size == chunk_size and store.has_chunks(blob, known=stored):
            return blob
    except (OSError, ValueError, KeyError, TypeError):
        pass
    blob = store.put_blob(path, chunk_size=chunk_size)
    fsync_file(path)  # the cache below trusts it whole: QEMU wrote it without syncing
    key.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(key, json.dumps(blob.to_json()).encode())
    if cache_name is not None:
        _link_into(path, cache_name(blob))
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
                   history: int = DEFAULT_HISTORY, ram_base: str | None = None,
                   ram_changed: list[list[int]] | None = None,
                   ram_base_file: str | None = None, ram_base_inode: int | None = None,
                   ram_written: Callable[[int], int] | None = None,
                   captured: Callable[[], SplitResult] | None = None) -> CheckpointManifest:
    """Put a captured state's files into the store and commit it as checkpoint `checkpoint_id`.
    The files keep their names (machines may run on them) and get their cache names too.

    Memory is hashed chunk by chunk (holes are not read) and only chunks the store lacks are
    compressed and written: between two points 1 MiB of files apart, about 18 MiB of 512
    differ here. With `ram_changed`, the chunks that may differ from checkpoint `ram_base`'s
    memory (see pagemap.py), only those are read at all; the others are `ram_base`'s. A
    machine still on its template's memory has no such checkpoint: `ram_base_file`, the
    template's memory file (still inode `ram_base_inode`), is then stored once (per store,
    hashed once per host) and is the base: a new machine's first checkpoint stores only what
    differs from its template.

    With `ram_written` (see snapshot.follow_written), memory is stored as its capture writes it
    out; `captured`, given with it, then waits for the capture's end before anything else is
    stored: a 1 GiB point's memory took 1.9 s to store after its 2.9 s write-out, now mostly
    during it."""
    with store.lock():
        try:  # committed before: a committer killed after its manifest, before its journal went
            return store.get(checkpoint_id)
        except LookupError:
            pass
        # Read once: a manifest 30 points into an agent's loop is 0.9 MB, 15 ms to read, and
        # was read three times per commit.
        parent_point = _stored_point(store, parent)
        # What the parent holds is in the store: one stat per chunk to look for the chain's
        # lower layers and the template's memory again was about 4,700 stats a commit, in the
        # background CPU that competes with an agent's loop.
        in_parent = frozenset() if parent_point is None else frozenset(parent_point.hashes())
        base_file = None if ram_base_file is None else (Path(ram_base_file), ram_base_inode)
        base_point = parent_point if ram_base == parent else _stored_point(store, ram_base)
        known, unchanged = _unchanged_ram(store, caches, state.ram, base_point, ram_changed, base_file,
                                          in_parent)
        if known is not None and base_point is not None:
            meta = {**meta, "ram_base": base_point.id}  # where its unchanged memory was taken from
        with store.packing():  # one pack for the point's new chunks, durable before the commit
            ram = store.put_blob(state.ram, chunk_size=RAM_CHUNK_SIZE, known=known, unchanged=unchanged,
                                 written=ram_written)
            if captured is not None and captured().pages_resent:
                # Pages were sent again after they were read: read it again, now it is whole.
                ram = store.put_blob(state.ram, chunk_size=RAM_CHUNK_SIZE, known=known, unchanged=unchanged)
            blobs = {"ram": ram, "devstate": store.put_blob(state.devstate)}
            for i, layer in enumerate(state.disks):
                blobs[f"disk.{i}"] = put_immutable(store, caches, layer, stored=in_parent,
                                                   cache_name=lambda blob: layer_path(caches, blob))
        # A parent deleted meanwhile is still named: its manifest, read, holds its history.
        manifest = store.commit(machine, blobs, parent=parent_point, name=name, labels=labels,
                                meta={**meta, "layers": len(state.disks)}, history=history,
                                checkpoint_id=checkpoint_id)
    _link_into(state.ram, caches.ram / f"{blob_digest(blobs['ram'])}.ram")  # tmpfs: gone whole on a crash
    fsync_file(state.devstate)
    _link_into(state.devstate, caches.devstate / blob_digest(blobs["devstate"]))
    return manifest


def _stored_point(store: Store, point: str | None) -> CheckpointManifest | None:
    """A stored point, whose chunks stay in the store while its lock is held (only gc removes
    chunks, under the exclusive lock); None if there is no such point (any more: a parent
    deleted before it was read starts a new history)."""
    if point is None:
        return None
    try:
        return store.get(point)
    except LookupError:
        return None


def _unchanged_ram(store: Store, caches: Caches, ram: Path, base: CheckpointManifest | None,
                   changed: list[list[int]] | None, base_file: tuple[Path, int | None] | None,
                   stored: AbstractSet[str]) -> tuple[BlobIndex | None, set[int] | None]:
    """The memory index of stored point `base` (or of the immutable file `base_file`, given
    with its inode) and the chunks of `ram` that are as in it (all but `changed`), or (None,
    None) where that cannot be used: no base, a base file gone or made again, or one of
    another size."""
    if changed is None:
        return None, None
    try:
        if base is not None:
            known = base.blobs.get("ram")
        elif base_file is not None and os.stat(base_file[0]).st_ino == base_file[1]:
            known = put_immutable(store, caches, base_file[0], chunk_size=RAM_CHUNK_SIZE, stored=stored)
        else:
            return None, None
    except (LookupError, OSError):
        return None, None
    size = ram.stat().st_size
    if known is None or known.chunk_size != RAM_CHUNK_SIZE or known.size != size:
        return None, None
    unchanged = set(range(len(known.chunks)))
    for first, last in changed:
        unchanged.difference_update(range(first, last))
    return known, unchanged


def layer_path(caches: Caches, blob: BlobIndex) -> Path:
    """Where a disk layer is kept, unpacked, on this host."""
    return caches.layers / f"{blob_digest(blob)}.qcow2"


def state_of(store: Store, caches: Caches, manifest: CheckpointManifest) -> SavedState:
    """The files to run a checkpoint, unpacked from the store where not cached."""
    def cached(blob: BlobIndex, dest: Path, durable: bool = True) -> Path:
        try:
            # Just used: ramcache.trim leaves it alone for a while. Only the access time: the
            # modification time is part of a file's identity for put_immutable.
            os.utime(dest, ns=(time.time_ns(), dest.stat().st_mtime_ns))
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.materialize(blob, dest, durable=durable)
        return dest

    private_runtime(caches.ram.parent)
    blobs = manifest.blobs
    ram = cached(blobs["ram"], caches.ram / f"{blob_digest(blobs['ram'])}.ram", durable=False)  # tmpfs
    devstate = cached(blobs["devstate"], caches.devstate / blob_digest(blobs["devstate"]))
    meta = PointMeta.from_json(manifest.id, manifest.meta)
    disks = [cached(blobs[f"disk.{i}"], layer_path(caches, blobs[f"disk.{i}"]))
             for i in range(meta.disk_layers(manifest.id))]
    return SavedState(ram=ram, devstate=devstate, disks=disks, board=meta.board, point=manifest.id)
