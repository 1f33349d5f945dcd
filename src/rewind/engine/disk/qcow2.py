"""Reading a machine's disk on the host from its chain of qcow2 layers, without QEMU.

A layer maps virtual clusters to its own file through two levels of tables (L1, L2); a
cluster a layer does not hold is read from the layer below. Rewind's layers are made by
QEMU (`qemu-img convert`, `blockdev-snapshot`): uncompressed, unencrypted, no external data
file, no subclusters. Anything else is refused rather than misread.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from rewind.errors import RewindError

_MAGIC = b"QFI\xfb"
_OFFSET_MASK = 0x00FF_FFFF_FFFF_FE00  # bits 9-55 of an L1 or L2 entry
_COMPRESSED = 1 << 62
_ZERO = 1  # v3: the cluster reads as zeros
_INCOMPAT_KNOWN = 0b0000_0011  # dirty, corrupt; anything else (data file, subclusters...) is refused


class LayerError(RewindError):
    """A disk layer rewind cannot read."""


@dataclass(frozen=True)
class LayerId:
    """Which file a layer is: frozen layers never change, so this names their content."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> LayerId:
        st = path.stat()
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def key(self) -> str:
        return f"{self.dev}-{self.ino}-{self.size}-{self.mtime_ns}"


@dataclass
class Layer:
    """One qcow2 file, open for reading."""

    path: Path
    fd: int
    cluster_bits: int
    virtual_size: int
    l1: tuple[int, ...]
    _l2: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: Path) -> Layer:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise LayerError(f"disk layer {path} cannot be opened: {e}") from e
        try:
            head = os.pread(fd, 104, 0)
            if len(head) < 72 or head[:4] != _MAGIC:
                raise LayerError(f"{path} is not a qcow2 file")
            version, cluster_bits, size, crypt, l1_size, l1_offset = struct.unpack_from(">I12xIQIIQ", head, 4)
            incompat = struct.unpack_from(">Q", head, 72)[0] if version >= 3 else 0
            if crypt or incompat & ~_INCOMPAT_KNOWN or not 9 <= cluster_bits <= 21:
                raise LayerError(f"{path}: a qcow2 feature rewind does not read "
                                 "(encryption, a data file, subclusters)")
            raw = os.pread(fd, l1_size * 8, l1_offset)
            l1 = struct.unpack(f">{l1_size}Q", raw)
        except (OSError, struct.error) as e:
            os.close(fd)
            raise LayerError(f"disk layer {path} cannot be read: {e}") from e
        except LayerError:
            os.close(fd)
            raise
        return cls(path, fd, cluster_bits, size, l1)

    def close(self) -> None:
        os.close(self.fd)

    @property
    def cluster_size(self) -> int:
        return 1 << self.cluster_bits

    def _table(self, index: int) -> tuple[int, ...] | None:
        if index >= len(self.l1) or not self.l1[index] & _OFFSET_MASK:
            return None
        table = self._l2.get(index)
        if table is None:
            entries = self.cluster_size // 8
            raw = os.pread(self.fd, self.cluster_size, self.l1[index] & _OFFSET_MASK)
            table = struct.unpack(f">{entries}Q", raw)
            self._l2[index] = table
        return table

    def entry(self, cluster: int) -> int:
        """The L2 entry of a virtual cluster (0: not held by this layer)."""
        per_table = self.cluster_size // 8
        table = self._table(cluster // per_table)
        return 0 if table is None else table[cluster % per_table]

    def clusters(self) -> set[int]:
        """The virtual clusters this layer holds (written or zeroed)."""
        per_table = self.cluster_size // 8
        held: set[int] = set()
        for index in range(len(self.l1)):
            table = self._table(index)
            if table is not None:
                base = index * per_table
                held.update(base + i for i, e in enumerate(table) if e)
        return held


class Chain:
    """A disk as its guest sees it: layers base first, the top one last.

    `reading`, if given, are files that read as the same disk (frozen layers merged into one
    file, see diskchain.py): reads walk those instead of every layer. A cluster's lookup
    walked all 61 layers after the agent loop's 20 rounds, and a try's diff doubled (0.25 to
    0.5 s). `layers` stay the chain's own, for what asks which layer holds what."""

    def __init__(self, paths: list[Path], reading: list[Path] | None = None) -> None:
        if not paths:
            raise LayerError("a disk needs at least one layer")
        self.layers: list[Layer] = []
        self._readers: list[Layer] = []
        try:
            for p in paths:
                self.layers.append(Layer.open(p))
            own = {layer.path: layer for layer in self.layers}
            for p in reading or ():
                self._readers.append(own.get(p) or Layer.open(p))
        except LayerError:
            self.close()
            raise
        self._readers = self._readers or self.layers
        sizes = {layer.cluster_bits for layer in self.layers + self._readers}
        if len(sizes) != 1:
            self.close()
            raise LayerError("the disk's layers have different cluster sizes")
        self.cluster_bits = sizes.pop()
        self.size = self.layers[-1].virtual_size

    def close(self) -> None:
        for layer in {id(layer): layer for layer in self.layers + self._readers}.values():
            layer.close()
        self.layers, self._readers = [], []

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cluster(self, cluster: int) -> tuple[Layer, int] | None:
        """The layer holding a cluster and the entry there; None if it reads as zeros."""
        for layer in reversed(self._readers):
            e = layer.entry(cluster)
            if e:
                if e & _COMPRESSED:
                    raise LayerError(f"{layer.path}: compressed clusters are not read")
                return None if e & _ZERO or not e & _OFFSET_MASK else (layer, e & _OFFSET_MASK)
        return None

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes of the virtual disk from `offset` (zeros past its end)."""
        out = bytearray(size)
        csize = 1 << self.cluster_bits
        pos = offset
        while pos < offset + size:
            cluster, within = divmod(pos, csize)
            n = min(csize - within, offset + size - pos)
            held = self._cluster(cluster)
            if held is not None:
                layer, host = held
                data = os.pread(layer.fd, n, host + within)
                out[pos - offset:pos - offset + len(data)] = data
            pos += n
        return bytes(out)
