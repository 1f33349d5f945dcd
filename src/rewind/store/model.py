"""What the store keeps: blob indexes and checkpoint manifests, and their JSON form.

A manifest carries the manifests of up to N earlier points along its parent chain
(its history), so it never depends on another manifest file. To keep that cheap,
each history entry's blob indexes are stored as changes against the next newer
point, and runs of zero chunks as counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rewind.errors import InvalidArgument
from rewind.store.errors import BadRef

FORMAT = 1
# A manifest's `signature` object (signing.py): readers that predate it ignore it, as they do
# any unknown key, so adding it left the manifest format as it was.
SIGNATURE_VERSION = 1
# What a manifest's blob indexes may expand to, all its points together (a pointer each): a
# damaged or hostile manifest of a few KB must not make us allocate much (one of 4.5 KB with
# 1-byte chunks took 184 MiB). 1 << 23 entries is 64 MiB; a 512 MiB machine's point needs
# about 9,000 (memory in 64 KiB chunks, disk layers in 256 KiB ones).
MAX_MANIFEST_CHUNKS = 1 << 23
CHUNK_SIZE_STEP = 4096  # chunk sizes are multiples of this, up to disk.MAX_CHUNK_SIZE
HASH = re.compile(r"[0-9a-f]{64}")
ID = re.compile(r"[0-9a-f]{32}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# A name made only of 8 or more hex digits would read as an id prefix in a ref.
_ID_LIKE = re.compile(r"[0-9a-fA-F]{8,}")

DEFAULT_HISTORY = 32  # ancestors a manifest lists, for history and diff without the store
# `REF~N` or `~N`: N points back. Six digits at most: far past any history, and a longer run
# of digits is no count (Python refuses to read an int of more than 4,300 digits).
_BACK_REF = re.compile(r"(.*)~(\d{1,6})")
MAX_REF = 80  # a name (63) or an id (32), and a count back


@dataclass(frozen=True)
class Ref:
    """A checkpoint reference, read once (Ref.of) where it comes in and passed on as read: a
    name, an id or a prefix of one (`start`), counted `back` N points (`REF~N`); `~N` alone
    counts back from a point the caller knows (`start` None)."""

    text: str
    start: str | None
    back: int = 0

    @classmethod
    def of(cls, ref: object) -> Ref:
        """`ref` read (a Ref is passed through); BadRef if it can be none, shortened."""
        if isinstance(ref, Ref):
            return ref
        if not isinstance(ref, str) or not ref:
            raise BadRef(f"a checkpoint reference must be a non-empty string, not {str(ref)[:40]!r}")
        if len(ref) > MAX_REF:
            raise BadRef(f"a checkpoint reference of {len(ref)} characters names nothing "
                         f"({ref[:20]!r}...): names have at most 63")
        counted = _BACK_REF.fullmatch(ref)
        if counted is None:
            return cls(ref, ref)
        return cls(ref, counted.group(1) or None, int(counted.group(2)))

    @property
    def counts_from_caller(self) -> bool:
        """`~N`: it needs the point to count back from (a machine's last one)."""
        return self.start is None

    @property
    def exact(self) -> bool:
        """A name, an id or a prefix, with no count back."""
        return self.start == self.text

    def __str__(self) -> str:
        return self.text


def validate_name(name: str, what: str) -> str:
    """Check a checkpoint, machine or blob name: the same rule as machine names."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(f"invalid {what} {name!r}: use up to 63 letters, digits, '-', '_' and '.', "
                              "starting with a letter or digit")
    return name


def validate_checkpoint_name(name: str) -> str:
    validate_name(name, "checkpoint name")
    if _ID_LIKE.fullmatch(name):
        raise InvalidArgument(f"invalid checkpoint name {name!r}: it would read as a checkpoint id")
    return name


def validate_labels(labels: dict[str, str] | None) -> dict[str, str]:
    """Labels follow the rules of machine labels."""
    if not isinstance(labels, dict | None):
        raise InvalidArgument("labels must be a dict of strings")
    out = {}
    for key, value in (labels or {}).items():
        if not isinstance(key, str) or not _NAME.fullmatch(key):
            raise InvalidArgument(f"invalid label key {key!r}")
        if not isinstance(value, str) or len(value) > 256 or "\n" in value:
            raise InvalidArgument(f"invalid value for label {key!r}")
        out[key] = value
    return out


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


@dataclass
class BlobIndex:
    """Where a blob's bytes are: chunk i holds bytes [i * chunk_size, (i + 1) * chunk_size)
    (the last one may be shorter), named by the blake3 hex digest of those bytes; None marks
    a chunk that is all zeros and is not stored."""

    size: int
    chunk_size: int
    chunks: list[str | None]

    def hashes(self) -> set[str]:
        """The stored chunks this blob needs."""
        return {h for h in self.chunks if h is not None}

    def to_json(self, base: BlobIndex | None = None) -> dict[str, Any]:
        """Compact JSON: runs of zero chunks become counts; against `base` (the same blob at a
        newer point) only the chunks that differ are written, when that is shorter."""
        out: dict[str, Any] = {"size": self.size, "chunk_size": self.chunk_size}
        if base is not None and base.chunk_size == self.chunk_size:
            old = base.chunks
            # Most blobs of a point's history are as at the point after it (its disk layers):
            # compared whole first, in C (a manifest 30 points into the loop: 17 -> 12 ms).
            changed = [] if old == self.chunks else \
                [[i, h] for i, (h, o) in enumerate(zip(self.chunks, old, strict=False)) if h != o] + \
                [[i, h] for i, h in enumerate(self.chunks[len(old):], len(old))]
            if len(changed) * 2 <= len(self.chunks):
                out["changed"] = changed
                return out
        runs: list[str | int] = []
        for h in self.chunks:
            if h is not None:
                runs.append(h)
            elif runs and isinstance(runs[-1], int):
                runs[-1] += 1
            else:
                runs.append(1)
        out["chunks"] = runs
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], base: BlobIndex | None = None,
                  budget: list[int] | None = None) -> BlobIndex:
        """Inverse of to_json; raises ValueError on anything malformed (hashes name files, so
        each is checked). `budget` ([chunks left]) bounds what several blobs may expand to."""
        size, chunk_size = data["size"], data["chunk_size"]
        if not (is_int(size) and size >= 0 and is_int(chunk_size) and chunk_size > 0
                and chunk_size % CHUNK_SIZE_STEP == 0):
            raise ValueError("bad blob size or chunk size")
        count = chunk_count(size, chunk_size)
        budget = budget if budget is not None else [MAX_MANIFEST_CHUNKS]
        if count > budget[0]:
            raise ValueError(f"implausible blob size {size}")
        budget[0] -= count
        if "changed" in data:
            if base is None or base.chunk_size != chunk_size:
                raise ValueError("blob changes without a matching newer blob")
            chunks = (base.chunks + [None] * count)[:count]
            for i, h in data["changed"]:
                if not (is_int(i) and 0 <= i < count):
                    raise ValueError(f"chunk index {i!r} out of range")
                chunks[i] = None if h is None else _check_hash(h)
        else:
            chunks = []
            for item in data["chunks"]:
                if is_int(item) and 0 < item <= count - len(chunks):
                    chunks.extend([None] * item)
                else:
                    chunks.append(_check_hash(item))
        if len(chunks) != count:
            raise ValueError(f"{len(chunks)} chunks for a blob of {size} bytes")
        return cls(size=size, chunk_size=chunk_size, chunks=chunks)


@dataclass
class HistoryEntry:
    """One saved point: everything about it except its own history."""

    id: str
    name: str | None
    machine: str
    parent: str | None
    created: float
    labels: dict[str, str]
    blobs: dict[str, BlobIndex]
    meta: dict[str, Any]
    own_bytes: int

    def hashes(self) -> set[str]:
        return set().union(*(blob.hashes() for blob in self.blobs.values()))


@dataclass(frozen=True)
class ManifestSignature:
    """A manifest's signature (docs/format.md §2.12; store/signing.py makes and checks it): the
    signer's public key as text and an Ed25519 signature of the manifest's signed bytes."""

    key: str  # "ed25519:" and the base64 of the 32-byte public key
    sig: str  # base64 of the 64-byte signature
    version: int = SIGNATURE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "key": self.key, "sig": self.sig}

    @classmethod
    def from_json(cls, data: object) -> ManifestSignature:
        """Its shape is checked here; whether it is good, by signing.verify (a signature of a
        version this rewind does not know is kept, and verifies as bad)."""
        if not (isinstance(data, dict) and is_int(data.get("version"))
                and isinstance(data.get("key"), str) and isinstance(data.get("sig"), str)
                and len(data["key"]) <= 200 and len(data["sig"]) <= 200):
            raise ValueError("bad signature object")
        return cls(key=data["key"], sig=data["sig"], version=data["version"])


@dataclass(frozen=True)
class Seal:
    """What a manifest's signature says once checked: `state` is "unsigned", "good" (by `key`)
    or "bad" (it claims `key`, but does not match the manifest, or cannot be read)."""

    state: Literal["unsigned", "good", "bad"]
    key: str | None = None


@dataclass
class CheckpointManifest(HistoryEntry):
    """A checkpoint, self-contained: `history` holds the points before it along its parent
    chain, newest (its parent) first, so it outlives the deletion of any other manifest.

    `signature` covers the whole manifest, its history included; a point rebuilt from another
    manifest's history (back) is vouched for by that manifest's signature (`vouched_by`)."""

    history: list[HistoryEntry] = field(default_factory=list)
    signature: ManifestSignature | None = None
    vouched_by: CheckpointManifest | None = field(default=None, repr=False, compare=False)
    # The JSON object it was read from, which its signature is checked against: writing it
    # again (to_json) would cost a long history's manifest 50 ms more at every restore.
    source: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # signing.verify's verdict, once it has checked (a manifest object is never changed after).
    seal: Seal | None = field(default=None, repr=False, compare=False)

    def entry(self) -> HistoryEntry:
        return HistoryEntry(**{f.name: getattr(self, f.name) for f in fields(HistoryEntry)})

    def back(self, n: int) -> CheckpointManifest:
        """The point n steps back (0 = this one), as a manifest built from the history kept here."""
        if n == 0:
            return self
        entry = self.history[n - 1]
        return CheckpointManifest(**{f.name: getattr(entry, f.name) for f in fields(HistoryEntry)},
                                  history=self.history[n:], vouched_by=self.vouched_by or self)

    def all_hashes(self) -> set[str]:
        """Every chunk this manifest needs, its history's included (what gc must keep)."""
        return set().union(self.hashes(), *(e.hashes() for e in self.history))

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, **_entry_json(self, None)}
        out["history"] = []
        newer = self.blobs
        for entry in self.history:
            out["history"].append(_entry_json(entry, newer))
            newer = entry.blobs
        if self.signature is not None:
            out["signature"] = self.signature.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointManifest:
        """Parse and check a manifest; raises ValueError (or KeyError/TypeError) if malformed."""
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {data.get('format')!r}")
        budget = [MAX_MANIFEST_CHUNKS]
        top = _entry_from_json(data, {}, budget)
        history, newer = [], top.blobs
        for item in data["history"]:
            entry = _entry_from_json(item, newer, budget)
            history.append(entry)
            newer = entry.blobs
        signature = ManifestSignature.from_json(data["signature"]) if "signature" in data else None
        return cls(**{f.name: getattr(top, f.name) for f in fields(HistoryEntry)}, history=history,
                   signature=signature, source=data)


