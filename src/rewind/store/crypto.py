"""Encrypted stores (after restic's repository keys). docs/format.md §2.11 is the contract.

A store made with encryption has two random 256-bit keys: `encrypt`, the AES-256-GCM key of
every object it writes (chunks, manifests, exports), and `chunk_id`, the BLAKE3 key that
names chunks, so that equal chunks still deduplicate while a name says nothing about what it
holds. Both are kept in key files, `keys/<16 hex>`, each sealed under a key that scrypt
derives from one password: several files (slots) can open the same store, each with its own
password, and changing a password never touches the data.

No cipher is written here: sealing is cryptography's AESGCM, a fresh random 96-bit nonce per
object, stored in front of its ciphertext; the kind of object is the associated data, so an
object of one kind cannot be passed off as another.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from rewind.errors import InvalidArgument
from rewind.store.disk import decode_chunk, encode_chunk
from rewind.store.durable import fsync_dir, os_errors, write_tmp
from rewind.store.errors import CorruptChunk, StoreError, WrongPassword

NONCE = 12
KEY_VERSION = 1
# scrypt's cost: 2^15 x 8 x 128 bytes = 32 MiB of memory and about 0.1 s per try on this
# host. Each file records its own, so a later rewind can raise them for new slots only.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
# A key file asking for more is refused, not obeyed: whoever can write the folder must not be
# able to make every opening take all memory or hours (scrypt needs 128·n·r bytes, time ~ n·r·p).
MAX_SCRYPT_MEMORY = 1 << 30
MAX_SCRYPT_P = 16
SALT_BYTES = 32
# The associated data of each kind of object: an object of one kind never opens as another.
KEY_FILE, CHUNK, MANIFEST, EXPORT = b"rewind key", b"rewind chunk", b"rewind manifest", b"rewind export"
NAME_CLAIM = b"rewind name"  # a name claim in a bucket (docs/format.md §2.11)

PasswordSource = str | Callable[[], str] | None
"""A password, or a function that asks for it (a terminal prompt), or None: the environment."""


@dataclass(frozen=True)
class Keys:
    """A store's two secret keys (never shown: not in a repr, so not in a traceback or a log)."""

    encrypt: bytes = field(repr=False)
    chunk_id: bytes = field(repr=False)

    @classmethod
    def new(cls) -> Keys:
        return cls(encrypt=secrets.token_bytes(32), chunk_id=secrets.token_bytes(32))

    @functools.cached_property
    def _aead(self) -> AESGCM:
        return AESGCM(self.encrypt)

    def seal(self, kind: bytes, data: bytes | memoryview) -> bytes:
        nonce = secrets.token_bytes(NONCE)
        return nonce + self._aead.encrypt(nonce, bytes(data), kind)

    def unseal(self, kind: bytes, sealed: bytes) -> bytes:
        """The plaintext; InvalidTag if the object was changed, or sealed with other keys."""
        if len(sealed) < NONCE + 16:
            raise InvalidTag
        return self._aead.decrypt(sealed[:NONCE], sealed[NONCE:], kind)

    def unseal_or_none(self, kind: bytes, sealed: bytes) -> bytes | None:
        """The plaintext, or None if the object fails its tag."""
        try:
            return self.unseal(kind, sealed)
        except InvalidTag:
            return None

    def name_chunk(self, data: bytes | memoryview) -> str:
        return blake3.blake3(data, key=self.chunk_id).hexdigest()

    def name_key(self, name: str) -> str:
        """A checkpoint name as a bucket's name claim is keyed: keyed BLAKE3 of the name, set
        apart from chunk names by a prefix no chunk name is hashed with."""
        return blake3.blake3(NAME_CLAIM + b"\0" + name.encode(), key=self.chunk_id).hexdigest()

    def check_value(self) -> bytes:
        """16 bytes that tell these keys from others without revealing them (an export's header)."""
        return blake3.blake3(b"rewind key check", key=self.chunk_id).digest()[:16]

    def to_json(self) -> dict[str, str]:
        return {"encrypt": _b64(self.encrypt), "chunk_id": _b64(self.chunk_id)}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> Keys:
        keys = cls(encrypt=_unb64(data["encrypt"]), chunk_id=_unb64(data["chunk_id"]))
        if len(keys.encrypt) != 32 or len(keys.chunk_id) != 32:
            raise ValueError("a key is not 256 bits")
        return keys


