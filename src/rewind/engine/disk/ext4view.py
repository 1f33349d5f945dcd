"""An ext4 file system read on the host from a disk's qcow2 chain (qcow2.py), as the guest
would find it after a crash: the journal's committed transactions are replayed in memory.

A checkpoint stops the guest without asking it anything, so the metadata of its last
writes may still be in the journal only; replaying it here is what the guest's kernel
would do when mounting that disk. (What the guest had not written to its disk at all, in
its page cache, is not here: see diff.py, which has the guest flush first.)

Parsing of inodes, extents and directories is dissect.extfs's.
"""

from __future__ import annotations

import io
import stat
import struct

from dissect.extfs import ExtFS
from dissect.extfs.exceptions import Error as ExtError

from rewind.engine.disk.qcow2 import Chain, LayerError
from rewind.results import FileStat

_JBD2_MAGIC = 0xC03B3998
_DESCRIPTOR, _COMMIT, _REVOKE = 1, 2, 5
_INCOMPAT_REVOKE, _INCOMPAT_64BIT, _INCOMPAT_CSUM_V2, _INCOMPAT_CSUM_V3 = 0x1, 0x2, 0x8, 0x10
_FLAG_ESCAPE, _FLAG_SAME_UUID, _FLAG_LAST_TAG = 1, 2, 8
_JOURNAL_INO = 8
ROOT_INO = 2
_FT_DIR = 2  # a directory entry's file type for a directory
_ATIME = slice(8, 12)  # i_atime; its nanoseconds are at 0x8c, in the large inode
_ATIME_EXTRA = slice(0x8C, 0x90)
_CHECKSUM_LO, _CHECKSUM_HI = slice(0x7C, 0x7E), slice(0x82, 0x84)


class FsError(LayerError):
    """A disk whose file system cannot be read on the host."""


_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "char", stat.S_IFBLK: "block"}


class _Disk(io.RawIOBase):
    """The chain as a seekable file, with replayed journal blocks laid over it."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.pos = 0
        self.block_size = 4096
        self.overlay: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.chain.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def pread(self, offset: int, size: int) -> bytes:
        data = self.chain.read(offset, size)
        if self.overlay:
            bs = self.block_size
            first, last = offset // bs, (offset + size - 1) // bs
            patched = None
            for block in range(first, last + 1):
                over = self.overlay.get(block)
                if over is None:
                    continue
                patched = bytearray(data) if patched is None else patched
                start, end = max(block * bs, offset), min((block + 1) * bs, offset + size)
                patched[start - offset:end - offset] = over[start - block * bs:end - block * bs]
            if patched is not None:
                data = bytes(patched)
        return data

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(self.chain.size - self.pos, 0)
        data = self.pread(self.pos, size)
        self.pos += len(data)
        return data

    def readinto(self, buf) -> int:  # noqa: ANN001 (io's signature)
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


class Ext4View:
    """One ext4 file system on a chain, read-only."""

    def __init__(self, chain: Chain) -> None:
        self.disk = _Disk(chain)
        try:
            self.fs = ExtFS(self.disk)
            self.disk.block_size = self.fs.block_size
            self.replayed = _replay(self.fs, self.disk)
            if self.replayed:  # the superblock and group descriptors may be among them
                self.fs = ExtFS(self.disk)
        except (ExtError, LayerError, OSError, EOFError, struct.error) as e:
            raise FsError(f"the disk's ext4 file system cannot be read: {e}") from e
        sb = self.fs.sb
        self.block_size = self.fs.block_size
        self.inode_size = sb.s_inode_size
        self.inodes_per_group = sb.s_inodes_per_group
        self.inodes_count = sb.s_inodes_count
        # Each group's inode table: its first block, and how many it spans.
        self.tables = [self._table_block(g) for g in range(self.fs.groups_count)]
        self.table_blocks = -(-self.inodes_per_group * self.inode_size // self.block_size)

    def _table_block(self, group: int) -> int:
        gd = self.fs._read_group_desc(group)
        return (getattr(gd, "bg_inode_table_hi", 0) << 32) | gd.bg_inode_table_lo

    def block(self, n: int) -> bytes:
        return self.disk.pread(n * self.block_size, self.block_size)

    def raw_inode(self, ino: int) -> bytes:
        """An inode's record with what a read alone changes (access time, checksum) blanked."""
        group, index = divmod(ino - 1, self.inodes_per_group)
        offset = self.tables[group] * self.block_size + index * self.inode_size
        raw = bytearray(self.disk.pread(offset, self.inode_size))
        for s in (_ATIME, _ATIME_EXTRA, _CHECKSUM_LO, _CHECKSUM_HI):
            raw[s] = bytes(s.stop - s.start)
        return bytes(raw)

    def stat(self, ino: int) -> FileStat | None:
        """An inode's stat, or None if it is not in use."""
        try:
            node = self.fs.get_inode(ino)
            i = node.inode
            if i.i_links_count == 0 or i.i_mode == 0:
                return None
            kind = _TYPES.get(stat.S_IFMT(i.i_mode), "unknown")
            return FileStat(type=kind, mode=stat.S_IMODE(i.i_mode), uid=(i.i_uid_high << 16) | i.i_uid,
                            gid=(i.i_gid_high << 16) | i.i_gid, size=node.size, mtime_ns=node.mtime_ns,
                            target=node.link if kind == "symlink" else None)
        except (ExtError, OSError, EOFError, struct.error) as e:
            raise FsError(f"inode {ino} cannot be read: {e}") from e

    def runs(self, ino: int) -> list[list[int]]:
        """Where a file's data lies: [[first block, count]], holes left out."""
        try:
            return [[int(start), int(count)] for start, count in self.fs.get_inode(ino).dataruns()
                    if start is not None]
        except (ExtError, OSError, EOFError, struct.error) as e:
            raise FsError(f"inode {ino} cannot be read: {e}") from e

    def entries(self, ino: int) -> dict[str, tuple[int, bool]]:
        """A directory's names, each with its inode and whether it is a directory ('.' and
        '..' left out). Parsed here, not by dissect: a whole file system's are read once."""
        try:
            data = self.fs.get_inode(ino).open().read()
        except (ExtError, OSError, EOFError, struct.error) as e:
            raise FsError(f"directory inode {ino} cannot be read: {e}") from e
        found: dict[str, tuple[int, bool]] = {}
        off = 0
        while off + 8 <= len(data):
            child, rec_len, name_len, ftype = struct.unpack_from("<IHBB", data, off)
            if rec_len < 8:
                raise FsError(f"directory inode {ino} is damaged at offset {off}")
            if child and name_len:
                name = data[off + 8:off + 8 + name_len].decode(errors="surrogateescape")
                if name not in (".", ".."):
                    found[name] = (child, ftype == _FT_DIR)
            off += rec_len
        return found

    def read_file(self, ino: int, limit: int) -> bytes:
        """Up to `limit` bytes of a regular file."""
        try:
            return self.fs.get_inode(ino).open().read(limit)
        except (ExtError, OSError, EOFError, struct.error) as e:
            raise FsError(f"inode {ino} cannot be read: {e}") from e


