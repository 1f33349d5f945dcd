"""The checkpoint store: named binary blobs kept as deduplicated chunks, and checkpoint
manifests that say which chunks make up each blob. It knows nothing of QEMU.

Layout of a store directory (docs/format.md is the contract):

    config.json                 {"format": 2, "chunk_size": 262144}
    packs/<16 hex>.pack         chunks written by put_blob, many to a file, with their index at
                                its end (packs.py)
    chunks/ab/<hash>            a loose chunk (imports, a bucket's chunks fetched, stores of
                                format 1); a chunk is a zstd frame of a blob's slice, named by
                                the blake3 hex digest of the uncompressed slice; all-zero
                                slices are not stored
    checkpoints/<id>.json       a manifest (model.py), written last and atomically
    locks/                      store.lock (flock) and the holders' notes (locks.py)
    tmp/                        files being written; what a crash leaves here, gc removes
    keys/<16 hex>               an encrypted store's key files (format 3, crypto.py): then every
                                chunk and manifest is sealed and chunks are named by keyed BLAKE3

Discipline after restic's repository: files are written to tmp/, made durable and only then
renamed into place, so a crash leaves nothing half-visible. A blob's new chunks go into packs
written in tmp/, each fsync'ed, renamed into packs/ and that folder fsync'ed, all before
put_blob returns; a manifest (fsync'ed, renamed, its folder fsync'ed) comes after the blobs it
names. A chunk present in a pack or in chunks/ is therefore whole, and is trusted as such.
Adding takes the lock shared, gc and prune take it exclusively; check and gc are first-class
operations.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import secrets
import stat
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from rewind.errors import InvalidArgument
from rewind.store import model
from rewind.store.disk import (
    MAX_CHUNK_SIZE,
    WORKERS,
    PlainChunks,
    worker_pool,
)
from rewind.store.durable import fsync_dir, fsync_fd, os_errors, write_tmp
from rewind.store.errors import (
    BadRef,
    CheckpointExists,
    CorruptChunk,
    StoreBusy,
    StoreError,
    UnknownCheckpoint,
)
from rewind.store.locks import held_file, live_holders, names_lock, store_lock
from rewind.store.model import (
    DEFAULT_HISTORY,
    BlobIndex,
    CheckpointManifest,
    Ref,
    validate_checkpoint_name,
    validate_labels,
    validate_name,
)
from rewind.store.packs import Packer, PackIndex, read_index

if TYPE_CHECKING:
    from rewind.store.crypto import Keys, KeySlot, PasswordSource, SealedChunks
    from rewind.store.signing import SigningKey

DEFAULT_CHUNK_SIZE = 256 * 1024
# Chunks go to the hashing threads in batches of this many bytes: submitting a task per
# 64 KiB chunk took 0.2 s of a 1 GiB commit's main thread (17,000 of them).
BATCH_BYTES = 1 << 20
MANIFESTS_KEPT = 4  # manifests a Store keeps parsed (each some MB of objects at 30 points back)
# Store format: 2 adds packs/ (format 1 stores are upgraded when opened: their loose chunks
# stay as they are). Manifests keep their own format (model.FORMAT).
STORE_FORMAT = 2
# Format 3 is format 2 encrypted (crypto.py): keys/ holds its key files, and every object is
# sealed. Plain stores stay at format 2.
ENCRYPTED_FORMAT = 3
_DIRS = ("chunks", "packs", "checkpoints", "locks", "tmp")
_PLAIN = PlainChunks()
_HEX = re.compile(r"[0-9a-fA-F]+")

_Stored = tuple[int, str | None, bytes | None]  # a chunk's place, hash (None: zeros), frame if new
Progress = Callable[[int, int | None], None]
"""put_blob's progress callback: (bytes done, total bytes or None if unknown)."""


@dataclass
class CheckReport:
    """What check() looked at and what it found wrong."""

    checkpoints: int
    chunks: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcReport:
    """What gc() removed: unreferenced chunks, and files left in tmp/ by interrupted writes;
    and how many packs it wrote again without their unused chunks."""

    chunks_removed: int
    bytes_freed: int
    tmp_removed: int
    packs_rewritten: int = 0


def default_lock_timeout() -> float:
    """How long store locks are waited for unless told: $REWIND_LOCK_TIMEOUT, else 30 s."""
    return float(os.environ.get("REWIND_LOCK_TIMEOUT", "30"))


