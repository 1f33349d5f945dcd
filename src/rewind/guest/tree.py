"""Folders as tar streams, for `cp -r` into and out of a machine.

Shared by the guest agent and the host (which unpacks what a guest sends with the same
checks), so it uses the standard library only and imports nothing else from rewind.

A folder is packed as a PAX tar stream: `.` for the folder itself, then what it holds by
name, each folder before its contents. Regular files, folders and symbolic links are kept,
with their permission bits and mtimes; owners are not (the side that unpacks owns what it
writes). Sockets, fifos and devices are left out, and hard links become copies.

Unpacking trusts nothing in the stream: a name that is absolute, holds `..` or passes
through something the stream made that is not a folder (a link, a file) is refused; links
are made, never followed; files are created, never opened if they exist. It all lands in
a temporary folder beside the target, renamed to the target at the end and removed on any
failure: a copy is there whole or not at all.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

ENCODING = "utf-8"  # names that are not UTF-8 travel as raw bytes (surrogateescape)
READ_SIZE = 256 * 1024  # a file's content is read in pieces of this size
KEPT = (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK)  # the kinds of file a copy takes
T = TypeVar("T")


class TreeError(Exception):
    """A copy that cannot be made; `kind` as the agent's error frames name it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Counts:
    """What a copy has moved so far (every folder, the copied one too; files' bytes)."""

    def __init__(self) -> None:
        self.files = self.folders = self.links = self.bytes = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def target(dest: str, name: str | None) -> str:
    """Where a copy of the folder `name` to `dest` lands, by `cp -r`'s rule: at `dest` if
    nothing is there (its parents are made), inside it as `dest/name` if it is a folder (or a
    link to one). Unlike cp, a copy never merges into a folder that exists: TreeError."""
    if not dest:
        raise TreeError("bad_request", "the destination is empty")
    if name is not None and (not name or "/" in name or name in (".", "..") or "\0" in name):
        raise TreeError("bad_request", f"not a folder name: {name!r}")
    dest = dest.rstrip("/") or "/"
    if os.path.isdir(dest):
        if name is None:
            raise TreeError("exists", f"{dest} already exists (name a folder that does not)")
        dest = os.path.join(dest, name)
    elif os.path.lexists(dest):
        raise TreeError("not_a_folder", f"{dest} is a file, not a folder")
    if os.path.lexists(dest):
        raise TreeError("exists", f"{dest} already exists: a copy never merges into it "
                                  "(remove it, or name another destination)")
    return dest


def source(path: str) -> str:
    """The folder a copy reads (a link to one will do); TreeError if there is none."""
    if not os.path.lexists(path):
        raise TreeError("not_found", f"{path}: no such folder")
    if not os.path.isdir(path):
        raise TreeError("not_a_folder", f"{path} is not a folder")
    return path


# ---- packing ----

def pack(root: str, counts: Counts) -> Iterator[bytes]:
    """The tar stream of the folder `root`, in pieces; `counts` follows what it packed."""
    for name, path, st in _walk(root):
        info = tarfile.TarInfo(name)
        # A float mtime costs a PAX header per entry: unpacking 2,000 files under TCG took
        # 7.0-7.6 s with them, 5.6-6.4 s with whole seconds. Kept: tools compare mtimes.
        info.mode, info.mtime = stat.S_IMODE(st.st_mode), st.st_mtime
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            counts.folders += 1
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
            counts.links += 1
        else:
            info.size = st.st_size
        yield info.tobuf(tarfile.PAX_FORMAT, ENCODING, "surrogateescape")
        if info.isreg():
            yield from _content(path, st.st_size)
            counts.files += 1
            counts.bytes += st.st_size
    yield bytes(2 * tarfile.BLOCKSIZE)  # the end of the archive


