"""Where a store's objects live. A store is named by a spec: a folder path (the store of
store.py, on this host), or `s3://bucket/prefix` (objects in an S3-compatible bucket, with a
local store in front of it as a cache: cache.py).

`ObjectStore` is what the cache needs of a remote: whole objects put, got, listed and
deleted by key. Chunks and manifests never change once written, so nothing more is needed
except for two things that must be atomic across hosts: taking a checkpoint name, and locks.
Locks follow restic's lock objects (remote.py) and need only read-after-write consistency of
LIST; names use a conditional write (If-None-Match) where the server honours one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from rewind.errors import InvalidArgument

SCHEMES = ("s3://",)


@dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing gives it."""

    key: str  # relative to the store's prefix
    size: int


class ObjectStore(Protocol):
    """Whole objects under one prefix. Every method raises RemoteUnavailable when the server
    does not answer or refuses; `get` raises KeyError for a missing object."""

    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def put_new(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist; False if it did. Atomic only where
        `conditional_writes()` is True: elsewhere a check then a write, with a window."""
        ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def conditional_writes(self) -> bool:
        """Whether the server refuses a PUT with If-None-Match: * over an existing object."""
        ...


def is_remote(spec: str | os.PathLike[str]) -> bool:
    """Whether a store spec names a remote store rather than a folder."""
    return isinstance(spec, str) and spec.startswith(SCHEMES)


def parse_s3(spec: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix is '' or ends with '/'."""
    if not spec.startswith("s3://"):
        raise InvalidArgument(f"not an S3 store: {spec!r} (use s3://bucket/prefix)")
    bucket, _, prefix = spec[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not all(c.isalnum() or c in "-." for c in bucket) or ".." in prefix:
        raise InvalidArgument(f"invalid S3 store {spec!r}: use s3://bucket/prefix")
    return bucket, f"{prefix}/" if prefix else ""