def new_checkpoint_id() -> str:
    """An id for a checkpoint, for a caller that must name it before committing it."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class Folder:
    """A store folder whose config was read and checked: what opening it needs."""

    root: Path
    chunk_size: int
    encrypted: bool
    cache: bool  # the cache of a store in a bucket (cache.py): it has a remote.json
    made: tuple[Keys, str] | None = None  # its keys, when it was just made: scrypt once, not twice


def check_folder(path: str | os.PathLike[str], create: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 encrypt: bool = False, password: PasswordSource = None) -> Folder:
    """The store folder at `path`, checked (made first if `create` and it is not there, with
    `chunk_size`, encrypted if `encrypt`); StoreError if it is none or damaged."""
    # Absolute: the store's path is recorded in journals that committers read from elsewhere.
    root = Path(path).absolute()
    made: tuple[Keys, str] | None = None
    if not (root / "config.json").exists():
        if not create:
            raise StoreError(f"there is no checkpoint store at {root}")
        made = _create(root, chunk_size, password if encrypt else False)
    try:
        config = json.loads((root / "config.json").read_bytes())
        version, chunk_size = config["format"], config["chunk_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"the checkpoint store at {root} is damaged: "
                         f"config.json is unreadable ({e})") from e
    if version not in (1, STORE_FORMAT, ENCRYPTED_FORMAT):
        raise StoreError(f"the checkpoint store at {root} has format {version!r}, which this rewind "
                         f"does not know (it knows 1 to {ENCRYPTED_FORMAT})")
    if not _valid_chunk_size(chunk_size):
        raise StoreError(f"the checkpoint store at {root} is damaged: bad chunk size {chunk_size!r}")
    if version != ENCRYPTED_FORMAT and (root / "keys").exists():
        # A writer of the folder may have turned an encrypted store's config back to plain:
        # never write in the clear beside its sealed objects.
        raise StoreError(f"the checkpoint store at {root} is damaged: it has key files but its "
                         f"config.json says format {version}, not {ENCRYPTED_FORMAT}")
    dirs = (*_DIRS, "keys") if version == ENCRYPTED_FORMAT else _DIRS
    missing = [d for d in dirs if not (root / d).is_dir() and (d, version) != ("packs", 1)]
    if missing:
        raise StoreError(f"the checkpoint store at {root} is damaged: {', '.join(missing)} missing")
    if version == 1:
        _upgrade(root, chunk_size)
    return Folder(root, chunk_size, encrypted=version == ENCRYPTED_FORMAT,
                  cache=(root / "remote.json").exists(), made=made)


class Store:
    """A checkpoint store directory. Get one with open_store() (opening.py)."""

    def __init__(self, root: Path, chunk_size: int, lock_timeout: float, keys: Keys | None = None,
                 key_id: str | None = None) -> None:
        self.root = root
        # An encrypted store's keys, and the key file that opened them (None: a plain store).
        self.keys, self.key_id = keys, key_id
        self.codec: PlainChunks | SealedChunks = _PLAIN
        if keys is not None:
            from rewind.store.crypto import SealedChunks

            self.codec = SealedChunks(keys)
        self.chunk_size = chunk_size
        self.lock_timeout = lock_timeout
        # Signs every manifest this store commits (signing.py): the key of whoever opened it (a
        # home's), set by them; None writes unsigned manifests, as rewind did before signing.
        self.signer: SigningKey | None = None
        self._tmp = root / "tmp"
        self._chunks = os.fspath(root / "chunks")
        self._packs = PackIndex(root / "packs")
        self._shared: Packer | None = None  # set within packing()
        # Manifests last read or written, by file name, with the identity of their file: a
        # manifest 30 points into an agent's loop is 0.9 MB and 15 ms to read, and a committer
        # reads each point's parent, most often the point it has just written.
        self._manifests: OrderedDict[str, tuple[tuple[int, int, int], CheckpointManifest]] = OrderedDict()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, chunk_size={self.chunk_size})"

    @property
    def encrypted(self) -> bool:
        return self.keys is not None

    @property
    def where(self) -> str:
        """How messages name the store: its folder (a bucket's URL for a CachedStore)."""
        return str(self.root)

    @classmethod
    def in_folder(cls, folder: Folder, lock_timeout: float | None = None,
                  password: PasswordSource = None) -> Store:
        """The store in a checked folder (check_folder) that is no bucket's cache; an
        encrypted one opened with its password (see opening.open_store)."""
        if lock_timeout is None:
            lock_timeout = default_lock_timeout()
        if not folder.encrypted:
            return cls(folder.root, folder.chunk_size, lock_timeout)
        made = folder.made
        if made is None:
            from rewind.store import crypto

            made = crypto.unlock(folder.root / "keys", crypto.password(password, folder.root), folder.root)
        return cls(folder.root, folder.chunk_size, lock_timeout, keys=made[0], key_id=made[1])

    @contextmanager
    def lock(self, exclusive: bool = False, operation: str = "write") -> Iterator[None]:
        """Hold the store lock. Every operation takes it by itself; hold it shared around
        put_blob ... commit so that no gc can remove the new, not yet committed chunks."""
        with store_lock(self.root / "locks", exclusive=exclusive, operation=operation,
                        timeout=self.lock_timeout):
            yield

    # -- keys of an encrypted store ---------------------------------------------------------

    def key_slots(self) -> list[KeySlot]:
        """The key files that open this store, oldest first."""
        from rewind.store import crypto

        return crypto.key_slots(self._keys_folder())

    def add_key(self, password: str) -> str:
        """A new key file that opens this store with `password`; its id."""
        from rewind.store import crypto

        folder = self._keys_folder()
        assert self.keys is not None  # checked by _keys_folder
        with self._keys_lock():
            return crypto.add_key(folder, self.keys, password)

    def remove_key(self, key_id: str) -> None:
        """Remove a key file; refuses the last one."""
        from rewind.store import crypto

        folder = self._keys_folder()
        with self._keys_lock():
            crypto.remove_key(folder, key_id)

    def change_password(self, password: str) -> str:
        """Replace the key file that opened this store by one for `password`: the new one is
        durable before the old one goes, so a crash between leaves both, never neither."""
        old = self.key_id
        new = self.add_key(password)
        if old is not None:
            self.remove_key(old)
        self.key_id = new
        return new

    def _keys_folder(self) -> Path:
        if self.keys is None:
            raise InvalidArgument(f"the checkpoint store at {self.where} is not encrypted: it has no keys")
        return self.root / "keys"

    @contextmanager
    def _keys_lock(self) -> Iterator[None]:
        # Two removals at once must not each see the other's key and leave none.
        with held_file(self.root / "locks" / "keys.lock", self.lock_timeout) as held:
            if not held:
                raise StoreBusy(f"the store at {self.root} is busy: another process is changing its keys")
            yield

    # -- adding ---------------------------------------------------------------------------

    @contextmanager
    def packing(self) -> Iterator[Packer]:
        """Within it, the new chunks of every put_blob go into the same packs, made durable
        and named when it ends, not as each put_blob returns: commit the blobs after it. A
        point's memory, device state and disk layer then make one pack, not three, each
        fsync'ed, and the packs every reader indexes grow three times slower."""
        packer = Packer(self._tmp, self.root / "packs")
        self._shared = packer
        try:
            yield packer
            packer.finish()
        except BaseException:
            packer.abort()
            raise
        finally:
            self._shared = None
        self._packs.refresh()

    def put_blob(self, source: str | os.PathLike[str] | BinaryIO, size: int | None = None,
                 progress: Progress | None = None, known: BlobIndex | None = None,
                 unchanged: Container[int] | None = None, chunk_size: int | None = None,
                 written: Callable[[int], int] | None = None) -> BlobIndex:
        """Store a blob read from a file path or a binary file object (from its current
        position): `size` bytes, or up to its end. Chunks are hashed and compressed by a thread
        pool; all-zero chunks and chunks already present are not written.

        `known` and `unchanged` let a caller that tracks writes (a dirty-page bitmap, say)
        skip reading: chunk i for every i in `unchanged` is taken from `known`, an index of
        the same blob at an earlier point, and its bytes in the source are seeked over.

        `chunk_size` overrides the store's for this blob: smaller chunks for data whose
        changes are scattered (guest memory changes page by page) store less per change.

        `written` is for a file still being written, at its full size already, in order from its
        start but for a few parts ahead: `written(n)` returns once its first n bytes (from the
        position) are final, with how many are. Nothing is read, nor taken for a hole, above
        that: a writer's last bytes are stored as they come, not all after it ends.

        A file is mapped, not read: it must not shrink while it is put."""
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        if not _valid_chunk_size(chunk_size):
            raise InvalidArgument(f"invalid chunk size {chunk_size!r}: use a multiple of 4096 "
                                  f"up to {MAX_CHUNK_SIZE}")
        if unchanged is not None and known is None:
            raise InvalidArgument("unchanged chunks need the known index they are unchanged from")
        if known is not None and known.chunk_size != chunk_size:
            raise InvalidArgument(f"the known index has chunk size {known.chunk_size}, not {chunk_size}")
        if size is not None and not (isinstance(size, int) and size >= 0):
            raise InvalidArgument(f"invalid blob size {size!r}")
        what = f"store a blob from {source}" if isinstance(source, str | os.PathLike) else "store a blob"
        with os_errors(what), self.lock(operation="put_blob"), _opened(source) as f:
            left = _regular_size(f)
            total = size if size is not None else left
            if unchanged is not None and total is None:
                raise InvalidArgument("unchanged chunks need a source of known size: a file, or size=")
            if written is not None and left is None:
                raise InvalidArgument("a source still being written must be a regular file")
            return self._put(f, total, progress, known, unchanged or (), regular=left is not None,
                             cs=chunk_size, written=written)

    def _put(self, f: BinaryIO, total: int | None, progress: Progress | None, known: BlobIndex | None,
             unchanged: Container[int], regular: bool, cs: int,
             written: Callable[[int], int] | None) -> BlobIndex:
        if self._shared is not None:  # made durable when packing() ends
            return self._chunked(f, total, progress, known, unchanged, regular, cs, written, self._shared)
        with self.packing() as packer:
            return self._chunked(f, total, progress, known, unchanged, regular, cs, written, packer)

    def _chunked(self, f: BinaryIO, total: int | None, progress: Progress | None, known: BlobIndex | None,
                 unchanged: Container[int], regular: bool, cs: int, written: Callable[[int], int] | None,
                 packer: Packer) -> BlobIndex:
        """The blob's index; its new chunks handed to `packer`, in order."""
        chunks: list[str | None] = []
        batch: list[tuple[int, bytes | memoryview]] = []  # chunks to hash and compress, handed out together
        pending: deque[Future[list[_Stored]]] = deque()
        offset = 0
        start = f.tell() if regular else 0
        # A file's chunks are taken from a map of it, not read: reads were half of a 1 GiB
        # commit's main thread (0.9 of 1.9 s).
        mapped = _mapped(f) if regular else None
        # In a regular file: where the next data starts and ends, as last looked up (relative).
        data_at, data_end = -1, -1
        final = sys.maxsize if written is None else 0  # how much of the source is final (relative)

        def settle(limit: int) -> None:  # collect finished batches, keeping at most `limit` in flight
            while len(pending) > limit:
                for i, h, frame in pending.popleft().result():
                    chunks[i] = h
                    if h is not None and frame is not None:
                        packer.add(h, frame)

        def hand_out() -> None:
            if batch:
                pending.append(pool.submit(self._store_chunks, batch.copy()))
                batch.clear()
                settle(2 * WORKERS)

        self._packs.refresh()
        with worker_pool() as pool:
            while total is None or offset < total:
                i = len(chunks)
                want = cs if total is None else min(cs, total - offset)
                if offset + want > final and i not in unchanged:
                    assert written is not None  # final is only finite with it
                    final = written(offset + want)
                if regular and i not in unchanged and data_end <= offset:
                    # Past the final part, a hole may yet be written: looked up again there.
                    data_at, data_end = (min(edge - start, final) for edge in _next_data(f, start + offset))
                if i in unchanged:
                    assert known is not None and total is not None  # checked by put_blob
                    # A run at once: memory images are 8,192 chunks, most of them unchanged,
                    # and a seek and an entry each were 10-15 ms of a commit's CPU.
                    end = i + 1
                    while end in unchanged and end * cs < total:
                        end += 1
                    want = min(end * cs, total) - offset
                    chunks += _unchanged_entries(known, i, end, want)
                    f.seek(want, os.SEEK_CUR)
                elif regular and data_at >= offset + want:  # a hole: zeros, not even read
                    chunks.append(None)
                    f.seek(want, os.SEEK_CUR)
                else:
                    if mapped is not None:  # (f is left behind: moved once, at the end)
                        data: bytes | memoryview = mapped[start + offset:start + offset + want]
                    else:
                        data = _read_exact(f, want)
                    if total is not None and len(data) < want:
                        raise StoreError(f"the source ended after {offset + len(data)} bytes; "
                                         f"{total} were expected")
                    if not data:
                        break
                    chunks.append(None)
                    batch.append((i, data))
                    if len(batch) * cs >= BATCH_BYTES:
                        hand_out()
                    want = len(data)
                offset += want
                if progress is not None:
                    progress(offset, total)
            hand_out()
            settle(0)
        if mapped is not None:
            f.seek(start + offset)
        return BlobIndex(size=offset, chunk_size=cs, chunks=chunks)

    def _store_chunks(self, batch: list[tuple[int, bytes | memoryview]]) -> list[_Stored]:
        """Hash each chunk and, unless it is all zeros or the store has it, compress it:
        (place, hash or None for zeros, frame to write if new)."""
        out: list[_Stored] = []
        codec = self.codec
        for i, data in batch:
            h = codec.hash(data)
            if h == codec.zeros_hash(len(data)):
                out.append((i, None, None))
            else:
                out.append((i, h, None if self._has_chunk(h) else codec.encode(data)))
        return out

    def _has_chunk(self, h: str) -> bool:
        """In a pack known (refresh first) or loose."""
        return h in self._packs or os.path.exists(self._chunk_file(h))

    def commit(self, machine: str, blobs: dict[str, BlobIndex],
               parent: str | CheckpointManifest | None = None, name: str | None = None,
               labels: dict[str, str] | None = None, meta: dict[str, Any] | None = None,
               history: int = DEFAULT_HISTORY, checkpoint_id: str | None = None) -> CheckpointManifest:
        """Make a checkpoint of `machine` from blobs already put. `parent` (a ref or manifest) is
        the point the machine was last saved to or restored from; up to `history` points of its
        chain are copied into the new manifest. Written atomically: until it returns, the
        checkpoint is not visible. `checkpoint_id` (from new_checkpoint_id) names it in advance.
        The manifest is signed with `signer`, if this store was given one."""
        if checkpoint_id is not None and not (isinstance(checkpoint_id, str)
                                              and re.fullmatch(r"[0-9a-f]{32}", checkpoint_id)):
            raise InvalidArgument(f"invalid checkpoint id {checkpoint_id!r}")
        validate_name(machine, "machine name")
        if name is not None:
            validate_checkpoint_name(name)
        labels = validate_labels(labels)
        meta = dict(meta or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"checkpoint meta must be plain JSON data: {e}") from e
        if not isinstance(history, int) or history < 0:
            raise InvalidArgument(f"history must be a number of points, not {history!r}")
        if not isinstance(blobs, dict):
            raise InvalidArgument("blobs must be a dict of blob name to BlobIndex")
        for blob_name, blob in blobs.items():
            validate_name(blob_name, "blob name")
            if not isinstance(blob, BlobIndex):
                raise InvalidArgument(f"blob {blob_name!r} is not a BlobIndex")
        with os_errors("commit a checkpoint"), self.lock(operation="commit"):
            base = None if parent is None else self._resolve(parent)
            manifest = CheckpointManifest(
                id=checkpoint_id or new_checkpoint_id(), name=name, machine=machine,
                parent=base.id if base else None,
                created=time.time(), labels=labels, blobs=dict(blobs), meta=meta, own_bytes=0,
                history=_fitting(blobs, [base.entry(), *base.history][:history] if base else []))
            # Chunks its parent holds are safe from gc (the parent refers to them); only the
            # others are checked to be there, and they are the checkpoint's own data.
            inherited = base.hashes() if base else set()
            manifest.own_bytes = sum(self._chunk_sizes(manifest.hashes() - inherited).values())
            data = manifest.to_json()
            if self.signer is not None:  # last: the signature covers every field
                manifest.signature = self.signer.sign(data)
                data["signature"] = manifest.signature.to_json()
            manifest.source = data
            self._write_manifest(manifest, data)
        return manifest

    def _chunk_sizes(self, hashes: set[str]) -> dict[str, int]:
        """The stored size of each chunk; refuses if any is missing (a gc may have run between
        put_blob and commit)."""
        sizes, missing = {}, []
        self._packs.refresh()
        for h in hashes:
            try:
                sizes[h] = self._packs.length(h) if h in self._packs else os.stat(self._chunk_file(h)).st_size
            except FileNotFoundError:
                missing.append(h)
        if missing:
            raise StoreError(f"cannot commit: {len(missing)} chunks of its blobs are missing from the store "
                             f"(first {missing[0]}); a gc ran after put_blob? Put the blobs again, "
                             "holding store.lock() until commit")
        return sizes

    def _manifest_bytes(self, manifest: CheckpointManifest, data: dict[str, Any] | None = None) -> bytes:
        """A manifest's file: compact JSON (of `data`, its to_json if already made), sealed in
        an encrypted store."""
        text = json.dumps(manifest.to_json() if data is None else data, separators=(",", ":")).encode()
        if self.keys is None:
            return text
        from rewind.store.crypto import MANIFEST

        return self.keys.seal(MANIFEST, text)

    def _parse_manifest(self, data: bytes, export: bool = False) -> CheckpointManifest:
        """A manifest from its file (`export`: from an export file's body, sealed as such);
        ValueError if it does not parse or (encrypted) is not whole."""
        if self.keys is not None:
            from cryptography.exceptions import InvalidTag

            from rewind.store.crypto import EXPORT, MANIFEST

            try:
                data = self.keys.unseal(EXPORT if export else MANIFEST, data)
            except InvalidTag as e:
                raise ValueError("it fails its authentication") from e
        return CheckpointManifest.from_json(json.loads(data))

    def _write_manifest(self, manifest: CheckpointManifest, data: dict[str, Any] | None = None) -> None:
        """Make a manifest visible: fsync'ed in tmp/, then renamed into checkpoints/ (`data`:
        its to_json, if the caller has made it)."""
        written = self._manifest_bytes(manifest, data)
        dest = self._manifest_path(manifest.id)
        with names_lock(self.root / "locks", self.lock_timeout) if manifest.name else nullcontext():
            self._check_free(manifest)
            tmp = write_tmp(self._tmp, written)
            identity = _identity(os.stat(tmp))
            os.rename(tmp, dest)
        fsync_dir(dest.parent)
        self._remember(dest.name, identity, manifest)

    def _check_free(self, manifest: CheckpointManifest) -> None:
        """Refuse a manifest whose id or name is already in the store."""
        if self._manifest_path(manifest.id).exists():
            raise CheckpointExists(f"checkpoint {manifest.id} is already in this store")
        if manifest.name is not None:
            for other in self.list():
                if other.name == manifest.name:
                    raise CheckpointExists(f"checkpoint name {manifest.name!r} is taken "
                                           f"by checkpoint {other.id[:12]}")

    # -- finding --------------------------------------------------------------------------

    def get(self, ref: str | Ref, relative_to: str | CheckpointManifest | None = None) -> CheckpointManifest:
        """The checkpoint `ref` names: a name, an id or a prefix of one (8 hex digits at
        least), or `~N`, the N-th point back along `relative_to`'s history (`~0` is itself);
        `REF~N` counts back from REF. A point whose manifest was deleted is rebuilt from the
        history kept in the newer one."""
        ref = Ref.of(ref)
        if ref.exact:
            return self._find(ref.text)
        start, n = ref.start, ref.back
        if start:
            base = self.get(start)
        elif relative_to is None:
            raise BadRef(f"{ref.text!r} counts back from a checkpoint, but none was given to count from")
        else:
            base = self._resolve(relative_to)
        if n > len(base.history):
            raise UnknownCheckpoint(f"{ref.text!r} is past the history kept: checkpoint {base.id[:12]} "
                                    f"keeps {len(base.history)} earlier points")
        point = base.back(n)
        path = self._manifest_path(point.id)
        if n and path.exists():  # the point's own manifest may keep a longer history
            with suppress(StoreError):
                return self._load_manifest(path)
        return point

    def _find(self, ref: str) -> CheckpointManifest:
        if _HEX.fullmatch(ref) and len(ref) >= 8:  # names cannot look like this (model.py)
            prefix = ref.lower()
            hits = sorted(p.stem for p in self._manifest_paths() if p.stem.startswith(prefix))
            if len(hits) > 1:
                shown = ", ".join(h[:12] for h in hits[:5])
                raise BadRef(f"{ref!r} matches {len(hits)} checkpoints ({shown}); give more of the id")
            if not hits:
                raise UnknownCheckpoint(f"no checkpoint has an id starting with {ref!r}")
            return self._load_manifest(self._manifest_path(hits[0]))
        for manifest in self.list():
            if manifest.name == ref:
                return manifest
        if _HEX.fullmatch(ref):
            raise BadRef(f"id prefix {ref!r} is too short: give at least 8 characters")
        raise UnknownCheckpoint(f"no checkpoint named {ref!r}")

    def _resolve(self, ref: str | CheckpointManifest) -> CheckpointManifest:
        return ref if isinstance(ref, CheckpointManifest) else self.get(ref)

    def delete(self, ref: str) -> CheckpointManifest:
        """Remove a checkpoint's manifest (gc frees its chunks); returns what was removed.
        Later checkpoints keep it in their history."""
        with os_errors("delete a checkpoint"), self.lock(operation="delete"):
            manifest = self.get(ref)
            try:
                self._manifest_path(manifest.id).unlink()
            except FileNotFoundError as e:
                raise UnknownCheckpoint(f"checkpoint {manifest.id[:12]} has no manifest of its own to "
                                        "delete: it lives on only in the history of later ones") from e
            fsync_dir(self.root / "checkpoints")
        return manifest

    # -- reading --------------------------------------------------------------------------

    def materialize(self, blob: BlobIndex, dest: str | os.PathLike[str], durable: bool = False) -> None:
        """Write a blob to `dest`, leaving zero chunks as holes, checking every chunk against
        its hash. On any error (CorruptChunk names the chunk) no file is left at `dest`:
        the data goes to a temporary file beside it, renamed into place at the end.

        `durable`: its data is fsync'ed before the rename, for a caller that trusts a file at
        `dest` because it exists (a cache): after a crash it is then whole or absent."""
        dest = Path(dest)
        with os_errors(f"write {dest}"), self.lock(operation="materialize"):
            tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                def place(item: tuple[int, str]) -> None:
                    i, h = item
                    data = self._load_chunk(h)
                    want = min(blob.chunk_size, blob.size - i * blob.chunk_size)
                    if len(data) != want:
                        raise CorruptChunk(f"chunk {h} has {len(data)} bytes where the blob needs {want}")
                    if os.pwrite(fd, data, i * blob.chunk_size) != want:  # short only when the disk is full
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest))

                with worker_pool() as pool:
                    list(pool.map(place, [(i, h) for i, h in enumerate(blob.chunks) if h]))
                os.ftruncate(fd, blob.size)
                if durable:
                    fsync_fd(fd, tmp)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            os.close(fd)
            os.rename(tmp, dest)

    def has_chunks(self, blob: BlobIndex, known: AbstractSet[str] = frozenset()) -> bool:
        """True if every chunk `blob` needs is in the store (its bytes are not checked); those
        in `known` are taken to be."""
        self._packs.refresh()
        return all(self._has_chunk(h) for h in blob.hashes() - known)

    def _chunk_file(self, h: str) -> str:
        return f"{self._chunks}/{h[:2]}/{h}"  # a str: pathlib's parsing shows up when done per chunk

    def _chunk_path(self, h: str) -> Path:
        return Path(self._chunk_file(h))

    def _read_stored(self, h: str) -> bytes:
        """A chunk's frame as stored (compressed), from its pack or its own file."""
        for looked_again in (False, True):
            try:
                return self._packs.read(h) if h in self._packs else self._chunk_path(h).read_bytes()
            except (FileNotFoundError, KeyError):
                # Packed since this store looked, or its pack rewritten by a gc (the index too).
                if not looked_again:
                    self._packs.refresh()
            except OSError as e:
                raise CorruptChunk(f"chunk {h} cannot be read: {e.strerror}") from e
        raise CorruptChunk(f"chunk {h} is missing from the store")

    def _load_chunk(self, h: str) -> bytes:
        return self.codec.decode(h, self._read_stored(h))

    def _manifest_path(self, checkpoint_id: str) -> Path:
        return self.root / "checkpoints" / f"{checkpoint_id}.json"

    def _manifest_paths(self) -> list[Path]:
        return sorted((self.root / "checkpoints").glob("*.json"))

    def _load_manifest(self, path: Path) -> CheckpointManifest:
        """The manifest in `path`; one read before (or written) by this Store, if the file is
        the same. The object is shared: callers must not change it."""
        try:
            with open(path, "rb") as f:
                identity = _identity(os.fstat(f.fileno()))
                known = self._manifests.get(path.name)
                if known is not None and known[0] == identity:
                    self._manifests.move_to_end(path.name)
                    return known[1]
                manifest = self._parse_manifest(f.read())
        except FileNotFoundError as e:
            raise UnknownCheckpoint(f"checkpoint {path.stem[:12]} was deleted meanwhile") from e
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"checkpoint file {path.name} is damaged: {e}") from e
        if manifest.id != path.stem:
            raise StoreError(f"checkpoint file {path.name} is damaged: it holds checkpoint {manifest.id}")
        self._remember(path.name, identity, manifest)
        return manifest

    def _remember(self, name: str, identity: tuple[int, int, int], manifest: CheckpointManifest) -> None:
        self._manifests[name] = (identity, manifest)
        while len(self._manifests) > MANIFESTS_KEPT:
            self._manifests.popitem(last=False)

    # -- upkeep ---------------------------------------------------------------------------

    def check(self, read_data: bool = False) -> CheckReport:
        """Check that every manifest parses and every chunk they (and their histories) use is
        there; with read_data, also that each decompresses to bytes matching its hash."""
        with os_errors("check the store"), self.lock(operation="check"):
            paths = self._manifest_paths()
            problems, users = self._chunk_users(paths)
            self._packs.refresh()
            problems += self._packs.damaged.values()

            def verify(h: str) -> str | None:
                try:
                    if read_data:
                        self._load_chunk(h)
                    elif not self._has_chunk(h):
                        raise CorruptChunk(f"chunk {h} is missing from the store")
                except CorruptChunk as e:
                    return f"{e} (used by {users[h][0]})"
                return None

            with worker_pool() as pool:
                found = pool.map(verify, users) if read_data else map(verify, users)
                problems += [p for p in found if p]
        return CheckReport(checkpoints=len(paths), chunks=len(users), problems=problems)

    def _chunk_users(self, paths: list[Path]) -> tuple[list[str], dict[str, tuple[str, str]]]:
        """For check: the manifests at `paths` that do not parse, and every chunk they (and
        their histories) use -> (one user, to say in a problem what it breaks; that manifest's id)."""
        problems, users = [], {}
        for path in paths:
            try:
                manifest = self._load_manifest(path)
            except StoreError as e:
                problems.append(str(e))
                continue
            for entry in [manifest, *manifest.history]:
                for blob_name, blob in entry.blobs.items():
                    for h in blob.hashes():
                        user = f"blob {blob_name!r} of checkpoint {entry.id[:12]}"
                        users.setdefault(h, (user, manifest.id))
        return problems, users

    def prune(self, keep_last: int | None = None, keep_days: float | None = None,
              per_machine: bool = True) -> list[str]:
        """Delete the checkpoints no policy keeps: the newest `keep_last` (of each machine, or of
        the store) and those younger than `keep_days`. Returns the ids removed; gc() then frees
        their chunks (those that no later checkpoint's history still uses)."""
        if keep_last is None and keep_days is None:
            raise InvalidArgument("prune needs keep_last or keep_days")
        if keep_last is not None and not (isinstance(keep_last, int) and keep_last >= 0):
            raise InvalidArgument(f"keep_last must be a count, not {keep_last!r}")
        if keep_days is not None and not (isinstance(keep_days, int | float) and keep_days >= 0):
            raise InvalidArgument(f"keep_days must be a number of days, not {keep_days!r}")
        with os_errors("prune checkpoints"), self.lock(exclusive=True, operation="prune"):
            newest_first = self.list()[::-1]
            keep = set()
            if keep_last is not None:
                seen: dict[str, int] = {}
                for manifest in newest_first:
                    group = manifest.machine if per_machine else ""
                    seen[group] = seen.get(group, 0) + 1
                    if seen[group] <= keep_last:
                        keep.add(manifest.id)
            if keep_days is not None:
                cutoff = time.time() - keep_days * 86400
                keep |= {m.id for m in newest_first if m.created >= cutoff}
            removed = [m.id for m in newest_first if m.id not in keep]
            for checkpoint_id in removed:
                self._manifest_path(checkpoint_id).unlink(missing_ok=True)
            fsync_dir(self.root / "checkpoints")
        return removed

    def gc(self) -> GcReport:
        """Remove the chunks no manifest uses (history entries count as uses) and whatever
        interrupted writes left in tmp/. Refuses to run while any manifest is unreadable."""
        with os_errors("collect garbage"), self.lock(exclusive=True, operation="gc"):
            live: set[str] = set()
            for path in self._manifest_paths():
                try:
                    live |= self._load_manifest(path).all_hashes()
                except StoreError as e:
                    raise StoreError(f"gc stopped, nothing removed: {e}; "
                                     "remove or repair that file first") from e
            chunks = freed = 0
            for path in (self.root / "chunks").glob("*/*"):
                if path.name not in live:
                    freed += path.stat().st_size
                    path.unlink()
                    chunks += 1
            packed, packed_freed, rewritten = self._gc_packs(live)
            chunks, freed = chunks + packed, freed + packed_freed
            tmp = 0
            for path in self._tmp.iterdir():
                freed += path.stat().st_size
                path.unlink()
                tmp += 1
            live_holders(self.root / "locks")  # as a side effect, drops the notes of holders that died
        return GcReport(chunks_removed=chunks, bytes_freed=freed, tmp_removed=tmp, packs_rewritten=rewritten)

    def _gc_packs(self, live: set[str]) -> tuple[int, int, int]:
        """Packs with no live chunk removed; those mostly dead written again with their live
        chunks alone (new pack durable first, then the old one removed). Chunks removed,
        bytes freed, packs rewritten."""
        chunks = freed = rewritten = 0
        self._packs.refresh()
        for pack in self._packs.packs():
            entries = list(read_index(pack))
            dead = [(h, at, n) for h, at, n in entries if h not in live]
            if not dead:
                continue
            dead_bytes, size = sum(n for _, _, n in dead), pack.stat().st_size
            if 2 * dead_bytes <= sum(n for _, _, n in entries):
                continue  # mostly live: kept whole until more of it dies
            if len(dead) < len(entries):
                packer = Packer(self._tmp, pack.parent)
                try:
                    with open(pack, "rb", buffering=0) as f:
                        for h, at, n in entries:
                            if h in live:
                                packer.add(h, os.pread(f.fileno(), n, at))
                    size -= sum(p.stat().st_size for p in packer.finish())
                except BaseException:
                    packer.abort()
                    raise
                rewritten += 1
            pack.unlink()
            chunks, freed = chunks + len(dead), freed + size
        fsync_dir(self.root / "packs")
        self._packs.refresh()
        return chunks, freed, rewritten

    def list(self) -> list[CheckpointManifest]:
        """All checkpoints, oldest first. A manifest that cannot be read is left out (check()
        reports it)."""
        out = []
        for path in self._manifest_paths():
            with suppress(StoreError):
                out.append(self._load_manifest(path))
        return sorted(out, key=lambda m: (m.created, m.id))


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """A file's identity for the manifest cache (a manifest file is never changed in place)."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def _fitting(blobs: dict[str, BlobIndex], history: list[model.HistoryEntry]) -> list[model.HistoryEntry]:
    """As much of `history`, newest first, as a reader accepts in one manifest beside `blobs`
    (model.MAX_MANIFEST_CHUNKS): a 16 GiB machine's 32 points back would be 33 x 262,144
    memory chunks, past it, and its manifest would then be refused as damaged."""
    def size(of: dict[str, BlobIndex]) -> int:
        return sum(model.chunk_count(b.size, b.chunk_size) for b in of.values())

    room = model.MAX_MANIFEST_CHUNKS - size(blobs)
    if room < 0:
        raise InvalidArgument(f"a checkpoint of {size(blobs)} chunks is more than a manifest holds "
                              f"({model.MAX_MANIFEST_CHUNKS}): use larger chunks")
    kept = []
    for entry in history:
        room -= size(entry.blobs)
        if room < 0:
            break
        kept.append(entry)
    return kept


def _create(root: Path, chunk_size: int, encrypt: PasswordSource | bool,
            key_files: dict[str, bytes] | None = None) -> tuple[Keys, str] | None:
    """Make a store at `root`; `encrypt` False for a plain one, else where its first key's
    password comes from (crypto.password). An encrypted one's keys and first key file.
    With `key_files` (a bucket's, by id), an encrypted one that holds copies of them instead
    (the cache of an encrypted bucket: cache.py)."""
    if not _valid_chunk_size(chunk_size):
        raise InvalidArgument(f"invalid chunk size {chunk_size!r}: "
                              f"use a multiple of 4096 up to {MAX_CHUNK_SIZE}")
    if root.exists() and not {p.name for p in root.iterdir()} <= {*_DIRS, "keys"}:
        raise StoreError(f"cannot make a checkpoint store at {root}: it exists and holds other files")
    made = None
    if encrypt is not False:
        from rewind.store import crypto

        secret = crypto.password(encrypt, root)  # asked for before anything is written
    with os_errors(f"make a checkpoint store at {root}"):
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # guest memory is in it
        for d in _DIRS:
            (root / d).mkdir(parents=True, exist_ok=True)
        for i in range(256):  # made once here, so that adding a chunk never needs a mkdir
            (root / "chunks" / f"{i:02x}").mkdir(exist_ok=True)
        config = {"format": STORE_FORMAT, "chunk_size": chunk_size}
        if encrypt is not False or key_files is not None:
            (root / "keys").mkdir(mode=0o700, exist_ok=True)
            for left in (root / "keys").iterdir():
                # Keys of a making that died before config.json: nothing was sealed with them, and
                # one left beside the new one could open with the same password to the wrong keys.
                left.unlink()
            if key_files is None:
                keys = crypto.Keys.new()
                made = keys, crypto.add_key(root / "keys", keys, secret)
            else:
                for key_id, content in key_files.items():
                    os.rename(write_tmp(root / "keys", content), root / "keys" / key_id)
                fsync_dir(root / "keys")
            config = {"format": ENCRYPTED_FORMAT, "chunk_size": chunk_size, "encryption": "aes-256-gcm"}
        data = json.dumps(config).encode()
        os.rename(write_tmp(root / "tmp", data), root / "config.json")  # last: it marks the store made
        fsync_dir(root)
    return made


def _upgrade(root: Path, chunk_size: int) -> None:
    """A store of format 1 becomes one of format 2: packs/ is made, then config.json says so.
    Its loose chunks stay as they are. Two processes doing it at once write the same."""
    with os_errors(f"upgrade the checkpoint store at {root} to format {STORE_FORMAT}"):
        (root / "packs").mkdir(exist_ok=True)
        fsync_dir(root)
        config = json.dumps({"format": STORE_FORMAT, "chunk_size": chunk_size}).encode()
        os.rename(write_tmp(root / "tmp", config), root / "config.json")
        fsync_dir(root)


def _valid_chunk_size(chunk_size: object) -> bool:
    # Whole pages, so that a dirty-page bitmap maps onto chunks.
    return isinstance(chunk_size, int) and 0 < chunk_size <= MAX_CHUNK_SIZE and chunk_size % 4096 == 0


@contextmanager
def _opened(source: str | os.PathLike[str] | BinaryIO) -> Iterator[BinaryIO]:
    """A path is opened (and closed after); a file object is used as it is."""
    if isinstance(source, str | os.PathLike):
        with open(source, "rb", buffering=0) as f:
            yield f
    else:
        yield source


def _regular_size(f: BinaryIO) -> int | None:
    """The bytes left in a regular file from its position, or None for a stream."""
    try:
        st = os.fstat(f.fileno())
        return max(st.st_size - f.tell(), 0) if stat.S_ISREG(st.st_mode) else None
    except (AttributeError, OSError, ValueError):  # BytesIO has no fileno; pipes cannot tell
        return None


def _next_data(f: BinaryIO, pos: int) -> tuple[int, int]:
    """Where the first stretch at or after `pos` that may hold data starts and ends: a sparse
    file's holes (where the engine's RAM images keep zero pages) need not be read. One look
    per stretch, not per chunk: a dense 1 GiB image cost 17,000 lseeks, a commit's
    CPU (0.43 s under a profiler). Leaves f at `pos`."""
    fd = f.fileno()
    try:
        found = os.lseek(fd, pos, os.SEEK_DATA)
        end = os.lseek(fd, found, os.SEEK_HOLE)  # a file ends in a hole, so there is one
    except OSError as e:  # ENXIO: nothing but holes up to the end; else the file system cannot tell
        found, end = (sys.maxsize, sys.maxsize) if e.errno == errno.ENXIO else (pos, sys.maxsize)
    f.seek(pos)
    return found, end


def _mapped(f: BinaryIO) -> memoryview | None:
    """A regular file's bytes, mapped read-only; None if it cannot be (empty, or not mappable)."""
    try:
        return memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    except (OSError, ValueError):
        return None


def _read_exact(f: BinaryIO, n: int) -> bytes:
    """Up to n bytes; fewer only at the end (pipes may return less per read)."""
    data = f.read(n) or b""
    while len(data) < n and (more := f.read(n - len(data))):
        data += more
    return data


def _unchanged_entries(known: BlobIndex, first: int, end: int, length: int) -> list[str | None]:
    """Chunks first..end-1 of `known`, `length` bytes in all in the new blob."""
    extent = min(end * known.chunk_size, known.size) - first * known.chunk_size
    if end > len(known.chunks) or extent != length:
        which = f"chunk {first}" if end == first + 1 else f"chunks {first}-{end - 1}"
        raise InvalidArgument(f"{which} cannot be unchanged: the known blob's extent differs")
    return known.chunks[first:end]
