"""Low-level pieces shared by the store and export/import: chunk coding, durable writes,
and turning OSErrors into StoreErrors."""

from __future__ import annotations

import errno
import os
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import blake3
import zstandard

from rewind.store.errors import CorruptChunk, StoreError

MAX_CHUNK_SIZE = 64 << 20
# Level 1, not 3: on a booted guest's 512 MiB RAM image cut in 256 KiB chunks, level 1
# compressed at 0.57 GB/s to a ratio of 3.02, level 3 at 0.37 GB/s to 3.13.
ZSTD_LEVEL = 1
WORKERS = os.cpu_count() or 2

_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _codec() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    codec = getattr(_local, "codec", None)
    if codec is None:
        codec = _local.codec = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return codec


def chunk_hash(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def encode_chunk(data: bytes) -> bytes:
    """A chunk as stored: one zstd frame (it records the content size)."""
    return _codec()[0].compress(data)


def decode_chunk(h: str, stored: bytes) -> bytes:
    """A stored chunk's bytes, checked against its hash; CorruptChunk if anything is off."""
    try:
        size = zstandard.frame_content_size(stored)
        if not 0 <= size <= MAX_CHUNK_SIZE:  # never trust a damaged header's size to allocate
            raise zstandard.ZstdError(f"implausible content size {size}")
        data = _codec()[1].decompress(stored)
    except zstandard.ZstdError as e:
        raise CorruptChunk(f"chunk {h} is damaged: it does not decompress ({e})") from e
    if chunk_hash(data) != h:
        raise CorruptChunk(f"chunk {h} is damaged: its content does not match its hash")
    return data


def write_tmp(tmp_dir: Path, data: bytes) -> Path:
    """Write `data` to a new file in `tmp_dir` and fsync it; the caller renames it into place."""
    path = tmp_dir / f"{secrets.token_hex(8)}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def replace_durably(path: Path, data: bytes) -> None:
    """Put `data` at `path` all at once and for good: readers see the old file or the new one,
    and after a crash the new one if this returned (fsync'ed, renamed, directory fsync'ed)."""
    os.replace(write_tmp(path.parent, data), path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the renames into a directory durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def os_errors(what: str) -> Iterator[None]:
    """Report an OSError (a full disk above all) as a StoreError saying what could not be done."""
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(f"cannot {what}: out of space{where}") from e
        raise StoreError(f"cannot {what}: {e.strerror or e}{where}") from e


@contextmanager
def worker_pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for hashing and (de)compressing, which release the GIL. On an error the work
    still queued is dropped, not done."""
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="rewind-store")
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)