def _entry_json(entry: HistoryEntry, newer: dict[str, BlobIndex] | None) -> dict[str, Any]:
    newer = newer or {}
    return {
        "id": entry.id, "name": entry.name, "machine": entry.machine, "parent": entry.parent,
        "created": entry.created, "labels": entry.labels, "meta": entry.meta, "own_bytes": entry.own_bytes,
        "blobs": {name: blob.to_json(newer.get(name)) for name, blob in entry.blobs.items()},
    }


def _entry_from_json(data: dict[str, Any], newer: dict[str, BlobIndex], budget: list[int]) -> HistoryEntry:
    if not (isinstance(data["id"], str) and ID.fullmatch(data["id"])):
        raise ValueError(f"bad checkpoint id {data['id']!r}")
    if data["parent"] is not None and not (isinstance(data["parent"], str) and ID.fullmatch(data["parent"])):
        raise ValueError(f"bad parent id {data['parent']!r}")
    if not isinstance(data["created"], int | float) or not is_int(data["own_bytes"]):
        raise ValueError("bad creation time or size")
    if not isinstance(data["meta"], dict) or not isinstance(data["blobs"], dict):
        raise ValueError("bad meta or blobs")
    try:
        name = None if data["name"] is None else validate_checkpoint_name(data["name"])
        machine = validate_name(data["machine"], "machine name")
        labels = validate_labels(data["labels"])
        blobs = {validate_name(k, "blob name"): BlobIndex.from_json(v, newer.get(k), budget)
                 for k, v in data["blobs"].items()}
    except InvalidArgument as e:
        raise ValueError(str(e)) from e
    return HistoryEntry(id=data["id"], name=name, machine=machine, parent=data["parent"],
                        created=data["created"], labels=labels, blobs=blobs, meta=data["meta"],
                        own_bytes=data["own_bytes"])


def is_int(value: object) -> bool:
    """A whole number as JSON gives it (bool is an int to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_hash(value: object) -> str:
    if not (isinstance(value, str) and HASH.fullmatch(value)):
        raise ValueError(f"bad chunk hash {value!r}")
    return value