class SealedChunks:
    """How an encrypted store names, codes and checks chunks: named by keyed BLAKE3 of their
    bytes, stored as a sealed zstd frame."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def hash(self, data: bytes | memoryview) -> str:
        return self.keys.name_chunk(data)

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one codec per store, a handful of sizes)
    def zeros_hash(self, n: int) -> str:
        return self.hash(bytes(n))

    def encode(self, data: bytes | memoryview) -> bytes:
        return self.keys.seal(CHUNK, encode_chunk(data))

    def decode(self, h: str, stored: bytes) -> bytes:
        try:
            frame = self.keys.unseal(CHUNK, stored)
        except InvalidTag as e:
            raise CorruptChunk(f"chunk {h} is damaged: it fails its authentication") from e
        return decode_chunk(h, frame, self.hash)


@dataclass(frozen=True)
class KeySlot:
    """One key file, as `rewind store key list` shows it (its secret part still sealed)."""

    id: str
    created: float
    host: str
    n: int
    r: int
    p: int
    salt: bytes
    data: bytes

    def to_json(self) -> dict[str, object]:
        return {"version": KEY_VERSION, "created": self.created, "host": self.host, "kdf": "scrypt",
                "n": self.n, "r": self.r, "p": self.p, "salt": _b64(self.salt), "data": _b64(self.data)}

    @classmethod
    def from_json(cls, slot_id: str, data: dict) -> KeySlot:
        if data["version"] != KEY_VERSION or data["kdf"] != "scrypt":
            raise ValueError(f"version {data['version']!r}, kdf {data['kdf']!r} unknown")
        n, r, p = data["n"], data["r"], data["p"]
        if not all(isinstance(v, int) and v > 0 for v in (n, r, p)) or n < 2 or n & (n - 1) \
                or 128 * n * r > MAX_SCRYPT_MEMORY or p > MAX_SCRYPT_P:
            raise ValueError(f"implausible scrypt parameters n={n!r} r={r!r} p={p!r}")
        return cls(id=slot_id, created=float(data["created"]), host=str(data["host"]), n=n, r=r, p=p,
                   salt=_unb64(data["salt"]), data=_unb64(data["data"]))

    def unlock(self, password: str) -> Keys | None:
        """The store's keys, or None if `password` is not this slot's. Remembered for the
        process's life (see _unlocked)."""
        memo = self._memo_key(password)
        if memo in _unlocked:
            return _unlocked[memo]
        wrapper = Keys(encrypt=_derive(password, self.salt, self.n, self.r, self.p), chunk_id=b"")
        try:
            keys = Keys.from_json(json.loads(wrapper.unseal(KEY_FILE, self.data)))
        except InvalidTag:
            return None
        _unlocked[memo] = keys
        return keys

    def _memo_key(self, password: str) -> str:
        """Names this file opened with this password; it holds neither (a keyed hash whose key
        is the file itself, so the same password gives unrelated names in two files)."""
        return blake3.blake3(password.encode(), key=blake3.blake3(self.salt + self.data).digest()).hexdigest()


# Keys a key file opened with a password in this process, by KeySlot._memo_key: scrypt costs
# 0.13 s here, and a process opens its store on each checkpoint and restore (twice per
# checkpoint with its committer). A store open in this process holds the same keys anyway.
_unlocked: dict[str, Keys] = {}


def unlocked_for_child() -> bytes:
    """What this process unlocked, for a helper it starts (handed over through a pipe, never
    the environment or a file): the helper then opens those stores with the password it
    was given without paying scrypt again."""
    if not _unlocked:
        return b""
    return json.dumps({memo: keys.to_json() for memo, keys in _unlocked.items()}).encode()


def take_unlocked(data: bytes) -> None:
    """Remember what a parent process handed over (unlocked_for_child). Each entry still
    needs the same key file and password to be used: a wrong password unlocks nothing."""
    for memo, keys in json.loads(data).items():
        _unlocked[memo] = Keys.from_json(keys)


