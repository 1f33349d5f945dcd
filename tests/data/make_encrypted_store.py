"""Make tests/data/store-encrypted, the frozen encrypted store (store format 3) that
tests/test_encrypted_store.py reads back. Run it once, from the repository's root:

    PYTHONPATH=src python tests/data/make_encrypted_store.py

The store is never rewritten after that: it pins the encrypted format (key files, sealed
packs and manifests) as a rewind of this version wrote it. Its contents are made from fixed
bytes, so the blobs' digests in the test do not change; the ciphertext does (random nonces,
random keys), which is why the store is committed rather than made by the test.

Password: "frozen-store-password". Checkpoints: "first" (blob "ram": 192 KiB, its last 64 KiB
zeros; blob "devstate": a few KiB of text) and "second", its child, whose "ram" differs in its
second 64 KiB chunk.
"""

from __future__ import annotations

import shutil
import sys
from io import BytesIO
from pathlib import Path

from rewind.store import open_store

PASSWORD = "frozen-store-password"
DEST = Path(__file__).parent / "store-encrypted"


def pattern(seed: int, n: int) -> bytes:
    """n bytes that compress a little and differ by seed (no randomness: the digests are pinned)."""
    return bytes((i * 7 + seed * 13 + (i >> 9)) % 251 for i in range(n))


def main() -> None:
    if DEST.exists():
        sys.exit(f"{DEST} exists: the frozen store is never made again")
    store = open_store(DEST, create=True, encrypt=True, password=PASSWORD)
    ram = pattern(1, 128 << 10) + bytes(64 << 10)
    devstate = b"device state of a frozen test store\n" * 100
    first = store.commit("frozen", {"ram": store.put_blob(BytesIO(ram), chunk_size=65536),
                                    "devstate": store.put_blob(BytesIO(devstate))}, name="first",
                         labels={"step": "1"})
    ram2 = ram[:65536] + pattern(2, 65536) + ram[131072:]
    store.commit("frozen", {"ram": store.put_blob(BytesIO(ram2), chunk_size=65536),
                            "devstate": store.put_blob(BytesIO(devstate))}, parent=first, name="second",
                 labels={"step": "2"})
    for folder in ("tmp", "locks"):  # nothing of a run's own belongs in the frozen copy
        shutil.rmtree(DEST / folder)
    for folder in (DEST / "chunks").iterdir():
        folder.rmdir()  # empty: git keeps no empty folders anyway


if __name__ == "__main__":
    main()
