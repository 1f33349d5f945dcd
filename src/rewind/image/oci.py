"""Unpack an OCI or Docker image into a directory, to become a guest's root file system.

Three forms are read: `oci-archive:PATH` (a tar of an OCI image layout, as `podman save
--format oci-archive` and `skopeo copy ... oci-archive:` write it), `oci:DIR` (the same layout
as a directory) and `docker-archive:PATH` (`docker save` output, gzipped or not). Blobs are read
in place from the outer tar and layers are streamed through decompression (by magic bytes:
gzip, zstd or none) into the tree, so no layer is held in memory or stored twice. OCI blobs are
checked against their digests, Docker layers against the config's rootfs.diff_ids. An image
index is resolved to its linux/amd64 image, the only kind rewind's machines run.

Layers are applied in order by the changeset rules of the OCI image spec:
- `.wh.NAME` deletes NAME from lower layers and `.wh..wh..opq` empties its directory of what
  lower layers put there. Whiteouts never remove what their own layer adds, whatever the
  order of its entries, and never appear in the result.
- A later entry replaces an earlier one at its path; a directory over a directory keeps the
  contents and takes the new owner and mode.
- Numeric owners, modes (setuid, setgid, sticky included), mtimes, symlinks, hard links,
  device nodes, fifos and `SCHILY.xattr.*` attributes are kept. Directory modes and mtimes
  are set once every layer is in, since writing into a directory changes its mtime.
- Nothing is written outside the destination: names that are absolute, hold `..` or lead
  through a symlink are refused, whatever lies at an entry's own path is removed before the
  entry is made (never written through), and symlinks are made as links, never followed.

Any failure raises (ImageError for the image, InvalidArgument for the request) with the
destination half filled: the caller removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gzip
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from rewind.errors import ImageError, InvalidArgument

_KINDS = ("oci-archive", "docker-archive", "oci")
_FORMS = "oci-archive:PATH, docker-archive:PATH or oci:DIR"
_PLATFORM = "linux/amd64"  # what rewind's machines run
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json")
_LAYER_TYPE = re.compile(r"application/vnd\.(oci\.image\.layer\.v1\.tar(\+gzip|\+zstd)?"
                         r"|docker\.image\.rootfs\.diff\.tar\.gzip)")
_JSON_LIMIT = 16 << 20  # indexes, manifests and configs are kilobytes; more is not an image
_NESTING = 4  # image indexes inside indexes, at most
_LINK_HOPS = 8  # links between members of an outer archive, at most
_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_XATTR = "SCHILY.xattr."


@dataclass(frozen=True)
class ImageConfig:
    """What an image asks of the process it runs, kept next to the unpacked tree."""

    digest: str  # "sha256:..." of the image's config blob
    env: dict[str, str]
    working_dir: str | None
    user: str | None
    entrypoint: list[str]
    cmd: list[str]
    layers: int  # how many layers were applied

    def to_json(self) -> dict:
        return {"version": 1, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> ImageConfig:
        if d.get("version") != 1:
            raise ImageError(f"image config record of version {d.get('version')!r}; this rewind reads 1")
        try:
            return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise ImageError(f"image config record without {exc}") from exc


def parse_source(text: str) -> tuple[str, Path]:
    """'oci-archive:PATH' | 'docker-archive:PATH' | 'oci:DIR' -> (kind, path); the path is checked later."""
    kind, colon, path = text.partition(":")
    if not colon or kind not in _KINDS or not path:
        raise InvalidArgument(f"image source {text!r}: give {_FORMS}")
    return kind, Path(path)


def unpack(source: str, dest: Path, report: Callable[[str], None] = lambda _: None) -> ImageConfig:
    """Apply the image's layers in order into `dest` (an existing empty directory) and return its config."""
    kind, path = parse_source(source)
    _check_dest(dest)
    with _open_store(kind, path, source) as store:
        image = _read_docker(store) if kind == "docker-archive" else _read_oci(store)
        tree = _Tree(dest, report)
        count = len(image.layers)
        for number, layer in enumerate(image.layers, 1):
            report(f"applying layer {number}/{count} ({layer.size / (1 << 20):.1f} MiB)")
            _apply_layer(store, layer, tree, f"{source}: layer {number}/{count} ({layer.name})")
        tree.finish()
    return image.config


