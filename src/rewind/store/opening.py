"""Opening a store: a folder on this host, or a store in a bucket through its cache folder.

Above both kinds (store.py, cache.py), so that neither needs to know of the other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rewind.store.backends import is_remote
from rewind.store.cache import CachedStore, open_cache, open_remote
from rewind.store.store import DEFAULT_CHUNK_SIZE, Store, check_folder

if TYPE_CHECKING:
    from rewind.store.crypto import PasswordSource


def open_store(path: str | os.PathLike[str], create: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
               lock_timeout: float | None = None, home: os.PathLike[str] | None = None,
               encrypt: bool = False, password: PasswordSource = None) -> Store:
    """Open the store at `path`; with create=True, make it first if it is not there
    (`chunk_size` and `encrypt` only matter then). Locks are waited for up to
    `lock_timeout` s (default: $REWIND_LOCK_TIMEOUT, else 30).

    An encrypted store (made with encrypt=True) needs its password: `password`, else
    $REWIND_PASSWORD_FILE's content, else $REWIND_PASSWORD, else what `password` (a
    function) asks for; WrongPassword if none opens it. A plain store ignores it.

    `path` may also be `s3://bucket/prefix`: a store in a bucket, used through a store
    folder on this host as its cache (a CachedStore, cache.py), kept under `home`
    (default: $REWIND_HOME); encrypted, its key files are in the bucket."""
    if is_remote(path):
        return open_remote(str(path), create, chunk_size, lock_timeout, home, encrypt, password)
    folder = check_folder(path, create, chunk_size, encrypt, password)
    if folder.cache:
        return open_cache(folder, lock_timeout, password)
    return Store.in_folder(folder, lock_timeout, password)


__all__ = ["CachedStore", "open_store"]