def _walk(root: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(name in the stream, path, lstat) of `root` and of the files, folders and links under
    it, folders first. Entries that vanish meanwhile are passed over, as tar does."""
    stack = [(".", root, os.stat(root))]
    while stack:
        name, path, st = stack.pop()
        yield name, path, st
        if not stat.S_ISDIR(st.st_mode):
            continue
        for child in sorted(os.listdir(path), reverse=True):  # popped in name order
            child_path = os.path.join(path, child)
            try:
                child_st = os.lstat(child_path)
            except FileNotFoundError:
                continue
            if stat.S_IFMT(child_st.st_mode) in KEPT:
                stack.append((child if name == "." else f"{name}/{child}", child_path, child_st))


def _content(path: str, size: int) -> Iterator[bytes]:
    """A file's first `size` bytes (what it had when listed), padded to whole tar blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        left = size
        while left:
            data = os.read(fd, min(left, READ_SIZE))
            if not data:
                raise TreeError("os_error", f"{path} shrank while it was copied")
            left -= len(data)
            yield data
    finally:
        os.close(fd)
    if size % tarfile.BLOCKSIZE:
        yield bytes(tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE)


def blocks(pieces: Iterable[bytes], size: int) -> Iterator[bytes]:
    """`pieces` joined and cut into blocks of `size` bytes (the last one shorter): a frame
    carries many small tar headers, not one each."""
    buf = bytearray()
    for piece in pieces:
        buf += piece
        while len(buf) >= size:
            with memoryview(buf) as view:
                block = bytes(view[:size])
            del buf[:size]
            yield block
    if buf:
        yield bytes(buf)


# ---- unpacking ----

class Reader:
    """A binary reader over an iterator of byte blocks (what tarfile's stream mode reads)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._chunk = b""
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        while self._at >= len(self._chunk):
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._chunk, self._at = chunk, 0
        end = len(self._chunk) if size < 0 else self._at + size
        piece = self._chunk[self._at : end]
        self._at += len(piece)
        return piece


def receive(dest: str, chunks: Iterable[bytes], mask: int, counts: Counts) -> None:
    """Unpack the tar stream `chunks` to `dest` (as target() gave it), all or nothing, through
    `.NAME.rewind-partial` beside it. Permission bits are kept as far as `mask` lets them."""
    parent, name = os.path.split(dest)
    temp = os.path.join(parent, f".{name}.rewind-partial")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(temp, 0o700)
    except FileExistsError as e:
        if e.filename != temp:
            raise TreeError("os_error", f"cannot copy to {dest}: {e.filename} is not a folder") from None
        raise TreeError("exists", f"{temp} exists: another copy to {dest} is under way, or one was cut "
                                  "short (remove it)") from None
    except OSError as e:
        raise TreeError("os_error", f"cannot copy to {dest}: {e.strerror}") from None
    try:
        chunks = iter(chunks)
        _unpack(Reader(chunks), temp, mask, counts)
        for _ in chunks:
            pass  # what follows the archive's end (padding): the sender's stream is read to its end
        if os.path.lexists(dest):
            raise TreeError("exists", f"{dest} appeared while it was copied to")
        os.rename(temp, dest)
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        raise TreeError("os_error", f"cannot copy to {dest}: {e.strerror} (nothing was kept)") from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _unpack(reader: Reader, root: str, mask: int, counts: Counts) -> None:
    landing = _Landing(root, mask, counts)
    try:
        with tarfile.open(fileobj=reader, mode="r|", encoding=ENCODING, errors="surrogateescape") as tar:
            while (member := tar.next()) is not None:
                landing.add(tar, member)
                tar.members.clear()  # tarfile keeps every member it read: memory would grow with the tree
    except tarfile.TarError as e:
        raise TreeError("bad_request", f"not a whole tar stream: {e}") from None
    landing.finish()


def _relative(name: str) -> str:
    """A member's path inside the landing folder ("" for the folder itself)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or "\0" in name:
        raise TreeError("bad_request", f"{name!r} would land outside the destination")
    return "/".join(parts)


class _Landing:
    """The folder a stream is unpacked into, and the folders the stream made in it: only
    under those may it put anything, so nothing it made (a link) can lead out."""

    def __init__(self, root: str, mask: int, counts: Counts) -> None:
        self.root, self.mask, self.counts = root, mask, counts
        # Each folder made: its mode and mtime from the stream, set at the end (writing in a
        # folder changes its mtime, and a read-only one could not be written in); None for
        # one made only to hold what the stream put under it.
        self.folders: dict[str, tuple[int, float] | None] = {"": None}

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = _relative(member.name)
        path = os.path.join(self.root, rel)
        if member.isdir():
            self._folder(rel, path, member)
        elif not rel:
            raise TreeError("bad_request", f"{member.name!r}: the copied folder is not a folder")
        elif member.isreg():
            self._parents(rel)
            self._file(tar, member, path)
        elif member.issym():
            if "\0" in member.linkname:
                raise TreeError("bad_request", f"{member.name!r}: a link target with a NUL byte")
            self._parents(rel)
            self._new(member.name, lambda: os.symlink(member.linkname, path))
            os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)
            self.counts.links += 1
        else:
            raise TreeError("bad_request", f"{member.name!r}: only files, folders and links are copied")

    def _folder(self, rel: str, path: str, member: tarfile.TarInfo) -> None:
        if rel not in self.folders:
            self._parents(rel)
            self._new(member.name, lambda: os.mkdir(path, 0o700))
        if self.folders.setdefault(rel, None) is None:
            self.counts.folders += 1
        self.folders[rel] = (member.mode & self.mask, member.mtime)

    def _parents(self, rel: str) -> None:
        missing = []
        parent = posixpath.dirname(rel)
        while parent not in self.folders:
            missing.append(parent)
            parent = posixpath.dirname(parent)
        for folder in reversed(missing):
            self._new(rel, lambda f=folder: os.mkdir(os.path.join(self.root, f), 0o755))
            self.folders[folder] = None

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = self._new(member.name, lambda: os.open(path, flags, 0o600))
        with open(fd, "wb") as out:
            content = tar.extractfile(member)
            assert content is not None  # a regular file's
            while data := content.read(READ_SIZE):
                out.write(data)
            out.flush()
            os.fchmod(fd, member.mode & self.mask)
            os.utime(fd, (member.mtime, member.mtime))
        self.counts.files += 1
        self.counts.bytes += member.size

    @staticmethod
    def _new(name: str, make: Callable[[], T]) -> T:
        """`make()` something where the stream has made nothing yet: a name it gives twice, or
        one under a file or link it gave, is refused."""
        try:
            return make()
        except FileExistsError:
            raise TreeError("bad_request", f"{name!r}: the stream names it twice, or puts it under "
                                           "a file or link") from None

    def finish(self) -> None:
        """Set the folders' modes and mtimes, each after what it holds."""
        for rel in sorted(self.folders, reverse=True):
            if (meta := self.folders[rel]) is not None:
                path = os.path.join(self.root, rel)
                os.chmod(path, meta[0])
                os.utime(path, (meta[1], meta[1]))