def _check_dest(dest: Path) -> None:
    try:
        is_dir = stat.S_ISDIR(os.lstat(dest).st_mode)
    except FileNotFoundError:
        is_dir = False
    if not is_dir:
        raise InvalidArgument(f"{dest}: not a directory to unpack an image into")
    if any(dest.iterdir()):
        raise InvalidArgument(f"{dest}: not empty; an image is unpacked into an empty directory")


# --- where the blobs are -------------------------------------------------------------------


class _Directory:
    """An OCI layout in a directory; blob names are built from checked digests only."""

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = root, label

    def open(self, name: str) -> BinaryIO:
        try:
            return open(self.root / name, "rb")
        except OSError as exc:
            raise ImageError(f"{self.label}: cannot read {name}: {exc.strerror}") from exc


class _Archive:
    """The members of an outer tar, read where they lie: nothing is copied out."""

    def __init__(self, tar: tarfile.TarFile, label: str) -> None:
        self.label = label
        self._tar = tar
        self._members = {posixpath.normpath(m.name): m for m in tar.getmembers()}

    def open(self, name: str) -> BinaryIO:
        return self._tar.extractfile(self._member(name))

    def size(self, name: str) -> int:
        return self._member(name).size

    def _member(self, name: str) -> tarfile.TarInfo:
        # docker save stores a layer that two images share once and links the other name to it
        for _ in range(_LINK_HOPS):
            member = self._members.get(posixpath.normpath(name))
            if member is None:
                raise ImageError(f"{self.label}: {name} is missing")
            if member.isfile():
                return member
            if member.issym():
                name = posixpath.join(posixpath.dirname(member.name), member.linkname)
            elif member.islnk():
                name = member.linkname
            else:
                raise ImageError(f"{self.label}: {name} is not a file")
        raise ImageError(f"{self.label}: {name}: more than {_LINK_HOPS} links")


_Store = _Directory | _Archive


@contextlib.contextmanager
def _open_store(kind: str, path: Path, label: str) -> Iterator[_Store]:
    if kind == "oci":
        if not path.is_dir():
            raise InvalidArgument(f"{label}: no such directory")
        yield _Directory(path, label)
        return
    if not path.is_file():
        raise InvalidArgument(f"{label}: no such file")
    with contextlib.ExitStack() as stack:
        try:
            tar = stack.enter_context(tarfile.open(path, "r:*"))  # `docker save | gzip` output too
            store = _Archive(tar, label)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise ImageError(f"{label}: not a readable tar archive: {exc}") from exc
        yield store


def _json(store: _Store, name: str, digest: str | None = None, shape: type = dict) -> tuple[Any, str]:
    """A small JSON document and its digest, checked against `digest` when one is given."""
    with store.open(name) as f:
        data = f.read(_JSON_LIMIT + 1)
    where = f"{store.label}: {name}"
    if len(data) > _JSON_LIMIT:
        raise ImageError(f"{where}: over {_JSON_LIMIT >> 20} MiB, not an image document")
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest is not None and actual != digest:
        raise ImageError(f"{where}: content does not match its digest (sha256 is {actual})")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(doc, shape):
        raise ImageError(f"{where}: not a JSON {'object' if shape is dict else 'list'}")
    return doc, actual


def _field(doc: dict, key: str, kind: type, where: str, default: object = None) -> Any:
    """doc[key], checked to be a `kind`; `default` when absent or null (None: required)."""
    value = doc.get(key)
    value = default if value is None else value
    if not isinstance(value, kind):
        raise ImageError(f"{where}: {key!r} is missing or not a {kind.__name__}")
    return value


def _strings(doc: dict, key: str, where: str) -> list[str]:
    value = _field(doc, key, list, where, [])
    if not all(isinstance(item, str) for item in value):
        raise ImageError(f"{where}: {key!r} is not a list of strings")
    return value


def _dicts(doc: dict, key: str, where: str) -> list[dict]:
    value = _field(doc, key, list, where)
    if not all(isinstance(item, dict) for item in value):
        raise ImageError(f"{where}: {key!r} is not a list of objects")
    return value


# --- what the image is -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    name: str  # where the blob is in the store
    size: int  # as stored, for progress reports
    digest: str | None  # sha256 of the blob as stored (OCI)
    diff_id: str | None  # sha256 of the uncompressed tar (docker-archive)


@dataclass(frozen=True)
class _Image:
    config: ImageConfig
    layers: list[_Layer]


