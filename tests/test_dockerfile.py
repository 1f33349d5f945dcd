"""Dockerfile builds with Buildah into OCI archives (no QEMU).

FROM is a busybox root imported with import_root: a Debian root would make each run of the suite
wait for mmdebstrap. One builder, in a temporary folder, serves the module and is removed after it,
with a check that it left no mount and no process behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewind.errors import ImageError, InvalidArgument
from rewind.image.dockerfile import Builder, builder_for

BASE = "rewind-test-base"
BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "id", "echo", "cat", "ls", "mkdir", "tail", "true", "false"]
PROBE = "rewind-leftover-probe"  # names a process a RUN step leaves running in the background

needs_buildah = pytest.mark.skipif(
    shutil.which("buildah") is None or os.geteuid() != 0 or not BUSYBOX.exists(),
    reason="needs root, buildah and busybox-static (scripts/install installs both)")


def make_busybox_root(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    return root


def buildah(builder: Builder, *args: str) -> list[str]:
    """What buildah prints, one item a line, for `args` run on the builder's storage."""
    # In a mount namespace of its own: run on the host, buildah leaves overlay's folder mounted there.
    command = ["unshare", "--mount", "buildah", f"--root={builder.root}", f"--runroot={builder.runroot}",
               f"--storage-driver={builder.driver}", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()


def processes_naming(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended while we looked
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builder]:
    tmp = tmp_path_factory.mktemp("builder")
    b = Builder(root=tmp / "root", runroot=tmp / "run")
    b.import_root(make_busybox_root(tmp / "base"), BASE, env={"PATH": "/bin"})
    yield b
    b.remove_all()
    assert not b.root.exists() and not b.runroot.exists()
    assert str(tmp) not in Path("/proc/self/mounts").read_text()
    assert processes_naming(str(tmp)) == []


def read_archive(path: Path) -> tuple[dict, dict[str, tuple[tarfile.TarInfo, bytes]]]:
    """An oci-archive's image config, and its files by absolute path (upper layers win)."""
    with tarfile.open(path) as archive:
        def blob(digest: str) -> bytes:
            return archive.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}").read()

        index = json.loads(archive.extractfile("index.json").read())
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        files = {}
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"])), mode="r:*") as tar:
                for member in tar:
                    data = tar.extractfile(member).read() if member.isfile() else b""
                    files["/" + member.name.removeprefix("./")] = (member, data)
    return config, files


def write_context(folder: Path, dockerfile: str) -> Path:
    folder.mkdir()
    (folder / "Dockerfile").write_text(dockerfile)
    return folder


DOCKERFILE = f"""\
FROM {BASE}
ARG WHO
RUN echo hi > /built && id -u > /uid-at-build && echo "$WHO" > /who
RUN (sh -c 'tail -f /dev/null; :' {PROBE} >/dev/null 2>&1 &)
COPY note.txt /opt/note.txt
COPY tree /opt/tree
ENV GREETING=hello
WORKDIR /work
USER 1000
RUN id -u > /tmp/uid-at-run
"""


@needs_buildah
def test_a_dockerfile_builds_into_an_oci_archive(builder: Builder, tmp_path: Path) -> None:
    context = write_context(tmp_path / "context", DOCKERFILE)
    (context / "note.txt").write_text("a note\n")
    (context / "tree/sub").mkdir(parents=True)
    (context / "tree/sub/leaf.txt").write_text("a leaf\n")
    out, lines = tmp_path / "out/image.tar", []
    builder.build(context / "Dockerfile", context, out, report=lines.append, build_args={"WHO": "tester"})

    assert f"STEP 1/10: FROM {BASE}" in lines and "STEP 9/10: USER 1000" in lines
    config, files = read_archive(out)
    assert {"PATH=/bin", "GREETING=hello"} <= set(config["config"]["Env"])
    assert config["config"]["WorkingDir"] == "/work" and config["config"]["User"] == "1000"
    assert files["/built"][1] == b"hi\n" and files["/uid-at-build"][1] == b"0\n"
    assert files["/who"][1] == b"tester\n"
    assert files["/opt/note.txt"][1] == b"a note\n"
    assert files["/opt/tree/sub/leaf.txt"][1] == b"a leaf\n"
    uid_at_run, data = files["/tmp/uid-at-run"]
    assert data == b"1000\n" and uid_at_run.uid == 1000
    assert files["/work"][0].isdir() and files["/bin/busybox"][0].isfile()
    assert sorted(p.name for p in out.parent.iterdir()) == ["image.tar", "image.tar.log"]
    assert processes_naming(PROBE) == []  # the step's background process ended with the build
    assert buildah(builder, "containers", "--all", "--quiet") == []
    assert len(buildah(builder, "images", "--all", "--quiet")) == 1  # the base; builds keep nothing


