"""Unpacking OCI and Docker images (rewind.image.oci): no QEMU here, images are built with tarfile."""

from __future__ import annotations

import errno
import filecmp
import gzip
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from images import (
    BUSYBOX,
    BUSYBOX_APPLETS,
    MTIME,
    Layout,
    compress,
    config_blob,
    device,
    fifo,
    file,
    folder,
    hardlink,
    image_config,
    layer_tar,
    make_busybox_archive,
    opaque,
    sha256,
    symlink,
    whiteout,
    write_image,
)

from rewind.errors import ImageError, InvalidArgument
from rewind.image.oci import ImageConfig, parse_source, unpack

HOME_MTIME = MTIME - 86_400  # home/user's, kept although layer 2 writes into it
SHARED_MTIME = MTIME + 3_600  # shared/'s in layer 2, over layer 1's

LOWER = layer_tar([
    folder("."),
    folder("etc"), file("etc/gone", b"deleted by layer 2"), file("etc/keep", b"stays"),
    folder("opq"), file("opq/old", b"lower"), folder("opq/sub"), file("opq/sub/deep", b"lower"),
    folder("bin"), file("bin/tool", b"#!tool\n", 0o755), hardlink("bin/tool-link", "bin/tool"),
    file("bin/su", b"su", 0o4755), file("bin/user-suid", b"us", 0o4755, uid=1000, gid=1000),
    symlink("bin/sh", "/bin/busybox"),
    file("secret", b"s3cret", 0o600, uid=1000, gid=1000),
    file("thing", b"a file, a directory in layer 2"),
    folder("was-dir"), file("was-dir/x", b"gone with its directory"),
    folder("home"), folder("home/user", 0o700, uid=1000, gid=1000, mtime=HOME_MTIME),
    folder("shared"), file("shared/one", b"1"),
    file("attrs", b"x", xattrs={"user.rewind": b"yes"}),
    folder("dev"), device("dev/null", 1, 3), folder("run"), fifo("run/fifo", 0o620),
    symlink("was-link", "/etc/keep"),
    folder("recreated", 0o700), file("recreated/old"),
])
MIDDLE = layer_tar([
    whiteout("etc/gone"),
    file("opq/new", b"this layer's"),  # before the opaque mark: it must survive it all the same
    opaque("opq"),
    folder("thing"), file("thing/inside", b"in the new directory"),
    file("was-dir", b"now a file"),
    hardlink("bin/tool-link2", "bin/tool"),
    folder("shared", 0o750, uid=1000, gid=1000, mtime=SHARED_MTIME), file("shared/two", b"2"),
    file("home/user/notes", b"written into a lower directory"),
    whiteout("recreated"), file("recreated/new"),  # a directory made anew, as tar makes a missing parent
])
# Tar writers pad past the end-of-archive mark, and digests cover the padding: more than the
# reader's buffer here, so the check must read on to the end.
UPPER = layer_tar([file("was-link", b"replaced the link"), file("etc/hostname", b"box\n")]) + bytes(2 << 20)
LAYERS = [LOWER, MIDDLE, UPPER]
CONFIG = image_config(LAYERS, env={"PATH": "/usr/bin:/bin", "EMPTY": "", "X": "a=b"}, workdir="/work",
                      user="1000:1000", entrypoint=["/bin/sh", "-c"], cmd=["echo hi"])
COMPRESSION = {"oci-archive": ["none", "gzip", "zstd"], "oci": ["gzip", "zstd", "none"],
               "docker-archive": ["none", "gzip", "gzip"]}


