"""Signed manifests: who wrote a checkpoint, checked. docs/format.md §2.12 is the contract.

A writer signs every manifest it commits with its Ed25519 key (a home's, given by the caller:
the store knows no home); the signature covers the manifest's signed bytes, its history
included, and is kept in the manifest as `signature`. Whoever can write a shared store can
still delete or replay manifests, but can no longer change one, or add one, in the name of a
key its reader trusts. Which keys a reader trusts is the caller's business (rewind/signers.py).

No signature scheme is written here: keys, signing and verifying are cryptography's Ed25519.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from rewind.errors import InvalidArgument
from rewind.store.model import SIGNATURE_VERSION, CheckpointManifest, ManifestSignature, Seal

KEY_PREFIX = "ed25519:"
# Put in front of the manifest's JSON before it is signed: a signature made for a manifest
# can never pass for one over some other kind of data that the same key signs later.
DOMAIN = b"rewind manifest signature 1\n"
# The mark an import sets in meta (transfer.py): the importing store's, not the signer's.
UNSIGNED_META = ("imported",)


class SigningKey:
    """An Ed25519 private key, and the text of its public half (never shown: not in a repr)."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = public_text(private.public_key())

    def __repr__(self) -> str:
        return f"SigningKey({fingerprint(self.public)})"

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes) -> SigningKey:
        """A key from its file (PKCS#8 PEM, unencrypted); ValueError if it is no Ed25519 key."""
        key = serialization.load_pem_private_key(data, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("not an Ed25519 private key")
        return cls(key)

    def to_pem(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())

    def sign(self, data: dict[str, Any]) -> ManifestSignature:
        """The signature of a manifest's JSON object (to_json), as it will be written."""
        sig = self._private.sign(signed_bytes(data))
        return ManifestSignature(key=self.public, sig=base64.b64encode(sig).decode())


def public_text(key: Ed25519PublicKey) -> str:
    """The short text form of a public key: "ed25519:" and the base64 of its 32 bytes."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public(text: str) -> Ed25519PublicKey:
    """A public key from its text form; InvalidArgument if it is not one."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise InvalidArgument(f"{str(text)[:60]!r} is not a public key: it looks like "
                              f"{KEY_PREFIX}<base64> (`rewind key show` prints one)")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as e:
        raise InvalidArgument(f"{text[:60]!r} is not a public key: its base64 is not 32 bytes") from e


def fingerprint(key_text: str) -> str:
    """A short name for a public key: 16 hex digits of the SHA-256 of its text form (as
    public_text writes it)."""
    return hashlib.sha256(key_text.encode()).hexdigest()[:16]


def signed_bytes(data: dict[str, Any]) -> bytes:
    """What a manifest's signature covers: DOMAIN, then the manifest's JSON object (as written,
    history included) without `signature` and without the keys of UNSIGNED_META in any
    point's meta, as compact JSON with sorted keys."""
    data = _without_marks({k: v for k, v in data.items() if k != "signature"})
    data["history"] = [_without_marks(entry) for entry in data["history"]]
    return DOMAIN + json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _without_marks(point: dict[str, Any]) -> dict[str, Any]:
    # A copy: the object shares its meta dicts with the manifest.
    return {**point, "meta": {k: v for k, v in point["meta"].items() if k not in UNSIGNED_META}}


def verify(manifest: CheckpointManifest) -> Seal:
    """Whether `manifest` is unsigned, signed by a key (good), or carries a signature that does
    not match it (bad). A point rebuilt from another manifest's history is judged by that
    manifest's signature. The verdict is kept on the manifest (its object is never changed)."""
    signed = manifest.vouched_by or manifest
    if signed.seal is None:
        signed.seal = _check(signed)
    return signed.seal


def _check(manifest: CheckpointManifest) -> Seal:
    signature = manifest.signature
    if signature is None:
        return Seal("unsigned")
    if signature.version != SIGNATURE_VERSION:
        return Seal("bad", signature.key)
    try:
        key = parse_public(signature.key)
        data = manifest.source if manifest.source is not None else manifest.to_json()
        key.verify(base64.b64decode(signature.sig, validate=True), signed_bytes(data))
    except (InvalidArgument, InvalidSignature, binascii.Error, ValueError):
        return Seal("bad", signature.key)
    return Seal("good", public_text(key))  # its canonical text, as trust lists hold it
