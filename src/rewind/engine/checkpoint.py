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

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import blake3

from rewind.engine.snapshot import Capture, SavedState
from rewind.store import BlobIndex, CheckpointManifest, Store

HISTORY = 32


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
    st = path.stat()
    key = caches.blobs / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}.json"
    try:
        blob = BlobIndex.from_json(json.loads(key.read_text()))
        if blob.chunk_size == store.chunk_size and store.has_chunks(blob):
            return blob
    except (OSError, ValueError, KeyError, TypeError):
        pass
    blob = store.put_blob(path)
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_name(f".{key.name}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(blob.to_json()))
    os.replace(tmp, key)
    _link_into(path, layer_path(caches, blob))
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


def adopt(path: Path, dest: Path) -> Path:
    """Move a just-captured file into a cache under its digest name (or drop it if there)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        path.unlink()
    else:
        os.replace(path, dest)
    return dest


def commit_capture(store: Store, caches: Caches, capture: Capture, disks: list[Path], *, machine: str,
                   parent: str | None, name: str | None, labels: dict[str, str] | None, meta: dict,
                   history: int = HISTORY) -> tuple[CheckpointManifest, SavedState]:
    """Put a capture's files into the store and commit the checkpoint; the files move into
    the caches, so the returned state runs without unpacking anything."""
    with store.lock():
        blobs = {"ram": store.put_blob(capture.ram), "devstate": store.put_blob(capture.devstate)}
        for i, layer in enumerate(disks):
            blobs[f"disk.{i}"] = put_immutable(store, caches, layer)
        try:
            manifest = store.commit(machine, blobs, parent=parent, name=name, labels=labels,
                                    meta={**meta, "layers": len(disks)}, history=history)
        except LookupError:  # the parent was deleted: a new history starts here
            manifest = store.commit(machine, blobs, parent=None, name=name, labels=labels,
                                    meta={**meta, "layers": len(disks)}, history=history)
    ram = adopt(capture.ram, caches.ram / f"{blob_digest(blobs['ram'])}.ram")
    devstate = adopt(capture.devstate, caches.devstate / blob_digest(blobs["devstate"]))
    return manifest, SavedState(ram=ram, devstate=devstate, disks=disks)


RAM_CACHE_KEEP = 4  # memory images kept on tmpfs beyond those machines run on


def trim_ram_cache(caches: Caches, in_use: set[Path]) -> None:
    """Drop the oldest cached memory images: they take host memory, and the store can unpack
    them again. Images that machines run on are kept (deleting them would free nothing)."""
    images = sorted((p for p in caches.ram.glob("*.ram") if p not in in_use),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in images[RAM_CACHE_KEEP:]:
        old.unlink(missing_ok=True)


def layer_path(caches: Caches, blob: BlobIndex) -> Path:
    """Where a disk layer is kept, unpacked, on this host."""
    return caches.layers / f"{blob_digest(blob)}.qcow2"


def state_of(store: Store, caches: Caches, manifest: CheckpointManifest) -> SavedState:
    """The files to run a checkpoint, unpacked from the store where not cached."""
    def cached(blob: BlobIndex, dest: Path) -> Path:
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.materialize(blob, dest)
        return dest

    blobs = manifest.blobs
    ram = cached(blobs["ram"], caches.ram / f"{blob_digest(blobs['ram'])}.ram")
    devstate = cached(blobs["devstate"], caches.devstate / blob_digest(blobs["devstate"]))
    disks = [cached(blobs[f"disk.{i}"], layer_path(caches, blobs[f"disk.{i}"]))
             for i in range(manifest.meta["layers"])]
    return SavedState(ram=ram, devstate=devstate, disks=disks)
