"""Saved points as the engine finds and runs them: stored ones, and ones captured on this
host whose commit is still under way.

A point is usable the moment it is captured: restore in place, create-from and fork run a
pending point from its local capture (memory image, device state, frozen disk layers), so
an agent that restores right after a checkpoint does not wait for the point to be hashed,
compressed and stored. Storing goes on in the background (pending.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rewind.engine import pending
from rewind.engine.checkpoint import Caches, blob_digest, state_of
from rewind.engine.memory.snapshot import SavedState
from rewind.engine.pending import PendingCheckpoint
from rewind.home import Home
from rewind.store import BadRef, CheckpointManifest, Store, UnknownCheckpoint
from rewind.store.model import Ref

_ID_PREFIX = re.compile(r"[0-9a-f]{8,32}")


@dataclass(frozen=True)
class Point:
    """A saved point of a machine, stored or not yet. `own_bytes` is None until it is stored."""

    id: str
    name: str | None
    machine: str
    parent: str | None
    created: float
    labels: dict[str, str]
    meta: dict
    own_bytes: int | None = None

    @classmethod
    def of_manifest(cls, m: CheckpointManifest) -> Point:
        return cls(id=m.id, name=m.name, machine=m.machine, parent=m.parent, created=m.created,
                   labels=dict(m.labels), meta=dict(m.meta), own_bytes=m.own_bytes)

    @classmethod
    def of_pending(cls, p: PendingCheckpoint) -> Point:
        return cls(id=p.id, name=p.name, machine=p.machine, parent=p.parent, created=p.created,
                   labels=dict(p.labels), meta=dict(p.meta))


@dataclass(frozen=True)
class Located:
    """A point found, and how to get the files a new QEMU runs it from. `manifest`: a stored
    point's, whose signature says who made it (None: a point captured here, not yet stored)."""

    point: Point
    _state: Callable[[], SavedState] = field(repr=False)
    manifest: CheckpointManifest | None = field(default=None, repr=False)

    def state(self) -> SavedState:
        return self._state()

    def check_signed(self, home: Home, store: Store, what: str, allow_unsigned: bool | None) -> None:
        """Refuse (UntrustedCheckpoint) to `what` this point unless this home or a key it trusts
        signed it (signers.check_signed); a point captured here is this home's own."""
        if self.manifest is not None:
            from rewind.signers import check_signed, is_home_store

            check_signed(home, self.manifest, what, is_home_store(home, store), allow_unsigned)


def locate(home: Home, store: Store, ref: str | Ref | CheckpointManifest,
           relative_to: str | None = None) -> Located:
    """The point `ref` names (as Store.get reads it: a name, an id or a prefix, `~N` back from
    `relative_to`, `REF~N`), whether stored or pending here."""
    caches = Caches.of(home.root, home.runtime)
    if isinstance(ref, CheckpointManifest):
        return _stored(home, store, caches, ref)
    ref = Ref.of(ref)
    if ref.exact:
        return _exact(home, store, caches, ref.text)
    start, steps = ref.start, ref.back
    if not start and relative_to is None:
        return _stored(home, store, caches, store.get(ref))  # the store says why it needs a point
    base = start or pending.surviving(home, relative_to)
    if base is None:
        raise UnknownCheckpoint(f"{ref}: every point it could count back from was lost")
    here = _exact(home, store, caches, base)
    # Pending points are the newest of a line: walk back through them to a stored one,
    # from which the store counts the rest of the way.
    while steps and here.point.own_bytes is None:
        parent = pending.surviving(home, here.point.parent)
        if parent is None:
            raise UnknownCheckpoint(f"{ref}: the history of {here.point.id[:12]} is shorter than that")
        here, steps = _exact(home, store, caches, parent), steps - 1
    if steps:
        return _stored(home, store, caches, store.get(f"~{steps}", relative_to=here.point.id))
    return here


def _stored(home: Home, store: Store, caches: Caches, manifest: CheckpointManifest) -> Located:
    def state() -> SavedState:
        ram = manifest.blobs["ram"]
        if not (caches.ram / f"{blob_digest(ram)}.ram").exists():
            pending.ensure_room(home, ram.size, f"the memory of checkpoint {manifest.id[:12]}")
        return state_of(store, caches, manifest)
    return Located(Point.of_manifest(manifest), state, manifest)


def _exact(home: Home, store: Store, caches: Caches, ref: str) -> Located:
    try:
        return _stored(home, store, caches, store.get(ref))
    except UnknownCheckpoint:
        pass
    matches = [p for p in pending.captured(home)
               if p.name == ref or (_ID_PREFIX.fullmatch(ref) and p.id.startswith(ref))]
    if len(matches) > 1:
        raise BadRef(f"{ref!r} names {len(matches)} checkpoints; give more of the id")
    if not matches:
        return _stored(home, store, caches, store.get(ref))  # stored meanwhile, or not there at all
    captured = matches[0]

    def state() -> SavedState:
        files = pending.wait_captured(home, captured)
        return files if files is not None else state_of(store, caches, store.get(captured.id))
    return Located(Point.of_pending(captured), state)
