"""The host-side file diff on disks made here, without a guest: an ext4 image from mkfs.ext4,
changed offline with debugfs, the change put in a qcow2 layer of its own over the first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rewind.engine.changes import filediff
from rewind.engine.changes.filediff import Disk, IndexCache, diff_disks
from rewind.engine.disk.qcow2 import Chain, LayerError

CHANGES = """\
rm /a/x.txt
write {new} /a/new.txt
mkdir /c
symlink /c/l /a/new.txt
set_inode_field /keep.txt mode 0100600
set_inode_field /a/b/y.txt uid 1000
ln /keep.txt /a/hard
rm /many/f-0123
"""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def disks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """base.qcow2, and top.qcow2 over it holding CHANGES."""
    tmp = tmp_path_factory.mktemp("fs")
    tree = tmp / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "x.txt").write_text("x\n")
    (tree / "a" / "b" / "y.txt").write_text("y\n")
    (tree / "keep.txt").write_text("k\n")
    (tree / "link").symlink_to("keep.txt")
    (tree / "many").mkdir()
    for i in range(600):  # a directory of several blocks, indexed (htree)
        (tree / "many" / f"f-{i:04d}").write_text(str(i))
    _run("mkfs.ext4", "-q", "-F", "-d", str(tree), str(tmp / "base.raw"), "32M")
    _run("cp", str(tmp / "base.raw"), str(tmp / "mod.raw"))
    (tmp / "new.txt").write_text("newdata\n")
    (tmp / "cmds").write_text(CHANGES.format(new=tmp / "new.txt"))
    _run("debugfs", "-w", "-f", str(tmp / "cmds"), str(tmp / "mod.raw"))
    _run("qemu-img", "convert", "-O", "qcow2", str(tmp / "base.raw"), str(tmp / "base.qcow2"))
    # Only the clusters that differ from the base go into the top layer.
    _run("qemu-img", "convert", "-O", "qcow2", "-B", str(tmp / "base.qcow2"), "-F", "qcow2",
         str(tmp / "mod.raw"), str(tmp / "top.qcow2"))
    return tmp / "base.qcow2", tmp / "top.qcow2"


def _diff(base: Path, top: Path, cache: IndexCache, reverse: bool = False) -> dict[str, str]:
    a, b = Disk([base], 1, cache), Disk([base, top], 2, cache)
    try:
        changes = diff_disks(b, a) if reverse else diff_disks(a, b)
    finally:
        a.close()
        b.close()
    return {c.path: c.kind for c in changes}


EXPECTED = {"/a/x.txt": "deleted", "/a/new.txt": "added", "/c": "added", "/c/l": "added",
            "/keep.txt": "modified", "/a/b/y.txt": "modified", "/a/hard": "added", "/many/f-0123": "deleted"}


def test_changes_are_found(disks: tuple[Path, Path], tmp_path: Path) -> None:
    cache = IndexCache(own=tmp_path / "own", image=tmp_path / "image")
    assert _diff(*disks, cache) == EXPECTED
    back = _diff(*disks, cache, reverse=True)
    flip = {"added": "deleted", "deleted": "added", "modified": "modified"}
    assert back == {p: flip[k] for p, k in EXPECTED.items()}


def test_what_each_change_says(disks: tuple[Path, Path], tmp_path: Path) -> None:
    cache = IndexCache(own=tmp_path / "own", image=tmp_path / "image")
    a, b = Disk([disks[0]], 1, cache), Disk(list(disks), 2, cache)
    try:
        by_path = {c.path: c for c in diff_disks(a, b)}
        assert (by_path["/keep.txt"].before.mode, by_path["/keep.txt"].after.mode) == (0o644, 0o600)
        assert (by_path["/a/b/y.txt"].before.uid, by_path["/a/b/y.txt"].after.uid) == (0, 1000)
        assert by_path["/c/l"].after.type == "symlink" and by_path["/c/l"].after.target == "/a/new.txt"
        assert by_path["/a/new.txt"].after.size == 8
        assert sorted(b.index.paths(b.index.resolve("/keep.txt"))) == ["/a/hard", "/keep.txt"]
        assert len(b.index.dirs[b.index.resolve("/many")]) == 599
        assert b.view.read_file(b.index.resolve("/a/new.txt"), 100) == b"newdata\n"
    finally:
        a.close()
        b.close()


def test_indexes_are_cached_and_damaged_ones_rebuilt(disks: tuple[Path, Path], tmp_path: Path) -> None:
    cache = IndexCache(own=tmp_path / "own", image=tmp_path / "image")
    assert _diff(*disks, cache) == EXPECTED
    kept = sorted((tmp_path / "image").glob("*.idx")) + sorted((tmp_path / "own").glob("*.idx"))
    assert len(kept) == 2  # the base's (an image's layers') and the two layers'
    for path in kept:
        path.write_bytes(b"\x00damaged")
    filediff._loaded.clear()  # as a new process finds them
    assert _diff(*disks, cache) == EXPECTED
    assert all(p.read_bytes() != b"\x00damaged" for p in kept)


def test_a_file_that_is_not_qcow2_is_refused(tmp_path: Path) -> None:
    (tmp_path / "raw").write_bytes(b"\0" * 4096)
    with pytest.raises(LayerError, match="not a qcow2 file"):
        Chain([tmp_path / "raw"])


def test_an_index_brought_up_to_date_names_every_inode_as_one_made_whole(
        disks: tuple[Path, Path], tmp_path: Path) -> None:
    """A running machine's index is its frozen layers' with the changed directories read
    again; which entries name each inode is updated with them, not made again."""
    cache = IndexCache(own=tmp_path / "own", image=tmp_path / "image")
    Disk([disks[0]], 1, cache).close()
    b = Disk(list(disks), 1, cache)  # its top layer live: its index is the base's, advanced
    try:
        whole = filediff.Index(b.index.dirs, b.index.runs)
        def by_inode(index: filediff.Index) -> dict[int, list[tuple[int, str]]]:
            return {ino: sorted(entries) for ino, entries in index.parents().items()}
        assert by_inode(b.index) == by_inode(whole)
        assert sorted(b.index.paths(b.index.resolve("/keep.txt"))) == ["/a/hard", "/keep.txt"]
        assert b.index.resolve("/a/x.txt") is None
    finally:
        b.close()