def _read_oci(store: _Store) -> _Image:
    index, _ = _json(store, "index.json")
    where = f"{store.label}: index.json"
    descriptor = _choose(_dicts(index, "manifests", where), where)
    for _ in range(_NESTING):
        name = _blob_name(descriptor, where)
        doc, _ = _json(store, name, descriptor["digest"])
        where = f"{store.label}: {name}"
        if "manifests" not in doc:
            return _oci_image(store, doc, where)
        descriptor = _choose(_dicts(doc, "manifests", where), where)
    raise ImageError(f"{where}: image indexes nested over {_NESTING} deep")


def _choose(manifests: list[dict], where: str) -> dict:
    """The only image listed (a tag listed twice is one image) or else the linux/amd64 one."""
    unique = list({str(d.get("digest")): d for d in manifests}.values())
    if len(unique) == 1:
        return unique[0]
    platforms = [_platform(d) for d in unique]
    if _PLATFORM in platforms:
        return unique[platforms.index(_PLATFORM)]
    if any(platforms):
        raise ImageError(f"{where}: no {_PLATFORM} image (it has {', '.join(p for p in platforms if p)})")
    raise ImageError(f"{where}: holds {len(unique)} images; rewind unpacks an archive of exactly one")


def _platform(descriptor: dict) -> str | None:
    platform = descriptor.get("platform")
    return f"{platform.get('os')}/{platform.get('architecture')}" if isinstance(platform, dict) else None


