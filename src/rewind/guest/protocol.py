"""Framing shared by the guest agent and the host client.

A frame is MAGIC, the header length (u32), the payload length (u32), a JSON
header and a binary payload. The magic lets a reader find the next frame after
a peer vanished mid-frame. This module is copied into the guest image, so it
uses the standard library only and imports nothing else from rewind.
"""

from __future__ import annotations

import json
import struct

MAGIC = b"RWD\x01"
_PREFIX = struct.Struct(">4sII")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 20  # data is sent in frames of at most this size
CHUNK = 256 * 1024  # the size senders cut data into


def encode(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(head), len(payload)) + head + payload


class Decoder:
    """Incremental decoder: feed bytes, take out complete frames.

    On bytes that are not a frame it skips forward to the next MAGIC, so a
    stream that starts mid-frame (a previous peer died) resynchronises.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def buffered(self) -> int:
        """The bytes fed and not yet taken out as frames."""
        return len(self._buf)

    def next(self) -> tuple[dict, bytes] | None:
        while True:
            if len(self._buf) < PREFIX_SIZE:
                return None
            magic, hlen, plen = _PREFIX.unpack_from(self._buf)
            if magic != MAGIC or hlen > MAX_HEADER or plen > MAX_PAYLOAD:
                self._skip()
                continue
            end = PREFIX_SIZE + hlen + plen
            if len(self._buf) < end:
                return None
            try:
                header = json.loads(bytes(self._buf[PREFIX_SIZE : PREFIX_SIZE + hlen]))
                if not isinstance(header, dict):
                    raise ValueError("header is not an object")
            except (ValueError, RecursionError):  # deep nesting is refused like any bad header
                self._skip()
                continue
            payload = bytes(self._buf[PREFIX_SIZE + hlen : end])
            del self._buf[:end]
            return header, payload

    def _skip(self) -> None:
        at = self._buf.find(MAGIC, 1)
        cut = at if at >= 0 else max(len(self._buf) - len(MAGIC) + 1, 1)
        del self._buf[:cut]