def new_slot(keys: Keys, password: str) -> KeySlot:
    """A new key file (not written yet) that opens `keys` with `password`."""
    if not password:
        raise InvalidArgument("an empty password protects nothing")
    salt = secrets.token_bytes(SALT_BYTES)
    wrapper = Keys(encrypt=_derive(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P), chunk_id=b"")
    return KeySlot(id=secrets.token_hex(8), created=time.time(), host=socket.gethostname(),
                   n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, salt=salt,
                   data=wrapper.seal(KEY_FILE, json.dumps(keys.to_json()).encode()))


def add_key(folder: Path, keys: Keys, password: str) -> str:
    """A new key file in `folder` that opens `keys` with `password`, durable before this
    returns (written in `folder`, fsync'ed, renamed, the folder fsync'ed); its id."""
    slot = new_slot(keys, password)
    with os_errors(f"write a key file in {folder}"):
        os.rename(write_tmp(folder, json.dumps(slot.to_json()).encode()), folder / slot.id)
        fsync_dir(folder)
    return slot.id


def key_slots(folder: Path) -> list[KeySlot]:
    """Every key file in `folder` that parses, oldest first (a temporary file is none)."""
    slots = []
    with os_errors(f"list the key files in {folder}"):
        for path in folder.iterdir():
            if path.name.endswith(".tmp"):
                continue
            try:
                slots.append(KeySlot.from_json(path.name, json.loads(path.read_bytes())))
            except (ValueError, KeyError, TypeError) as e:
                if not path.exists():  # removed meanwhile
                    continue
                raise StoreError(f"key file {path} is damaged: {e}") from e
    return sorted(slots, key=lambda s: (s.created, s.id))


def unlock(folder: Path, password: str, where: object) -> tuple[Keys, str]:
    """The keys of the store whose key files are in `folder`, and the slot that opened them;
    WrongPassword if none does."""
    return unlock_slots(key_slots(folder), password, where)


def unlock_slots(slots: list[KeySlot], password: str, where: object,
                 check: bytes | None = None) -> tuple[Keys, str]:
    """The keys one of `slots` opens with `password`, and that slot's id; WrongPassword if none
    does. With `check` (a bucket's config), a slot that opens to other keys (left by a making
    that died before its config) counts as not opening."""
    if not slots:
        raise StoreError(f"the checkpoint store at {where} is damaged: it is encrypted and has no key file")
    for slot in slots:
        try:
            keys = slot.unlock(password)
        except (ValueError, KeyError, TypeError, MemoryError) as e:
            raise StoreError(f"key file {slot.id} of {where} is damaged: {e}") from e
        if keys is not None and (check is None or keys.check_value() == check):
            return keys, slot.id
    raise WrongPassword(f"wrong password for the checkpoint store at {where}: none of its "
                        f"{len(slots)} key(s) opens with it")


def check_removable(ids: list[str], slot_id: str) -> None:
    """Refuse to remove a key the store lacks, or its last one (it could never be opened again)."""
    if slot_id not in ids:
        raise InvalidArgument(f"the store has no key {slot_id!r} (it has {', '.join(ids)})")
    if len(ids) == 1:
        raise InvalidArgument(f"key {slot_id} is the store's last: add another first")


def remove_key(folder: Path, slot_id: str) -> None:
    """Remove one key file; refuses the last one."""
    check_removable([s.id for s in key_slots(folder)], slot_id)
    with os_errors(f"remove key file {slot_id}"):
        (folder / slot_id).unlink()
        fsync_dir(folder)


def password_from_env() -> str | None:
    """$REWIND_PASSWORD_FILE's content (less one final newline), else $REWIND_PASSWORD, else None."""
    path = os.environ.get("REWIND_PASSWORD_FILE")
    if path:
        try:
            return Path(path).read_text().removesuffix("\n")
        except OSError as e:
            raise WrongPassword(f"cannot read the password file {path}: {e.strerror}") from e
    return os.environ.get("REWIND_PASSWORD") or None


def password(source: PasswordSource, where: object) -> str:
    """The password to open or make the store at `where`: given, else from the environment,
    else asked for by `source`'s function; WrongPassword if there is none."""
    if isinstance(source, str):
        return source
    found = password_from_env()
    if found is None and source is not None:
        found = source()
    if not found:
        raise WrongPassword(f"the checkpoint store at {where} is encrypted: give its password in "
                            "REWIND_PASSWORD_FILE or REWIND_PASSWORD")
    return found


def _derive(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(password.encode())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)