def _blob_name(descriptor: dict, where: str) -> str:
    digest = descriptor.get("digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ImageError(f"{where}: digest {digest!r} is malformed or not sha256")
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _oci_image(store: _Store, manifest: dict, where: str) -> _Image:
    config = _field(manifest, "config", dict, where)
    if config.get("mediaType") not in _CONFIG_TYPES:
        raise ImageError(f"{where}: config of type {config.get('mediaType')!r}: not a container image")
    layers = []
    for descriptor in _dicts(manifest, "layers", where):
        media_type = str(descriptor.get("mediaType"))
        if not _LAYER_TYPE.fullmatch(media_type):
            raise ImageError(f"{where}: layer of unsupported type {media_type!r}")
        size = _field(descriptor, "size", int, where)
        layers.append(_Layer(_blob_name(descriptor, where), size, descriptor["digest"], None))
    config_name = _blob_name(config, where)
    doc, digest = _json(store, config_name, config["digest"])
    return _Image(_config(doc, digest, len(layers), f"{store.label}: {config_name}"), layers)


def _read_docker(store: _Store) -> _Image:
    manifest, _ = _json(store, "manifest.json", shape=list)
    where = f"{store.label}: manifest.json"
    if len(manifest) != 1:
        raise ImageError(f"{where}: holds {len(manifest)} images; rewind unpacks an archive of exactly one")
    entry = manifest[0] if isinstance(manifest[0], dict) else {}
    config_name = _field(entry, "Config", str, where)
    names = _strings(entry, "Layers", where)
    doc, digest = _json(store, config_name)
    config_where = f"{store.label}: {config_name}"
    diff_ids = _strings(_field(doc, "rootfs", dict, config_where), "diff_ids", config_where)
    if len(diff_ids) != len(names):
        raise ImageError(f"{config_where}: lists {len(diff_ids)} layers, manifest.json {len(names)}")
    layers = [_Layer(name, store.size(name), None, diff) for name, diff in zip(names, diff_ids, strict=True)]
    return _Image(_config(doc, digest, len(layers), config_where), layers)


def _config(doc: dict, digest: str, layers: int, where: str) -> ImageConfig:
    platform = f"{doc.get('os', 'linux')}/{doc.get('architecture', 'amd64')}"
    if platform != _PLATFORM:
        raise ImageError(f"{where}: the image is for {platform}; rewind's machines are {_PLATFORM}")
    run = _field(doc, "config", dict, where, {})
    env = {}
    for item in _strings(run, "Env", where):
        key, _, value = item.partition("=")
        env[key] = value
    return ImageConfig(
        digest=digest, env=env,
        working_dir=_field(run, "WorkingDir", str, where, "") or None,
        user=_field(run, "User", str, where, "") or None,
        entrypoint=_strings(run, "Entrypoint", where), cmd=_strings(run, "Cmd", where), layers=layers)


# --- applying layers -------------------------------------------------------------------------


class _Checked(io.RawIOBase):
    """A stream hashed as it is read, to compare with its digest once wholly read."""

    def __init__(self, stream: BinaryIO, digest: str | None) -> None:
        super().__init__()
        self._stream, self._digest = stream, digest
        self._hash = hashlib.sha256() if digest else None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._stream.readinto(buffer)
        if self._hash is not None:
            self._hash.update(memoryview(buffer)[:n])
        return n

    def verify(self, where: str) -> None:
        # the tar reader stops at the end-of-archive mark: padding and trailers after it count too
        while self.read(_CHUNK):
            pass
        if self._hash is not None and "sha256:" + self._hash.hexdigest() != self._digest:
            raise ImageError(f"{where}: content does not match its digest {self._digest}")


def _decompressed(stream: io.BufferedReader) -> BinaryIO:
    """The stream decompressed as its first bytes say: media types and file names can lie."""
    magic = stream.peek(len(_ZSTD_MAGIC))[:len(_ZSTD_MAGIC)]
    if magic.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if magic == _ZSTD_MAGIC:
        # zstd:chunked layers are many frames
        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
    return stream


def _apply_layer(store: _Store, layer: _Layer, tree: _Tree, where: str) -> None:
    """Stream one layer blob through its checks and decompression into the tree."""
    try:
        with store.open(layer.name) as raw:
            stored = _Checked(raw, layer.digest)
            plain = _Checked(_decompressed(io.BufferedReader(stored, _CHUNK)), layer.diff_id)
            with tarfile.open(fileobj=plain, mode="r|") as tar:
                tree.apply(tar, where)
            plain.verify(f"{where}, uncompressed")
            stored.verify(where)
    except (tarfile.TarError, OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
        raise ImageError(f"{where}: {exc}") from exc


class _Tree:
    """The root directory the layers go into, and what must be set once they all are in."""

    def __init__(self, root: Path, report: Callable[[str], None]) -> None:
        self._root = root
        self._report = report
        self._folders: dict[str, tuple[int, int]] = {}  # path -> (mode, mtime in ns) of its last entry
        self._kept: set[str] = set()  # this layer's paths and their parents: whiteouts spare them
        self._where = ""

    def apply(self, tar: tarfile.TarFile, where: str) -> None:
        self._kept, self._where = set(), where
        for member in tar:
            try:
                self._entry(tar, member)
            except (OSError, ValueError) as exc:  # ValueError: a name with a NUL byte
                raise ImageError(f"{where}: {member.name}: {getattr(exc, 'strerror', None) or exc}") from exc

    def finish(self) -> None:
        """Give directories their modes and mtimes, now that nothing more is written into them."""
        for rel, (mode, mtime) in self._folders.items():
            try:
                fd = os.open(self._root / rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    os.fchmod(fd, mode)
                    os.utime(fd, ns=(mtime, mtime))
                finally:
                    os.close(fd)
            except OSError as exc:
                raise ImageError(f"{self._root / rel}: cannot set mode and mtime: {exc.strerror}") from exc

    def _entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        parts = self._parts(member.name)
        if parts and parts[-1].startswith(_WHITEOUT):
            self._whiteout(parts)
            return
        self._keep(parts)
        rel = "/".join(parts)
        path = self._walk(parts, create=True) / parts[-1] if parts else self._root
        if member.isdir():
            self._folder(member, path, rel)
            return
        if not parts:
            raise self._error(member.name, "is the root, which must be a directory")
        self._remove(path, rel)
        if member.islnk():
            self._hard_link(member, path)
        elif self._make(tar, member, path, rel):
            self._attributes(member, path)

    def _parts(self, name: str) -> list[str]:
        parts = [part for part in name.split("/") if part not in ("", ".")]
        if name.startswith("/") or ".." in parts:
            raise self._error(name, "points outside the image's root")
        return parts

    def _walk(self, parts: list[str], create: bool) -> Path | None:
        """The directory holding parts[-1], checked to lead through no symlink; None if it is
        missing and not to be created."""
        path = self._root
        for depth, part in enumerate(parts[:-1], 1):
            path = path / part
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(path)
                os.chmod(path, 0o755)  # a parent the layer does not list, made as tar makes it
                continue
            if stat.S_ISLNK(mode):
                raise self._error("/".join(parts), f"leads through the symlink {'/'.join(parts[:depth])}")
            if not stat.S_ISDIR(mode):
                raise self._error("/".join(parts), f"lies under {'/'.join(parts[:depth])}, not a directory")
        return path

    def _keep(self, parts: list[str]) -> None:
        for depth in range(len(parts), 0, -1):
            rel = "/".join(parts[:depth])
            if rel in self._kept:
                return
            self._kept.add(rel)

    def _whiteout(self, parts: list[str]) -> None:
        parent = self._walk(parts, create=False)
        if parent is None:
            return  # nothing below to delete
        name, prefix = parts[-1], "/".join(parts[:-1])
        if name == _OPAQUE:
            for child in os.listdir(parent):
                self._remove_lower(posixpath.join(prefix, child))
        elif not name.startswith(_WHITEOUT + _WHITEOUT):  # other .wh..wh. names are aufs bookkeeping
            target = name.removeprefix(_WHITEOUT)
            if target in (".", ".."):
                raise self._error("/".join(parts), "whites out no name")
            self._remove_lower(posixpath.join(prefix, target))

    def _remove_lower(self, rel: str) -> None:
        """Remove what lower layers put at rel, sparing what this layer added there."""
        todo = [rel]
        while todo:
            rel = todo.pop()
            path = self._root / rel
            if rel not in self._kept:
                self._remove(path, rel)
            elif _is_dir(path):
                todo.extend(posixpath.join(rel, child) for child in os.listdir(path))

    def _remove(self, path: Path, rel: str) -> None:
        """Clear the way for a new entry: whatever lies at path goes, a whole tree included."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            os.unlink(path)
            return
        # the directories going must not take their modes and mtimes to whatever replaces them
        for top, _, _ in os.walk(path):
            inner = os.path.relpath(top, path)
            self._folders.pop(rel if inner == "." else f"{rel}/{inner}", None)
        shutil.rmtree(path)

    def _folder(self, member: tarfile.TarInfo, path: Path, rel: str) -> None:
        if not _is_dir(path):
            self._remove(path, rel)
            os.mkdir(path, 0o700)
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
        self._xattrs(member, path)
        # the mode waits too: a read-only directory must still take the entries below it
        self._folders[rel] = (member.mode, _mtime_ns(member))

    def _make(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, rel: str) -> bool:
        """Create the entry; False for a device node this host may not make."""
        if member.isreg():
            source = tar.extractfile(member)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as out:
                shutil.copyfileobj(source, out, _CHUNK)
        elif member.issym():
            os.symlink(member.linkname, path)
        elif member.isfifo():
            os.mkfifo(path, 0o600)
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            try:
                os.mknod(path, kind | 0o600, os.makedev(member.devmajor, member.devminor))
            except PermissionError:
                # without CAP_MKNOD; the guest's /dev is a devtmpfs anyway
                self._report(f"skipped device node {rel}: this host may not make device nodes")
                return False
        else:
            raise self._error(member.name, f"has an unsupported type {member.type!r}")
        return True

    def _hard_link(self, member: tarfile.TarInfo, path: Path) -> None:
        parts = self._parts(member.linkname)
        parent = self._walk(parts, create=False) if parts else None
        if parent is None:
            raise self._error(member.name, f"links to {member.linkname!r}, which is not there")
        os.link(parent / parts[-1], path, follow_symlinks=False)

    def _attributes(self, member: tarfile.TarInfo, path: Path) -> None:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
        if not member.issym():  # a symlink's mode means nothing on Linux
            os.chmod(path, member.mode)  # after chown, which clears setuid and setgid
        self._xattrs(member, path)
        mtime = _mtime_ns(member)
        os.utime(path, ns=(mtime, mtime), follow_symlinks=False)

    def _xattrs(self, member: tarfile.TarInfo, path: Path) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith(_XATTR):
                continue
            try:
                # tarfile decodes PAX values with surrogateescape; this gives the bytes back
                os.setxattr(path, key.removeprefix(_XATTR), value.encode("utf-8", "surrogateescape"),
                            follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.ENOTSUP:
                    raise

    def _error(self, name: str, why: str) -> ImageError:
        return ImageError(f"{self._where}: entry {name!r} {why}")


def _is_dir(path: Path) -> bool:
    """A real directory, not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _mtime_ns(member: tarfile.TarInfo) -> int:
    return int(member.mtime * 1_000_000_000)
