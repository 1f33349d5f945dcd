"""Who a home believes: its own signing key, the keys it trusts, and what it runs.

Every checkpoint a home commits is signed with its key (`<home>/keys/signing.key`, made on
first need; store/signing.py). Restoring a point, creating a machine from one and importing
an export run only points signed by this home or by a key in its trust list
(`<home>/trust.json`, `rewind trust add`); a point whose signature does not match it is
refused always. Points written before signing existed are unsigned: they run from this
home's own store (`<home>/store`, which only this home writes), and from a shared store or an
export only when allowed (`--allow-unsigned`, REWIND_ALLOW_UNSIGNED=1). docs/operations.md
("Trust") says what this stops.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rewind.errors import AlreadyExists, InvalidArgument, NotFound, RewindError
from rewind.home import Home
from rewind.store.durable import fsync_dir, os_errors, replace_durably, write_tmp
from rewind.store.errors import UntrustedCheckpoint
from rewind.store.locks import held_file
from rewind.store.model import CheckpointManifest, Seal, validate_name
from rewind.store.signing import SigningKey, fingerprint, parse_public, public_text, verify
from rewind.store.store import Store
from rewind.store.transfer import import_checkpoint

TRUST_VERSION = 1
ALLOW_UNSIGNED = "REWIND_ALLOW_UNSIGNED"
_YES, _NO = ("1", "true", "yes"), ("0", "false", "no")


def signing_key(home: Home) -> SigningKey:
    """The home's key, made (0600, durably) the first time one is needed."""
    if not home.signing_key.exists():
        _place_key(home, SigningKey.generate())
    return _read_key(home.signing_key)


def use_key(home: Home, key: SigningKey) -> None:
    """Make `key` the signing key of `home`, which must have none or this one: the homes of a
    fleet's nodes sign as the home that drives it, so that each runs the points of the others."""
    _place_key(home, key)
    if _read_key(home.signing_key).public != key.public:
        raise InvalidArgument(f"the home {home.root} signs with another key already; move "
                              f"{home.signing_key} away to give it this one")


def _place_key(home: Home, key: SigningKey) -> None:
    """Write `key` as the home's unless it has one. Two processes making it at once keep the
    same one: a key is linked into place, never over another."""
    path = home.signing_key
    with os_errors(f"write the home's signing key at {path}"):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = write_tmp(path.parent, key.to_pem())  # 0600, fsync'ed
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # made first by another process, or before: that one is the home's
        finally:
            tmp.unlink()
        fsync_dir(path.parent)


def _read_key(path: Path) -> SigningKey:
    try:
        return SigningKey.from_pem(path.read_bytes())
    except (OSError, ValueError) as e:
        raise RewindError(f"the home's signing key at {path} is unreadable ({e}); move it away to "
                          "make a new one (points it signed then need `rewind trust add` of its "
                          "public key)") from e


def own_key(home: Home) -> str | None:
    """The text of this home's public key; None if it has none yet (it has signed nothing)."""
    return _read_key(home.signing_key).public if home.signing_key.exists() else None


@dataclass(frozen=True)
class TrustedKey:
    """A public key this home trusts, with the name it was given (shown instead of it)."""

    key: str  # public_text form
    name: str | None = None
    added: float = 0.0

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)


@dataclass
class TrustList:
    """`<home>/trust.json`: the keys this home trusts besides its own."""

    keys: list[TrustedKey] = field(default_factory=list)
    version: int = TRUST_VERSION

    def find(self, which: str) -> TrustedKey | None:
        """The entry `which` names: its key, its name or its fingerprint."""
        with suppress(InvalidArgument):  # else a name or a fingerprint
            which = public_text(parse_public(which))
        return next((k for k in self.keys if which in (k.key, k.name, k.fingerprint)), None)

    def to_json(self) -> dict:
        return {"version": self.version, "keys": [asdict(k) for k in self.keys]}

    @classmethod
    def from_json(cls, data: dict) -> TrustList:
        if data.get("version") != TRUST_VERSION:
            raise ValueError(f"version {data.get('version')!r} unknown")
        return cls(keys=[TrustedKey(key=public_text(parse_public(k["key"])), name=k["name"],
                                    added=float(k["added"])) for k in data["keys"]])


def trust_list(home: Home) -> TrustList:
    """The home's trust list (empty if it has none)."""
    try:
        return TrustList.from_json(json.loads(home.trust_file.read_bytes()))
    except FileNotFoundError:
        return TrustList()
    except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as e:
        raise RewindError(f"the trust list {home.trust_file} is damaged ({e}); "
                          "fix or remove it, then add the keys again") from e


