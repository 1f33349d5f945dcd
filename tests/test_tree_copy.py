"""Folders in and out of a machine (`cp -r`), streamed as tar: a tree of several hundred
files round trips byte for byte with its links, empty folders, modes and mtimes; cp -r's
rule for a destination that exists; clear errors that leave nothing behind (a full guest
disk included); the CLI, one round trip through a real `rewind serve`, and MCP. Unpacking
is checked against hostile streams on the host, where it also guards downloads."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import anyio
import pytest
from conftest import rewind_cli
from mcp import Client
from serving import home_env, served

from rewind import AlreadyExists, Home, InvalidArgument, Sandbox
from rewind.errors import GuestFileError
from rewind.guest import tree
from rewind.serve.mcpserver import build_server
from rewind.serve.service import Service


def make_tree(root: Path) -> Path:
    """Several hundred files in nested and empty folders, links, modes 0600 and 0755, a name
    with spaces and a 5 MiB binary."""
    for i in range(30):
        folder = root / f"pkg{i}" / "sub" / "deeper"
        folder.mkdir(parents=True)
        for j in range(10):
            (folder.parent / f"m{j}.py").write_text(f"# module {i}.{j}\n" * (i + j))
        (folder / "data.txt").write_bytes(bytes(range(256)) * i)
    (root / "empty" / "nested-empty").mkdir(parents=True)
    (root / "with space").mkdir()
    (root / "with space" / "a file with spaces.txt").write_text("spaces\n")
    (root / "secret").write_text("private\n")
    (root / "secret").chmod(0o600)
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "big.bin").write_bytes(os.urandom(5 << 20))
    (root / "link").symlink_to("pkg0/sub/m0.py")
    (root / "dangling").symlink_to("/nowhere/at/all")
    (root / "up").symlink_to("..")
    (root / "pkg1" / "locked").mkdir()
    (root / "pkg1" / "locked").chmod(0o555)
    os.utime(root / "pkg3" / "sub" / "m3.py", (1_000_000_000.25, 1_000_000_000.25))
    return root


def same_trees(a: Path, b: Path) -> None:
    """Contents (diff -r, links not followed), then each entry's kind, mode and mtime."""
    r = subprocess.run(["diff", "-r", "--no-dereference", str(a), str(b)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for path in [a, *a.rglob("*")]:
        twin = b / path.relative_to(a)
        st, st2 = path.lstat(), twin.lstat()
        assert stat.S_IFMT(st.st_mode) == stat.S_IFMT(st2.st_mode), path
        if not path.is_symlink():
            assert stat.S_IMODE(st.st_mode) == stat.S_IMODE(st2.st_mode), path
        assert abs(st.st_mtime - st2.st_mtime) < 1e-6, path


def count(root: Path) -> dict[str, int]:
    entries = [root, *root.rglob("*")]
    files = [p for p in entries if p.is_file() and not p.is_symlink()]
    return {"files": len(files), "folders": sum(p.is_dir() and not p.is_symlink() for p in entries),
            "links": sum(p.is_symlink() for p in entries), "bytes": sum(p.stat().st_size for p in files)}


# ---- unpacking, on the host (no machine) ----

def stream(*members: tuple[str, str, bytes | str]) -> bytes:
    """A tar stream of (kind, name, content or link target) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, body in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))  # type: ignore[arg-type]
                continue
            info.type = {"dir": tarfile.DIRTYPE, "link": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                         "fifo": tarfile.FIFOTYPE}[kind]
            info.linkname = str(body)
            tar.addfile(info)
    return out.getvalue()


def unpack_to(dest: Path, data: bytes) -> tree.Counts:
    counts = tree.Counts()
    tree.receive(tree.target(str(dest), None), [data[:1000], data[1000:]], 0o777, counts)
    return counts


@pytest.mark.parametrize("members", [
    [("file", "../evil", b"x")],
    [("file", "a/../../evil", b"x")],
    [("file", "/tmp/evil-absolute", b"x")],
    [("link", "out", "{outside}"), ("file", "out/evil", b"x")],
    [("link", "up", ".."), ("dir", "up/evil", "")],
    [("link", "out", "{outside}"), ("link", "out/evil", "/etc/passwd")],
    [("file", "f", b"x"), ("file", "f/evil", b"x")],
    [("file", "twice", b"x"), ("file", "twice", b"y")],
    [("link", "twice", "{outside}/victim"), ("file", "twice", b"x")],
    [("file", "f", b"x"), ("hard", "h", "{outside}/victim")],
    [("fifo", "pipe", "")],
    [("file", ".", b"x")],
])
def test_unpacking_refuses_a_stream_that_would_leave_its_folder(tmp_path: Path, members: list) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("untouched\n")
    members = [(kind, name, body.replace("{outside}", str(outside)) if isinstance(body, str) else body)
               for kind, name, body in members]
    with pytest.raises(tree.TreeError) as refused:
        unpack_to(tmp_path / "dest", stream(*members))
    assert refused.value.kind == "bad_request"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"], "a partial copy was left"
    assert [p.name for p in outside.iterdir()] == ["victim"]
    assert (outside / "victim").read_text() == "untouched\n"
    assert not Path("/tmp/evil-absolute").exists() and not (tmp_path / "evil").exists()


def test_unpacking_makes_missing_parents_and_takes_members_in_any_order(tmp_path: Path) -> None:
    counts = unpack_to(tmp_path / "dest", stream(("file", "a/b/c.txt", b"c"), ("dir", "a", ""),
                                                 ("link", "a/b/l", "c.txt"), ("dir", "e/f", "")))
    assert (tmp_path / "dest/a/b/c.txt").read_bytes() == b"c"
    assert os.readlink(tmp_path / "dest/a/b/l") == "c.txt"
    assert (tmp_path / "dest/e/f").is_dir()
    assert counts.as_dict() == {"files": 1, "folders": 2, "links": 1, "bytes": 1}


def test_a_cut_short_or_foreign_stream_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    whole = stream(("file", "a", os.urandom(20_000)))
    for data in (whole[:5000], b"", b"not a tar archive at all" * 100):
        with pytest.raises(tree.TreeError, match="not a whole tar stream"):
            unpack_to(tmp_path / "dest", data)
        assert list(tmp_path.iterdir()) == []


def test_pack_then_unpack_on_the_host_is_exact(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    packed, unpacked = tree.Counts(), tree.Counts()
    tree.receive(str(tmp_path / "dst"), tree.blocks(tree.pack(str(src), packed), 4096), 0o777, unpacked)
    same_trees(src, tmp_path / "dst")
    assert packed.as_dict() == unpacked.as_dict() == count(src)


def test_the_destination_follows_cp_r(tmp_path: Path) -> None:
    (tmp_path / "there").mkdir()
    (tmp_path / "file").write_text("x")
    assert tree.target(str(tmp_path / "new"), "proj") == str(tmp_path / "new")
    assert tree.target(str(tmp_path / "there") + "/", "proj") == str(tmp_path / "there" / "proj")
    (tmp_path / "there" / "proj").mkdir()
    with pytest.raises(tree.TreeError, match="never merges") as taken:
        tree.target(str(tmp_path / "there"), "proj")
    assert taken.value.kind == "exists"
    with pytest.raises(tree.TreeError, match="is a file, not a folder"):
        tree.target(str(tmp_path / "file"), "proj")
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(tree.TreeError, match="not a folder name"):
            tree.target(str(tmp_path / "there"), bad)


# ---- with a machine ----

def test_a_tree_goes_in_and_comes_back_byte_for_byte(sbx: Sandbox, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    expected = count(src)
    assert expected["files"] > 300
    sent = sbx.files.upload_dir(src, "/root/proj")
    assert {k: v for k, v in sent.to_json().items() if k != "seconds"} == expected
    listing = sbx.exec("cd /root/proj && stat -c '%a %U %n' secret run.sh 'with space' pkg1/locked && "
                       "readlink link up && find . ! -user root | wc -l", check=True).stdout
    assert listing.splitlines() == ["600 root secret", "755 root run.sh", "755 root with space",
                                    "555 root pkg1/locked", "pkg0/sub/m0.py", "..", "0"]
    back = sbx.files.download_dir("/root/proj", tmp_path / "back")
    same_trees(src, tmp_path / "back")
    assert {k: v for k, v in back.to_json().items() if k != "seconds"} == expected
    assert all(p.lstat().st_uid == os.getuid() for p in (tmp_path / "back").rglob("*"))
    assert not list(tmp_path.glob(".*rewind-partial"))
    assert sbx.exec("ls -A /root | grep -c partial").stdout == "0\n"


def test_a_big_upload_is_read_no_further_ahead_than_it_is_written(sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.mkdir()
    for i in range(4):
        (src / f"part{i}").write_bytes(os.urandom(24 << 20))
    assert sbx.files.upload_dir(src, "/root/big").bytes == 96 << 20
    peaks = sbx.exec("for p in $(pgrep -f agent.py); do awk '/VmHWM/ {print $2}' /proc/$p/status; done; "
                     "rm -rf /root/big", check=True).stdout.split()
    assert max(int(kib) for kib in peaks) < 48 << 10, peaks  # KiB: the agent does not hold the stream


def test_an_existing_folder_receives_the_copy_inside_never_merged(sbx: Sandbox, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "proj"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_text("f\n")
    sbx.exec("mkdir -p /root/into", check=True)
    sbx.files.upload_dir(src, "/root/into/")
    assert sbx.files.read_text("/root/into/proj/a/f") == "f\n"
    with pytest.raises(AlreadyExists, match="/root/into/proj already exists"):
        sbx.files.upload_dir(src, "/root/into")
    sbx.files.download_dir("/root/into/proj", tmp_path / "out")  # missing: made, with its contents
    sbx.files.download_dir("/root/into/proj", tmp_path / "out")  # there: the copy goes inside
    assert (tmp_path / "out" / "a" / "f").read_text() == (tmp_path / "out" / "proj" / "a" / "f").read_text()
    with pytest.raises(AlreadyExists, match="never merges"):
        sbx.files.download_dir("/root/into/proj", tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    sbx.files.download_dir("/root/into/proj/a", "relative")
    assert (tmp_path / "relative" / "f").read_text() == "f\n"
    (tmp_path / "deep").mkdir()
    sbx.files.upload_dir(tmp_path / "deep", "/root/made/parents/too")
    assert sbx.exec("test -d /root/made/parents/too").ok


def test_bad_sources_and_destinations_are_one_line_errors_that_leave_nothing(
        sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    (tmp_path / "a-file").write_text("x")
    cases = [
        (lambda: sbx.files.upload_dir(tmp_path / "missing", "/root/m"), InvalidArgument, "no such folder"),
        (lambda: sbx.files.upload_dir(tmp_path / "a-file", "/root/m"), InvalidArgument, "is not a folder"),
        (lambda: sbx.files.upload_dir(src, "/etc/hostname"), GuestFileError, "/etc/hostname is a file"),
        (lambda: sbx.files.upload_dir(src, "relative/path"), InvalidArgument, "absolute"),
        (lambda: sbx.files.download_dir("/root/missing", tmp_path / "m"), GuestFileError, "no such folder"),
        (lambda: sbx.files.download_dir("/etc/hostname", tmp_path / "m"), GuestFileError, "not a folder"),
        (lambda: sbx.files.download_dir("/etc", tmp_path / "a-file"), InvalidArgument, "is a file"),
        (lambda: sbx.files.download_dir("/usr/lib", tmp_path / "m", max_bytes=1 << 20), GuestFileError,
         "larger than 1048576 bytes"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as raised:
            call()
        assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "src"]
    left = sbx.exec("test ! -e /root/m && test ! -e /root/relative && cat /etc/hostname").stdout
    assert left == "shared\n"


def test_a_full_guest_disk_is_an_error_and_leaves_no_partial_copy(sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "small").write_text("small\n")
    # Big enough that much is still on its way when the guest fails: the next command must
    # still be answered at once (the host once hung up on data the guest had not read).
    (src / "sub" / "big.bin").write_bytes(os.urandom(32 << 20))
    sbx.exec("mkdir -p /mnt/small && mount -t tmpfs -o size=1m tmpfs /mnt/small", check=True)
    try:
        with pytest.raises(GuestFileError, match="No space left on device") as full:
            sbx.files.upload_dir(src, "/mnt/small/proj")
        assert "\n" not in str(full.value)
        assert sbx.exec("ls -A /mnt/small", timeout=10).stdout == "", "a partial copy was left"
        (src / "sub" / "big.bin").unlink()
        assert sbx.files.upload_dir(src, "/mnt/small/proj").files == 1  # the machine and its agent carry on
    finally:
        sbx.exec("umount /mnt/small", check=True)


def test_a_source_that_fails_part_way_leaves_nothing_and_the_agent_answers(sbx: Sandbox) -> None:
    whole = stream(("file", "big.bin", os.urandom(24 << 20)))

    class Failing(io.RawIOBase):
        """The first 8 MiB of the stream, then a read error."""

        def __init__(self) -> None:
            self.at = 0

        def read(self, size: int = -1) -> bytes:
            if self.at >= 8 << 20:
                raise OSError(errno.EIO, "the source failed")
            self.at += (size := max(size, 0) or 1 << 20)
            return whole[self.at - size : self.at]

    with pytest.raises(OSError, match="the source failed"):
        sbx.files.upload_tar(Failing(), "/root/failed")
    assert sbx.exec("ls -d /root/failed /root/.failed* 2>&1 | wc -l", timeout=10).stdout == "2\n"


def test_a_hostile_tar_into_the_guest_cannot_write_outside(sbx: Sandbox) -> None:
    evil = stream(("dir", "ok", ""), ("link", "ok/out", "/root/outside"), ("file", "ok/out/evil", b"x"))
    sbx.exec("mkdir -p /root/outside", check=True)
    with pytest.raises(InvalidArgument, match="puts it under a file or link"):
        sbx.files.upload_tar(io.BytesIO(evil), "/root/landing")
    assert sbx.exec("ls -A /root/outside; ls -d /root/landing /root/.landing* 2>&1 | wc -l").stdout == "2\n"


def test_cli_cp_r_both_ways_reports_json(sbx: Sandbox, shared_home: Home, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "empty").mkdir(parents=True)
    (src / "f.txt").write_text("hello\n")
    (src / "l").symlink_to("f.txt")
    env = home_env(shared_home)
    r = rewind_cli("cp", "-r", "--json", str(src), "shared:/root/cli-tree", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["files"], report["folders"], report["links"], report["bytes"]) == (1, 2, 1, 6)
    assert report["seconds"] > 0
    r = rewind_cli("cp", "-r", "--json", "shared:/root/cli-tree", str(tmp_path / "back"), env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["files"] == 1, r.stderr
    same_trees(src, tmp_path / "back")
    r = rewind_cli("cp", "-r", str(src), "shared:/etc/hostname", env=env)
    err = r.stderr.decode()
    assert r.returncode == 1 and len(err.strip().splitlines()) == 1 and "is a file" in err, err


def test_a_round_trip_through_rewind_serve(sbx: Sandbox, shared_home: Home, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "m.py").write_text("print(1)\n")
    (src / "sub" / "m.py").chmod(0o700)
    (src / "link").symlink_to("sub/m.py")
    with served(shared_home, tmp_path / "serve.log", "t0ken") as url, Sandbox.connect(url, "t0ken") as remote:
        box = remote.get("shared")
        sent = box.files.upload_dir(src, "/root/via-http")
        assert (sent.files, sent.folders, sent.links) == (1, 2, 1)
        with pytest.raises(GuestFileError, match="is a file"):
            box.files.upload_dir(src, "/etc/hostname")
        box.files.download_dir("/root/via-http", tmp_path / "back")
    same_trees(src, tmp_path / "back")


def test_mcp_tools_copy_folders_on_the_servers_host(sbx: Sandbox, shared_home: Home, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "empty").mkdir(parents=True)
    (src / "f").write_text("via mcp\n")

    async def session() -> None:
        async with Client(build_server(Service(shared_home)), read_timeout_seconds=300) as client:
            sent = await client.call_tool("upload_dir", {"name": "shared", "local": str(src),
                                                         "path": "/root/mcp"})
            assert not sent.is_error and sent.structured_content["files"] == 1, sent.content
            back = await client.call_tool("download_dir", {"name": "shared", "path": "/root/mcp",
                                                           "local": str(tmp_path / "back")})
            assert not back.is_error and back.structured_content["folders"] == 2, back.content
            refused = await client.call_tool("upload_dir", {"name": "shared", "local": str(src),
                                                            "path": "/etc/hostname"})
            assert refused.is_error and "GuestFileError: /etc/hostname is a file" in refused.content[0].text
    anyio.run(session)
    same_trees(src, tmp_path / "back")
