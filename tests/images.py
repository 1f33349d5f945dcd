"""Container images made in tests without docker or podman.

Layers are built entry by entry with tarfile, then written as an OCI image layout (a
directory, or an oci-archive tar) or as a docker-archive; make_busybox_archive makes a small
image a machine can boot. No fixtures: every function takes paths, and the writers return the
source string rewind.image.oci reads ("oci-archive:PATH" ...).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zstandard

MTIME = 1_700_000_000  # every entry's mtime unless given, so results never depend on the clock
BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("sh", "ls", "cat", "env", "pwd", "mkdir", "echo", "rm", "cp", "mv", "ln", "touch",
                   "chmod", "chown", "id", "grep", "sed", "cut", "tr", "sort", "uniq", "head", "tail", "wc",
                   "tee", "sleep", "true", "false", "date", "uname", "ps", "kill", "mount",
                   "umount", "stat", "test", "find", "xargs", "sync", "printf", "hostname", "which",
                   "basename", "dirname", "readlink", "mktemp", "dd", "du", "df", "seq")
Compression = Literal["none", "gzip", "zstd"]
LAYER_TYPES: dict[str, str] = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
Entry = tuple[tarfile.TarInfo, bytes]


def _info(name: str, kind: bytes, mode: int, uid: int, gid: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, mtime
    return info


def file(name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: float = MTIME,
         xattrs: dict[str, bytes] | None = None) -> Entry:
    info = _info(name, tarfile.REGTYPE, mode, uid, gid, mtime)
    info.size = len(data)
    for key, value in (xattrs or {}).items():
        info.pax_headers[f"SCHILY.xattr.{key}"] = value.decode("utf-8", "surrogateescape")
    return info, data


def folder(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: float = MTIME) -> Entry:
    return _info(name, tarfile.DIRTYPE, mode, uid, gid, mtime), b""


def symlink(name: str, target: str) -> Entry:
    info = _info(name, tarfile.SYMTYPE, 0o777, 0, 0, MTIME)
    info.linkname = target
    return info, b""


def hardlink(name: str, target: str) -> Entry:
    info = _info(name, tarfile.LNKTYPE, 0o644, 0, 0, MTIME)
    info.linkname = target
    return info, b""


def device(name: str, major: int, minor: int, mode: int = 0o666) -> Entry:
    info = _info(name, tarfile.CHRTYPE, mode, 0, 0, MTIME)
    info.devmajor, info.devminor = major, minor
    return info, b""


def fifo(name: str, mode: int = 0o644) -> Entry:
    return _info(name, tarfile.FIFOTYPE, mode, 0, 0, MTIME), b""


def whiteout(path: str) -> Entry:
    """The entry that deletes `path` from lower layers."""
    parent, _, name = path.rpartition("/")
    return file(f"{parent}/.wh.{name}" if parent else f".wh.{name}")


def opaque(path: str) -> Entry:
    """The entry that empties the directory `path` of what lower layers put there."""
    return file(f"{path}/.wh..wh..opq")


def layer_tar(entries: list[Entry]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def compress(data: bytes, how: Compression) -> bytes:
    if how == "gzip":
        return gzip.compress(data, compresslevel=1, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(data)
    return data


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(layers: list[bytes], *, env: dict[str, str] | None = None, workdir: str = "", user: str = "",
                 entrypoint: list[str] | None = None, cmd: list[str] | None = None,
                 architecture: str = "amd64") -> dict:
    """An image config for uncompressed `layers` (their digests are its rootfs.diff_ids)."""
    run = {"Env": [f"{k}={v}" for k, v in (env or {}).items()], "WorkingDir": workdir, "User": user,
           "Entrypoint": entrypoint, "Cmd": cmd}
    return {"architecture": architecture, "os": "linux", "config": run,
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer) for layer in layers]}}


def config_blob(config: dict) -> bytes:
    """The bytes a config is stored as; their sha256 is the config digest unpack reports."""
    return json.dumps(config, sort_keys=True).encode()


@dataclass
class Layout:
    """An OCI image layout being put together: blobs by digest, then written out."""

    blobs: dict[str, bytes] = field(default_factory=dict)

    def blob(self, media_type: str, data: bytes, **extra: object) -> dict:
        """Store a blob; its descriptor."""
        self.blobs[sha256(data)] = data
        return {"mediaType": media_type, "digest": sha256(data), "size": len(data), **extra}

    def image(self, layers: list[bytes], config: dict, compression: list[Compression] | None = None,
              **extra: object) -> dict:
        """Store an image of uncompressed `layers`, compressed as told; its manifest's descriptor."""
        how = compression or ["none"] * len(layers)
        stored = [self.blob(LAYER_TYPES[h], compress(layer, h)) for layer, h in zip(layers, how, strict=True)]
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                    "config": self.blob(CONFIG_TYPE, config_blob(config)), "layers": stored}
        return self.blob(MANIFEST_TYPE, json.dumps(manifest).encode(), **extra)

    def index(self, manifests: list[dict]) -> dict:
        """Store an image index of `manifests`; its descriptor."""
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}
        return self.blob(INDEX_TYPE, json.dumps(index).encode())

    def write(self, path: Path, manifests: list[dict], archive: bool = True) -> str:
        """Write the layout with `manifests` in its index.json, as a tar or a directory."""
        files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
                 "index.json": json.dumps({"schemaVersion": 2, "manifests": manifests}).encode()}
        files |= {f"blobs/sha256/{d.removeprefix('sha256:')}": data for d, data in self.blobs.items()}
        if archive:
            _write_tar(path, files)
            return f"oci-archive:{path}"
        for name, data in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        return f"oci:{path}"


