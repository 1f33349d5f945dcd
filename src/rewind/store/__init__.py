"""The checkpoint store: deduplicated, content-addressed blobs and self-contained checkpoint
manifests, with locks, check, prune, gc, export and import. It knows nothing of QEMU."""

from rewind.store.errors import (
    BadExport,
    BadRef,
    CheckpointExists,
    CorruptChunk,
    StoreBusy,
    StoreError,
    UnknownCheckpoint,
)
from rewind.store.model import BlobIndex, CheckpointManifest, HistoryEntry
from rewind.store.store import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_HISTORY,
    CheckReport,
    GcReport,
    Progress,
    Store,
    new_checkpoint_id,
)
from rewind.store.transfer import export_checkpoint, import_checkpoint

__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEFAULT_HISTORY", "BadExport", "BadRef", "BlobIndex", "CheckReport",
    "CheckpointExists", "CheckpointManifest", "CorruptChunk", "GcReport", "HistoryEntry", "Progress",
    "Store", "StoreBusy", "StoreError", "UnknownCheckpoint", "export_checkpoint", "import_checkpoint",
    "new_checkpoint_id",
]
