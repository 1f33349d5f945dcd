"""The checkpoint store: deduplicated, content-addressed blobs and self-contained checkpoint
manifests, with locks, check, prune, gc, export and import. It knows nothing of QEMU.

Names are imported on first use (as in rewind/__init__.py): a command that only reads a
record or writes one durably (store.disk, store.model) does not load the whole store.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

_EXPORTS = {
    **{name: "rewind.store.errors" for name in (
        "BadExport", "BadRef", "CheckpointExists", "CorruptChunk", "StoreBusy", "StoreError",
        "UnknownCheckpoint", "UntrustedCheckpoint", "WrongPassword")},
    **{name: "rewind.store.model" for name in (
        "BlobIndex", "CheckpointManifest", "DEFAULT_HISTORY", "HistoryEntry")},
    **{name: "rewind.store.store" for name in (
        "DEFAULT_CHUNK_SIZE", "CheckReport", "GcReport", "Progress", "Store", "new_checkpoint_id")},
    "export_checkpoint": "rewind.store.transfer", "import_checkpoint": "rewind.store.transfer",
    "open_store": "rewind.store.opening",
}
__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEFAULT_HISTORY", "BadExport", "BadRef", "BlobIndex", "CheckReport",
    "CheckpointExists", "CheckpointManifest", "CorruptChunk", "GcReport", "HistoryEntry", "Progress",
    "Store", "StoreBusy", "StoreError", "UnknownCheckpoint", "UntrustedCheckpoint", "WrongPassword",
    "export_checkpoint",
    "import_checkpoint", "new_checkpoint_id", "open_store", "take_unlocked", "unlocked_for_child",
]

if TYPE_CHECKING:
    from rewind.store.errors import (
        BadExport,
        BadRef,
        CheckpointExists,
        CorruptChunk,
        StoreBusy,
        StoreError,
        UnknownCheckpoint,
        UntrustedCheckpoint,
        WrongPassword,
    )
    from rewind.store.model import DEFAULT_HISTORY, BlobIndex, CheckpointManifest, HistoryEntry
    from rewind.store.opening import open_store
    from rewind.store.store import (
        DEFAULT_CHUNK_SIZE,
        CheckReport,
        GcReport,
        Progress,
        Store,
        new_checkpoint_id,
    )
    from rewind.store.transfer import export_checkpoint, import_checkpoint


def unlocked_for_child() -> bytes:
    """The keys this process unlocked of encrypted stores, for a helper it starts to open
    them without scrypt (store/crypto.py); empty if it opened none, without loading the
    cipher library."""
    crypto = sys.modules.get("rewind.store.crypto")
    return b"" if crypto is None else crypto.unlocked_for_child()


def take_unlocked(data: bytes) -> None:
    """Remember what a parent process's unlocked_for_child() handed over."""
    if data:
        importlib.import_module("rewind.store.crypto").take_unlocked(data)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rewind.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
