"""Moving a checkpoint between stores as one portable file.

Layout (integers are big-endian u32):

    b"RWNDEXP1"                 magic, with the format version as its last byte
    n, n bytes                  the manifest as JSON, its history included
    count                       then `count` chunks, each:
        32 bytes                the chunk's blake3 digest
        n, n bytes              its zstd frame, as stored
    32 bytes                    blake3 of everything before it

An encrypted store's export (magic b"RWNDENC1") has 16 bytes after the magic that tell its
keys from others (Keys.check_value), its manifest sealed with the store's key, and its chunks'
keyed names and sealed frames, as stored: only a store opened with a key of the same store
(the same master keys) imports it.

Every chunk the manifest or its history uses is in the file, so it restores into an empty
store. Import writes chunks to tmp/ and moves them into place only once the whole file's
checksum, every chunk's hash and the manifest have been checked: a bad file adds nothing.
An imported point's meta is marked `imported`: the engine does not take its network rules.
Its signature (signing.py) is kept: that mark is left out of what a signature covers.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import blake3

from rewind.store.disk import MAX_CHUNK_SIZE
from rewind.store.durable import create_private, fsync_dir, fsync_fd, os_errors, write_tmp
from rewind.store.errors import BadExport, CorruptChunk
from rewind.store.model import CheckpointManifest
from rewind.store.store import Store

MAGIC = b"RWNDEXP1"
SEALED_MAGIC = b"RWNDENC1"  # an encrypted store's export
_CHECK = 16  # the length of the key check that follows SEALED_MAGIC
_U32 = struct.Struct(">I")
_MAX_MANIFEST = 1 << 30
_MAX_FRAME = 2 * MAX_CHUNK_SIZE  # a zstd frame is never much larger than its content


def export_checkpoint(store: Store, ref: str | CheckpointManifest, out_path: str | os.PathLike[str]
                      ) -> CheckpointManifest:
    """Write checkpoint `ref` (with its history and every chunk they use) to `out_path`;
    returns its manifest. Chunks are checked on the way out, so damage is not passed on."""
    out = Path(out_path)
    with os_errors(f"write {out}"), store.lock(operation="export"):
        manifest = store._resolve(ref)
        hashes = sorted(manifest.all_hashes())
        tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
        try:
            with create_private(tmp) as f:
                writer = _Writer(f)
                writer.write(_header(store, manifest))
                writer.write(_U32.pack(len(hashes)))
                for h in hashes:
                    stored = store._read_stored(h)
                    store.codec.decode(h, stored)
                    writer.write(bytes.fromhex(h) + _U32.pack(len(stored)))
                    writer.write(stored)
                f.write(writer.hasher.digest())
                f.flush()
                fsync_fd(f.fileno(), tmp)
            os.rename(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return manifest


def import_checkpoint(store: Store, in_path: str | os.PathLike[str],
                      check: Callable[[CheckpointManifest], None] | None = None) -> CheckpointManifest:
    """Add the checkpoint exported to `in_path`, keeping its id, name, history and signature. A
    truncated or damaged file, or a checkpoint (id or name) already here, is refused with
    nothing added; so is one that `check` (given the manifest read) raises for: the caller's
    judgement of who signed it (the store trusts no one)."""
    src = Path(in_path)
    staged: list[tuple[Path, Path]] = []  # (file in tmp/, its place in chunks/)
    with os_errors(f"import {src}"), store.lock(operation="import"):
        store._packs.refresh()
        try:
            with open(src, "rb") as f:
                reader = _Reader(f, src)
                _check_magic(store, reader, src)
                body = reader.read(reader.length(_MAX_MANIFEST))
                included = set()
                for _ in range(reader.u32()):
                    h = reader.read(32).hex()
                    stored = reader.read(reader.length(_MAX_FRAME))
                    included.add(h)
                    if not store._has_chunk(h):
                        try:
                            store.codec.decode(h, stored)
                        except CorruptChunk as e:
                            raise BadExport(f"{src} is damaged: {e}") from e
                        staged.append((write_tmp(store._tmp, stored), store._chunk_path(h)))
                if f.read(33) != reader.hasher.digest():
                    raise BadExport(f"{src} is damaged or truncated: its checksum does not match its content")
            try:
                manifest = store._parse_manifest(body, export=True)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise BadExport(f"{src} is damaged: its manifest does not parse ({e})") from e
            if check is not None:
                check(manifest)
            for point in (manifest, *manifest.history):
                point.meta["imported"] = True  # what it says of itself is not to be trusted (see Engine)
            missing = manifest.all_hashes() - included
            if missing:
                raise BadExport(f"{src} is incomplete: it lacks chunk {min(missing)}")
            store._check_free(manifest)
            for tmp, dest in staged:
                os.rename(tmp, dest)
            for directory in {dest.parent for _, dest in staged}:
                fsync_dir(directory)
            store._write_manifest(manifest)
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)  # gone already if it was moved into place
    return manifest


def _header(store: Store, manifest: CheckpointManifest) -> bytes:
    """What comes before the chunk records: magic (and key check), the manifest's length and it."""
    body = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
    if store.keys is None:
        return MAGIC + _U32.pack(len(body)) + body
    from rewind.store.crypto import EXPORT

    body = store.keys.seal(EXPORT, body)
    return SEALED_MAGIC + store.keys.check_value() + _U32.pack(len(body)) + body


def _check_magic(store: Store, reader: _Reader, src: Path) -> None:
    """Refuse a file that is no export, or one that this store's keys cannot read."""
    magic = reader.f.read(len(MAGIC))
    if magic not in (MAGIC, SEALED_MAGIC):
        raise BadExport(f"{src} is not a rewind checkpoint export")
    reader.hasher.update(magic)
    if magic == MAGIC and store.keys is not None:
        raise BadExport(f"{src} is a plain export: this store is encrypted, and takes only exports "
                        "of its own (import it into a plain store)")
    if magic == SEALED_MAGIC and store.keys is None:
        raise BadExport(f"{src} is an encrypted export: import it into the encrypted store it came "
                        "from (or one opened with a key of it)")
    if magic == SEALED_MAGIC:
        assert store.keys is not None
        if reader.read(_CHECK) != store.keys.check_value():
            raise BadExport(f"{src} is an export of another encrypted store: this store's keys "
                            "do not open it")


class _Writer:
    """Writes an export, hashing what it writes."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.hasher = f, blake3.blake3()

    def write(self, data: bytes) -> None:
        self.hasher.update(data)
        self.f.write(data)


class _Reader:
    """Reads an export, hashing what it reads; a short read means the file was cut short."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.hasher = f, path, blake3.blake3()

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise BadExport(f"{self.path} is truncated: it ends in the middle of a record")
        self.hasher.update(data)
        return data

    def u32(self) -> int:
        n: int = _U32.unpack(self.read(4))[0]
        return n

    def length(self, limit: int) -> int:
        n = self.u32()
        if n > limit:
            raise BadExport(f"{self.path} is damaged: a record claims {n} bytes")
        return n