def _replay(fs: ExtFS, disk: _Disk) -> set[int]:
    """Lay the journal's committed transactions over the disk, as a mount's recovery would;
    returns the file system blocks they cover."""
    if not fs.sb.s_feature_compat & 0x4 or fs.sb.s_journal_inum != _JOURNAL_INO:  # no internal journal
        return set()
    journal = fs.get_inode(_JOURNAL_INO).open()
    bs = fs.block_size

    def block(n: int) -> bytes:
        journal.seek(n * bs)
        return journal.read(bs)

    sb = block(0)
    magic, _, _, jbs, maxlen, first, sequence, start = struct.unpack_from(">IIIIIIII", sb)
    incompat = struct.unpack_from(">I", sb, 40)[0]
    if magic != _JBD2_MAGIC or jbs != bs or start == 0:
        return set()  # a clean journal: nothing to replay
    if incompat & _INCOMPAT_CSUM_V3:
        tag_size = 16
    else:
        tag_size = 12 + (2 if incompat & _INCOMPAT_CSUM_V2 else 0) - (0 if incompat & _INCOMPAT_64BIT else 4)
    tail = 4 if incompat & (_INCOMPAT_CSUM_V2 | _INCOMPAT_CSUM_V3) else 0
    wide = bool(incompat & _INCOMPAT_64BIT)

    def advance(n: int) -> int:
        n += 1
        return first if n >= maxlen else n

    writes: list[tuple[int, int, int, bool]] = []  # (sequence, fs block, journal block, escaped)
    revoked: dict[int, int] = {}
    pending: list[tuple[int, int, int, bool]] = []
    pos, seq = start, sequence
    for _ in range(maxlen):
        data = block(pos)
        h_magic, h_type, h_seq = struct.unpack_from(">III", data)
        if h_magic != _JBD2_MAGIC or h_seq != seq:
            break
        if h_type == _DESCRIPTOR:
            off, data_pos = 12, pos
            while off + tag_size <= bs - tail:
                if tag_size == 16:
                    lo, flags, hi = struct.unpack_from(">III", data, off)
                else:
                    lo, _, flags = struct.unpack_from(">IHH", data, off)
                    hi = struct.unpack_from(">I", data, off + 8)[0] if wide else 0
                data_pos = advance(data_pos)
                pending.append((seq, (hi << 32) | lo, data_pos, bool(flags & _FLAG_ESCAPE)))
                off += tag_size + (0 if flags & _FLAG_SAME_UUID else 16)
                if flags & _FLAG_LAST_TAG:
                    break
            pos = data_pos
        elif h_type == _REVOKE and incompat & _INCOMPAT_REVOKE:
            count = struct.unpack_from(">I", data, 12)[0]
            width = 8 if wide else 4
            for off in range(16, min(count, bs), width):
                b = struct.unpack_from(">Q" if wide else ">I", data, off)[0]
                revoked[b] = max(revoked.get(b, 0), seq)
        elif h_type == _COMMIT:
            writes.extend(pending)
            pending = []
            seq += 1
        pos = advance(pos)
    covered: set[int] = set()
    for seq_of, fs_block, jpos, escaped in writes:
        if revoked.get(fs_block, -1) >= seq_of:
            continue
        content = block(jpos)
        if escaped:
            content = struct.pack(">I", _JBD2_MAGIC) + content[4:]
        disk.overlay[fs_block] = content
        covered.add(fs_block)
    return covered