def trust(home: Home, key: str, name: str | None = None) -> TrustedKey:
    """Trust `key` (public_text form) from now on, under `name` if given."""
    text = public_text(parse_public(key))
    if name is not None:
        validate_name(name, "name for a key")
    if text == own_key(home):
        raise InvalidArgument("that is this home's own key: it is always trusted")
    with _changing(home) as trusted:
        if trusted.find(text) is not None:
            raise AlreadyExists(f"key {fingerprint(text)} is trusted already")
        if name is not None and trusted.find(name) is not None:
            raise AlreadyExists(f"another trusted key is named {name!r}")
        entry = TrustedKey(key=text, name=name, added=time.time())
        trusted.keys.append(entry)
    return entry


def distrust(home: Home, which: str) -> TrustedKey:
    """Stop trusting the key `which` names (its text, name or fingerprint)."""
    with _changing(home) as trusted:
        entry = trusted.find(which)
        if entry is None:
            raise NotFound(f"no trusted key is {which[:60]!r} (see `rewind trust list`)")
        trusted.keys.remove(entry)
    return entry


@contextmanager
def _changing(home: Home) -> Iterator[TrustList]:
    """The trust list, read under its lock, written back durably if the block ends well."""
    home.root.mkdir(parents=True, exist_ok=True)
    # Two changes at once must not each write back a list without the other's key.
    with held_file(home.root / "trust.lock", timeout=30) as held:
        if not held:
            raise RewindError(f"the trust list of {home.root} is being changed by another process")
        trusted = trust_list(home)
        yield trusted
        with os_errors(f"write {home.trust_file}"):
            replace_durably(home.trust_file, json.dumps(trusted.to_json(), indent=1).encode())


def describe(home: Home, seal: Seal) -> str:
    """Who signed a point, as this home sees it: "this home", a trusted key's name, a
    fingerprint ("..., not trusted"), "unsigned" or "bad signature"."""
    if seal.state == "unsigned" or seal.key is None:
        return "unsigned"
    fp = fingerprint(seal.key)
    if seal.state == "bad":
        return f"bad signature (claims {fp})"
    if seal.key == own_key(home):
        return f"this home ({fp})"
    entry = trust_list(home).find(seal.key)
    if entry is None:
        return f"{fp}, not trusted"
    return f"{entry.name} ({fp})" if entry.name else fp


def signer_of(home: Home, manifest: CheckpointManifest) -> str:
    """describe() of the signature that vouches for `manifest`."""
    return describe(home, verify(manifest))


def is_home_store(home: Home, store: Store) -> bool:
    """Whether `store` is this home's own folder store, which no one else writes."""
    return store.root.resolve() == home.store.resolve()  # a bucket's cache is elsewhere in the home


def check_signed(home: Home, manifest: CheckpointManifest, what: str, local: bool,
                 allow_unsigned: bool | None = None) -> None:
    """Refuse (UntrustedCheckpoint) to `what` ("restore", "run", "import") a point not signed by
    this home or a key it trusts, or whose signature is bad. An unsigned point is refused
    unless `allow_unsigned`; None: as REWIND_ALLOW_UNSIGNED says, else allowed only when it is
    `local` (in this home's own store)."""
    seal = verify(manifest)
    point = f"checkpoint {manifest.id[:12]}"
    if seal.state == "bad":
        raise UntrustedCheckpoint(f"will not {what} {point}: its signature (claiming key "
                                  f"{fingerprint(seal.key or '')}) does not match it; it was changed "
                                  "after it was signed")
    if seal.state == "good":
        assert seal.key is not None
        if seal.key == own_key(home) or trust_list(home).find(seal.key) is not None:
            return
        raise UntrustedCheckpoint(f"will not {what} {point}: it is signed by key {fingerprint(seal.key)}, "
                                  f"which this home does not trust (`rewind trust add {seal.key}` if you do)")
    if allow_unsigned is None:
        setting = os.environ.get(ALLOW_UNSIGNED, "").strip().lower()
        allow_unsigned = True if setting in _YES else False if setting in _NO else local
    if not allow_unsigned:
        where = "this home's own store" if local else "a shared store or a file"
        raise UntrustedCheckpoint(f"will not {what} {point}: it is unsigned and comes from {where} "
                                  f"(--allow-unsigned or {ALLOW_UNSIGNED}=1 runs it anyway)")


def import_signed(home: Home, store: Store, path: str | os.PathLike[str],
                  allow_unsigned: bool | None = None) -> CheckpointManifest:
    """Import the export at `path` into `store` if this home trusts its signer (an export comes
    from elsewhere: an unsigned one only with `allow_unsigned`, as check_signed says)."""
    def check(manifest: CheckpointManifest) -> None:
        check_signed(home, manifest, "import", local=False, allow_unsigned=allow_unsigned)
    return import_checkpoint(store, path, check=check)