def xattrs_work(where: Path) -> bool:
    probe = where / "xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.rewind", b"1")
    except OSError as exc:
        if exc.errno != errno.ENOTSUP:
            raise
        return False
    finally:
        probe.unlink()
    return True


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("kind", ["oci-archive", "oci", "docker-archive"])
def test_an_image_unpacks_by_the_changeset_rules(tmp_path: Path, kind: str) -> None:
    source = write_image(tmp_path / "image", kind, LAYERS, CONFIG, COMPRESSION[kind])
    root = tmp_path / "root"
    root.mkdir()
    lines: list[str] = []
    config = unpack(source, root, lines.append)

    assert config == ImageConfig(
        digest=sha256(config_blob(CONFIG)), env={"PATH": "/usr/bin:/bin", "EMPTY": "", "X": "a=b"},
        working_dir="/work", user="1000:1000", entrypoint=["/bin/sh", "-c"], cmd=["echo hi"], layers=3)
    assert list(config.env) == ["PATH", "EMPTY", "X"]
    assert len(lines) == 3 and all(re.fullmatch(rf"applying layer {n}/3 \(\d+\.\d MiB\)", line)
                                   for n, line in enumerate(lines, 1))
    # whiteouts: a file deleted, an opaque directory holding only what its own layer added
    assert not (root / "etc/gone").exists() and (root / "etc/keep").read_bytes() == b"stays"
    assert os.listdir(root / "opq") == ["new"] and (root / "opq/new").read_bytes() == b"this layer's"
    assert not any(".wh." in name for name in tree(root))
    assert os.listdir(root / "recreated") == ["new"]
    assert stat.S_IMODE(os.stat(root / "recreated").st_mode) == 0o755
    # replacements: a file by a directory, a directory by a file, a symlink by a file
    assert (root / "thing/inside").read_bytes() == b"in the new directory"
    assert (root / "was-dir").read_bytes() == b"now a file"
    assert not (root / "was-link").is_symlink() and (root / "was-link").read_bytes() == b"replaced the link"
    assert (root / "etc/keep").read_bytes() == b"stays"
    # links
    assert os.readlink(root / "bin/sh") == "/bin/busybox"
    inode = os.stat(root / "bin/tool")
    assert inode.st_nlink == 3
    assert {os.stat(root / name).st_ino for name in ("bin/tool-link", "bin/tool-link2")} == {inode.st_ino}
    # modes, owners, mtimes
    assert stat.S_IMODE(os.stat(root / "secret").st_mode) == 0o600
    assert (os.stat(root / "secret").st_uid, os.stat(root / "secret").st_gid) == (1000, 1000)
    assert stat.S_IMODE(inode.st_mode) == 0o755 and inode.st_mtime == MTIME
    assert stat.S_IMODE(os.stat(root / "bin/su").st_mode) == 0o4755
    suid = os.stat(root / "bin/user-suid")
    assert (stat.S_IMODE(suid.st_mode), suid.st_uid, suid.st_gid) == (0o4755, 1000, 1000)
    home = os.stat(root / "home/user")
    assert (stat.S_IMODE(home.st_mode), home.st_uid, home.st_mtime) == (0o700, 1000, HOME_MTIME)
    assert os.lstat(root / "bin/sh").st_mtime == MTIME
    # a directory over a directory: contents kept, new mode, owner and mtime
    shared = os.stat(root / "shared")
    assert sorted(os.listdir(root / "shared")) == ["one", "two"]
    assert (stat.S_IMODE(shared.st_mode), shared.st_uid, shared.st_gid, shared.st_mtime) == \
        (0o750, 1000, 1000, SHARED_MTIME)
    # special files, xattrs
    null = os.stat(root / "dev/null")
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    assert stat.S_ISFIFO(os.stat(root / "run/fifo").st_mode)
    assert stat.S_IMODE(os.stat(root / "run/fifo").st_mode) == 0o620
    if xattrs_work(tmp_path):
        assert os.getxattr(root / "attrs", "user.rewind") == b"yes"
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755


def test_a_gzipped_docker_archive_unpacks(tmp_path: Path) -> None:
    layers = [layer_tar([file("a", b"1")]), layer_tar([whiteout("a"), file("b", b"2")])]
    write_image(tmp_path / "image.tar", "docker-archive", layers, image_config(layers), ["gzip", "none"])
    (tmp_path / "image.tar.gz").write_bytes(gzip.compress((tmp_path / "image.tar").read_bytes()))
    (tmp_path / "root").mkdir()
    assert unpack(f"docker-archive:{tmp_path / 'image.tar.gz'}", tmp_path / "root").layers == 2
    assert tree(tmp_path / "root") == {"b"} and (tmp_path / "root/b").read_bytes() == b"2"


def test_an_image_config_goes_to_json_and_back() -> None:
    config = ImageConfig(digest="sha256:" + "0" * 64, env={"A": "1", "B": ""}, working_dir=None, user="u",
                         entrypoint=[], cmd=["sh"], layers=2)
    record = json.loads(json.dumps(config.to_json()))
    assert record["version"] == 1
    assert ImageConfig.from_json(record) == config
    with pytest.raises(ImageError, match="version 2"):
        ImageConfig.from_json({**record, "version": 2})
    with pytest.raises(ImageError, match="'cmd'"):
        ImageConfig.from_json({k: v for k, v in record.items() if k != "cmd"})