@needs_buildah
def test_a_failing_step_is_named_and_its_log_kept(builder: Builder, tmp_path: Path) -> None:
    context = write_context(tmp_path / "context", f"""\
FROM {BASE}
RUN echo fine
RUN echo about to fail >&2; exit 3
RUN echo never
""")
    out = tmp_path / "image.tar"
    with pytest.raises(ImageError) as failed:
        builder.build(context / "Dockerfile", context, out)
    message = str(failed.value)
    assert 'STEP "RUN echo about to fail >&2; exit 3"' in message and "exit status 3" in message
    assert "it printed: about to fail" in message and "\n" not in message
    log = tmp_path / "image.tar.log"
    assert str(log) in message and "STEP 4/4" not in log.read_text()
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["context", "image.tar.log"]
    assert buildah(builder, "containers", "--all", "--quiet") == []


@needs_buildah
def test_a_from_of_an_unknown_image_asks_no_registry(builder: Builder, tmp_path: Path) -> None:
    """registries.conf aliases debian to docker.io; a lookup there would fail otherwise here."""
    context = write_context(tmp_path / "context", "FROM debian\nRUN true\n")
    with pytest.raises(ImageError, match=r"STEP 1/2: FROM debian: .*image not known"):
        builder.build(context / "Dockerfile", context, tmp_path / "image.tar")


@needs_buildah
def test_an_interrupted_build_leaves_nothing_running(builder: Builder, tmp_path: Path) -> None:
    context = write_context(tmp_path / "context", f"FROM {BASE}\nRUN tail -f /dev/null\n")

    def interrupt(line: str) -> None:
        if line.startswith("STEP 2/2"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        builder.build(context / "Dockerfile", context, tmp_path / "image.tar", report=interrupt)
    assert processes_naming(str(builder.root)) == []
    assert buildah(builder, "containers", "--all", "--quiet") == []  # buildah cleaned up on SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context", "image.tar.log"]


@needs_buildah
def test_importing_a_name_again_replaces_its_image(builder: Builder, tmp_path: Path) -> None:
    before = buildah(builder, "images", "--all", "--quiet")
    root = make_busybox_root(tmp_path / "root")
    (root / "etc/motd").write_text("second\n")
    builder.import_root(root, BASE, env={"PATH": "/bin"})
    after = buildah(builder, "images", "--all", "--quiet")
    assert len(after) == len(before) and after != before


def test_bad_input_is_refused_before_buildah_runs(tmp_path: Path) -> None:
    b = Builder(root=tmp_path / "root", runroot=tmp_path / "run")
    write_context(tmp_path / "context", "FROM scratch\n")
    with pytest.raises(InvalidArgument, match="no Dockerfile at"):
        b.build(tmp_path / "context/Missing", tmp_path / "context", tmp_path / "out.tar")
    with pytest.raises(InvalidArgument, match="is not a folder"):
        b.build(tmp_path / "context/Dockerfile", tmp_path / "nowhere", tmp_path / "out.tar")
    with pytest.raises(InvalidArgument, match="not an image name"):
        b.import_root(tmp_path / "context", "Upper/Case")
    with pytest.raises(InvalidArgument, match="is not a folder"):
        b.import_root(tmp_path / "nowhere", "fine")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context"]


def test_a_missing_buildah_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    context = write_context(tmp_path / "context", "FROM scratch\n")
    b = Builder(root=tmp_path / "root", runroot=tmp_path / "run")
    with pytest.raises(ImageError, match="needs buildah: apt-get install buildah"):
        b.build(context / "Dockerfile", context, tmp_path / "out/image.tar")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context"]


def test_each_home_has_its_own_builder(tmp_path: Path) -> None:
    one, two = builder_for(tmp_path / "one"), builder_for(tmp_path / "two")
    assert one.root == tmp_path / "one/builder" and one.runroot.parent == Path("/run")
    assert one.runroot != two.runroot and builder_for(tmp_path / "one") == one
