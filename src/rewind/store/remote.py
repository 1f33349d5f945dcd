"""A store's objects in a bucket, and its locks there.

Layout under the prefix, the same as a store folder's (docs/format.md §2) so that one
reads like the other:

    config.json                 {"format": 1, "chunk_size": 262144} (3, and more, if encrypted)
    chunks/ab/<hash>            a chunk, byte for byte as in a store folder
    checkpoints/<id>.json       a manifest, byte for byte as in a store folder
    names/<name>                {"id": ...}: the claim on a checkpoint name (encrypted: sealed,
                                under the name's keyed hash)
    keys/<16 hex>               an encrypted store's key files, as in a store folder
    locks/<16 hex>.json         a lock object (below)

Locks after restic's: a holder writes a lock object, then lists the others. A shared holder
(an upload) goes ahead unless it sees a live exclusive one; an exclusive holder (gc, prune,
delete) unless it sees any live one. Both write before they look, so of two that race at
least one sees the other (this needs only read-after-write consistency of LIST, which S3 has
had since 2020 and rclone over a folder has too); the loser removes its object and retries.
A holder rewrites its object every REFRESH seconds; one not rewritten for TTL seconds
belongs to a holder that died and is ignored, and removed by gc. A holder that could not
rewrite its object for most of TTL must stop before it changes anything (`Held.check`).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass

from rewind.store.backends import ObjectStore
from rewind.store.errors import RemoteUnavailable, StoreBusy

CONFIG = "config.json"
ENCRYPTED_FORMAT = 3  # a bucket's format 1 with every object sealed (docs/format.md §2.11)
TTL = float(os.environ.get("REWIND_REMOTE_LOCK_TTL", "300"))
REFRESH = TTL / 5


def chunk_key(h: str) -> str:
    return f"chunks/{h[:2]}/{h}"


def manifest_key(checkpoint_id: str) -> str:
    return f"checkpoints/{checkpoint_id}.json"


def name_key(name: str) -> str:
    return f"names/{name}"


def key_key(key_id: str) -> str:
    return f"keys/{key_id}"


@dataclass
class LockNote:
    """A lock object's content (version 1). `time` is when it was last rewritten."""

    operation: str
    exclusive: bool
    host: str
    pid: int
    time: float
    version: int = 1

    def stale(self, now: float) -> bool:
        return now - self.time > TTL

    def describe(self) -> str:
        mode = "exclusively" if self.exclusive else "shared"
        age = time.time() - self.time
        return f"{self.operation} (pid {self.pid} on {self.host}, {mode}, renewed {age:.0f} s ago)"


def lock_notes(objects: ObjectStore) -> dict[str, LockNote]:
    """The lock objects there now, by key; unreadable ones are left out."""
    notes = {}
    for info in objects.list("locks/"):
        if not info.key.endswith(".json"):
            continue
        try:
            notes[info.key] = LockNote(**json.loads(objects.get(info.key)))
        except (KeyError, ValueError, TypeError):  # gone meanwhile, or not ours to read
            continue
    return notes


class Held:
    """A lock held: its object is rewritten in the background until release."""

    def __init__(self, objects: ObjectStore, key: str, note: LockNote) -> None:
        self.objects, self.key, self.note = objects, key, note
        self.renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="rewind-lock-refresh", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH):
            self.note.time = time.time()
            with suppress(RemoteUnavailable):  # tried again next time; check() tells if too long
                self.objects.put(self.key, json.dumps(asdict(self.note)).encode())
                self.renewed = time.monotonic()

    def check(self) -> None:
        """Raise if the lock may have been taken for stale: others may have gone ahead."""
        if time.monotonic() - self.renewed > 0.8 * TTL:
            raise StoreBusy(f"lost the lock on {self.objects.url}: it could not be renewed for "
                            f"{time.monotonic() - self.renewed:.0f} s")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        with suppress(RemoteUnavailable):  # left behind, it goes stale after TTL
            self.objects.delete([self.key])


@contextmanager
def remote_lock(objects: ObjectStore, *, exclusive: bool, operation: str, timeout: float) -> Iterator[Held]:
    """Hold the store's lock in the bucket; StoreBusy naming the holders after `timeout` s."""
    key = f"locks/{secrets.token_hex(8)}.json"
    deadline = time.monotonic() + timeout
    while True:
        note = LockNote(operation=operation, exclusive=exclusive, host=socket.gethostname(),
                        pid=os.getpid(), time=time.time())
        objects.put(key, json.dumps(asdict(note)).encode())
        now = time.time()
        live = [n for k, n in lock_notes(objects).items() if k != key and not n.stale(now)]
        blocking = live if exclusive else [n for n in live if n.exclusive]
        if not blocking:
            break
        objects.delete([key])
        if time.monotonic() >= deadline:
            raise StoreBusy(f"the store at {objects.url} is busy: "
                            f"{', '.join(n.describe() for n in blocking)} holds it "
                            f"(waited {timeout:g} s for {operation})")
        time.sleep(0.1 + random.random() * 0.3)  # apart, so two that saw each other do not meet again
    held = Held(objects, key, note)
    try:
        yield held
    finally:
        held.release()