def write_docker_archive(path: Path, layers: list[bytes], config: dict,
                         compression: list[Compression] | None = None) -> str:
    """Write `docker save` output: layers as `N/layer.tar` files (docker before 25), except the
    last, stored once as a blob that its `N/layer.tar` links to (as docker does for a layer two
    images share)."""
    how = compression or ["none"] * len(layers)
    stored = [compress(layer, h) for layer, h in zip(layers, how, strict=True)]
    config_name = f"{sha256(config_blob(config)).removeprefix('sha256:')}.json"
    names = [f"layer{n}/layer.tar" for n in range(len(layers))]
    files = {config_name: config_blob(config), **dict(zip(names[:-1], stored[:-1], strict=True))}
    links = {}
    if layers:
        blob = f"blobs/sha256/{sha256(stored[-1]).removeprefix('sha256:')}"
        files[blob], links[names[-1]] = stored[-1], f"../{blob}"
    files["manifest.json"] = json.dumps(
        [{"Config": config_name, "RepoTags": ["rewind-test:latest"], "Layers": names}]).encode()
    _write_tar(path, files, links)
    return f"docker-archive:{path}"


def write_image(path: Path, kind: Literal["oci-archive", "oci", "docker-archive"], layers: list[bytes],
                config: dict, compression: list[Compression] | None = None) -> str:
    """One image in the form `kind` at `path` (a directory is made for "oci"); its source string."""
    if kind == "docker-archive":
        return write_docker_archive(path, layers, config, compression)
    layout = Layout()
    manifest = layout.image(layers, config, compression)
    if kind == "oci":
        path.mkdir()
    return layout.write(path, [manifest], archive=kind == "oci-archive")


def make_busybox_archive(path: Path, kind: Literal["oci", "docker"] = "oci", *,
                         env: dict[str, str] | None = None, workdir: str = "", user: str = "",
                         entrypoint: list[str] | None = None, cmd: list[str] | None = None) -> str:
    """A two-layer image holding only busybox-static, written to `path` as an oci-archive or a
    docker-archive; its source string. Layer 1 (gzip) has /bin/busybox and its applets as
    symlinks, /etc/passwd with root and user (1000), /tmp, /root, /home/user and an
    /etc/remove-me that layer 2 (uncompressed) whites out, adding /etc/hostname."""
    applets = [symlink(f"bin/{name}", "busybox") for name in BUSYBOX_APPLETS]
    base = layer_tar([
        *(folder(name) for name in ("bin", "etc", "dev", "proc", "sys", "run", "var", "home")),
        folder("tmp", 0o1777), folder("root", 0o700), folder("home/user", uid=1000, gid=1000),
        file("bin/busybox", BUSYBOX.read_bytes(), 0o755), *applets,
        file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"),
        file("etc/group", b"root:x:0:\nuser:x:1000:\n"),
        file("etc/remove-me", b"whited out by layer 2\n"),
    ])
    top = layer_tar([whiteout("etc/remove-me"), file("etc/hostname", b"rewind\n")])
    config = image_config([base, top], env=env or {"PATH": "/bin"}, workdir=workdir, user=user,
                          entrypoint=entrypoint, cmd=cmd or ["/bin/sh"])
    return write_image(path, "oci-archive" if kind == "oci" else "docker-archive", [base, top], config,
                       ["gzip", "none"])


def _write_tar(path: Path, files: dict[str, bytes], links: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), MTIME
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, MTIME
            tar.addfile(info)
