"""Chunks as the store keeps them: hashed (BLAKE3), compressed (zstd), coded and decoded on a
pool of threads. Durable file writes are in durable.py."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import blake3
import zstandard

from rewind.store.errors import CorruptChunk

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


def decode_chunk(h: str, stored: bytes, hasher: Callable[[bytes], str] = chunk_hash) -> bytes:
    """A stored chunk's bytes, checked against its hash (`hasher`: an encrypted store's is
    keyed); CorruptChunk if anything is off."""
    try:
        size = zstandard.frame_content_size(stored)
        if not 0 <= size <= MAX_CHUNK_SIZE:  # never trust a damaged header's size to allocate
            raise zstandard.ZstdError(f"implausible content size {size}")
        data = _codec()[1].decompress(stored)
    except zstandard.ZstdError as e:
        raise CorruptChunk(f"chunk {h} is damaged: it does not decompress ({e})") from e
    if hasher(data) != h:
        raise CorruptChunk(f"chunk {h} is damaged: its content does not match its hash")
    return data


class PlainChunks:
    """How a plain store names, codes and checks chunks (an encrypted store's: crypto.py)."""

    def hash(self, data: bytes | memoryview) -> str:
        return chunk_hash(data)

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one codec, a handful of sizes)
    def zeros_hash(self, n: int) -> str:
        return chunk_hash(bytes(n))

    def encode(self, data: bytes | memoryview) -> bytes:
        return encode_chunk(data)

    def decode(self, h: str, stored: bytes) -> bytes:
        return decode_chunk(h, stored)


@contextmanager
def worker_pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for hashing and (de)compressing, which release the GIL. On an error the work
    still queued is dropped, not done."""
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="rewind-store")
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)