def test_an_image_index_is_resolved_to_its_linux_amd64_image(tmp_path: Path) -> None:
    layout = Layout()

    def image(arch: str) -> dict:
        layer = layer_tar([file("arch", arch.encode())])
        return layout.image([layer], image_config([layer], architecture=arch), ["gzip"],
                            platform={"os": "linux", "architecture": arch})

    attestation = layout.image([], image_config([]), platform={"os": "unknown", "architecture": "unknown"})
    index = layout.index([image("arm64"), image("amd64"), attestation])
    (tmp_path / "root").mkdir()
    # one image under two tags is one image
    tags = [{**index, "annotations": {"org.opencontainers.image.ref.name": tag}} for tag in ("1", "latest")]
    config = unpack(layout.write(tmp_path / "image.tar", tags), tmp_path / "root")
    assert (tmp_path / "root/arch").read_bytes() == b"amd64" and config.layers == 1


def test_an_archive_of_several_images_or_of_another_platform_is_refused(tmp_path: Path) -> None:
    layout = Layout()
    images = [layout.image([layer], image_config([layer])) for layer in (layer_tar([file(n)]) for n in "ab")]
    (tmp_path / "root").mkdir()
    with pytest.raises(ImageError, match=r"index.json: holds 2 images"):
        unpack(layout.write(tmp_path / "two.tar", images), tmp_path / "root")
    other = Layout()
    layer = layer_tar([file("a")])
    foreign = other.index([other.image([layer], image_config([layer], architecture=arch),
                                       platform={"os": "linux", "architecture": arch})
                           for arch in ("arm64", "s390x")])
    with pytest.raises(ImageError, match=r"no linux/amd64 image \(it has linux/arm64, linux/s390x\)"):
        unpack(other.write(tmp_path / "foreign.tar", [foreign]), tmp_path / "root")
    arm64 = image_config([layer], architecture="arm64")
    with pytest.raises(ImageError, match="the image is for linux/arm64; rewind's machines are linux/amd64"):
        unpack(write_image(tmp_path / "arm64.tar", "oci-archive", [layer], arm64), tmp_path / "root")
    assert os.listdir(tmp_path / "root") == []


def test_a_layer_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    layers = [layer_tar([file("a", b"1")]), layer_tar([file("b", b"2")])]
    source = write_image(tmp_path / "layout", "oci", layers, image_config(layers), ["gzip", "none"])
    blob = sha256(layers[1]).removeprefix("sha256:")
    (tmp_path / "layout/blobs/sha256" / blob).write_bytes(layer_tar([file("b", b"3")]))
    (tmp_path / "root").mkdir()
    with pytest.raises(ImageError, match=f"layer 2/2 \\(blobs/sha256/{blob}\\): content does not match"):
        unpack(source, tmp_path / "root")


def test_a_truncated_layer_is_refused(tmp_path: Path) -> None:
    layers = [layer_tar([file("a", os.urandom(1 << 16))])]
    source = write_image(tmp_path / "layout", "oci", layers, image_config(layers), ["gzip"])
    blob = tmp_path / "layout/blobs/sha256" / sha256(compress(layers[0], "gzip")).removeprefix("sha256:")
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    (tmp_path / "root").mkdir()
    with pytest.raises(ImageError, match=f"layer 1/1 \\(blobs/sha256/{blob.name}\\): .*end"):
        unpack(source, tmp_path / "root")


def test_a_docker_layer_that_does_not_match_its_diff_id_is_refused(tmp_path: Path) -> None:
    layers = [layer_tar([file("a", b"1")])]
    config = image_config([layer_tar([file("a", b"other")])])
    (tmp_path / "root").mkdir()
    source = write_image(tmp_path / "image.tar", "docker-archive", layers, config, ["gzip"])
    with pytest.raises(ImageError, match=r"1/1 \(layer0/layer.tar\), uncompressed: content does not match"):
        unpack(source, tmp_path / "root")


# Layers that would write, link or delete outside the root if names or symlinks were followed,
# given the outside directory.
ESCAPES = {
    "dot-dot": lambda out: [[file("../escape", b"x")]],
    "absolute-name": lambda out: [[file(str(out.parent / "escape"), b"x")]],
    "absolute-symlink": lambda out: [[symlink("out", str(out)), file("out/escape", b"x")]],
    "relative-symlink": lambda out: [[symlink("out", "../outside")], [file("out/escape", b"x")]],
    "folder-through-symlink": lambda out: [[folder("d"), symlink("d/out", "../../outside")],
                                           [folder("d/out/escape")]],
    "hard-link-dot-dot": lambda out: [[hardlink("stolen", "../outside/secret")]],
    "hard-link-through-symlink": lambda out: [[symlink("out", str(out))], [hardlink("stolen", "out/secret")]],
    "whiteout-through-symlink": lambda out: [[symlink("out", str(out))], [whiteout("out/secret")]],
    "opaque-through-symlink": lambda out: [[symlink("out", str(out))], [opaque("out")]],
}


@pytest.mark.parametrize("case", ESCAPES)
def test_nothing_is_written_outside_the_root(tmp_path: Path, case: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"host")
    layers = [layer_tar(entries) for entries in ESCAPES[case](outside)]
    source = write_image(tmp_path / "image.tar", "oci-archive", layers, image_config(layers))
    (tmp_path / "root").mkdir()
    with pytest.raises(ImageError, match="points outside the image's root|leads through the symlink"):
        unpack(source, tmp_path / "root")
    assert sorted(os.listdir(tmp_path)) == ["image.tar", "outside", "root"]
    assert os.listdir(outside) == ["secret"]
    assert (outside / "secret").read_bytes() == b"host" and os.stat(outside / "secret").st_nlink == 1


def test_a_device_node_the_host_may_not_make_is_skipped(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "mknod", refuse)
    layers = [layer_tar([folder("dev"), device("dev/null", 1, 3), file("dev/after")])]
    (tmp_path / "root").mkdir()
    lines: list[str] = []
    source = write_image(tmp_path / "image.tar", "oci-archive", layers, image_config(layers))
    unpack(source, tmp_path / "root", lines.append)
    assert "skipped device node dev/null: this host may not make device nodes" in lines
    assert os.listdir(tmp_path / "root/dev") == ["after"]


@pytest.mark.parametrize("text", ["docker:x", "oci-archive:", "image.tar", "dir:x", "", "oci"])
def test_a_bad_source_string_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="give oci-archive:PATH, docker-archive:PATH or oci:DIR"):
        parse_source(text)


def test_sources_are_parsed() -> None:
    assert parse_source("oci-archive:a/b.tar") == ("oci-archive", Path("a/b.tar"))
    assert parse_source("docker-archive:/x:y.tar") == ("docker-archive", Path("/x:y.tar"))
    assert parse_source("oci:layout") == ("oci", Path("layout"))


def test_bad_requests_and_broken_archives_are_told_apart(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidArgument, match="no such file"):
        unpack(f"oci-archive:{tmp_path / 'missing.tar'}", root)
    with pytest.raises(InvalidArgument, match="no such directory"):
        unpack(f"oci:{tmp_path / 'missing'}", root)
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ImageError, match="not a readable tar archive"):
        unpack(f"docker-archive:{tmp_path / 'junk.tar'}", root)
    layers = [layer_tar([file("a")])]
    write_image(tmp_path / "docker.tar", "docker-archive", layers, image_config(layers))
    with pytest.raises(ImageError, match="docker.tar: index.json is missing"):
        unpack(f"oci-archive:{tmp_path / 'docker.tar'}", root)
    (root / "x").write_bytes(b"")
    with pytest.raises(InvalidArgument, match="not empty"):
        unpack(write_image(tmp_path / "image.tar", "oci-archive", layers, image_config(layers)), root)


@pytest.mark.skipif(not BUSYBOX.is_file(), reason="busybox-static is not installed")
@pytest.mark.parametrize("kind", ["oci", "docker"])
def test_a_busybox_image_unpacks_into_a_root_that_runs(tmp_path: Path, kind: str) -> None:
    source = make_busybox_archive(tmp_path / "busybox.tar", kind, env={"PATH": "/bin", "HOME": "/root"},
                                  workdir="/tmp")
    root = tmp_path / "root"
    root.mkdir()
    config = unpack(source, root)
    assert (config.env, config.working_dir, config.cmd, config.layers) == \
        ({"PATH": "/bin", "HOME": "/root"}, "/tmp", ["/bin/sh"], 2)
    assert filecmp.cmp(root / "bin/busybox", BUSYBOX, shallow=False)
    assert os.readlink(root / "bin/sh") == "busybox"
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    assert set(BUSYBOX_APPLETS) <= set(applets)
    assert not (root / "etc/remove-me").exists()
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o1777
    script = "cd /tmp && pwd && cat /etc/hostname && stat -c '%U:%G %a' /home/user && ls /etc"
    done = subprocess.run([shutil.which("chroot") or "chroot", str(root), "/bin/sh", "-c", script],
                          env={"PATH": "/bin"}, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == ["/tmp", "rewind", "user:user", "755",
                                            "group", "hostname", "passwd"]
