"""The checkpoint store (rewind.store): no QEMU here, only blobs, manifests and files."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

import blake3
import pytest
from conftest import flip_stored_byte, rewind_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewind.store.packs as packs_module
import rewind.store.store as store_module
from rewind.engine.checkpoint import Caches, commit_capture
from rewind.engine.memory.snapshot import SavedState
from rewind.errors import InvalidArgument
from rewind.store import (
    BadExport,
    BadRef,
    BlobIndex,
    CheckpointExists,
    CheckpointManifest,
    CorruptChunk,
    Store,
    StoreBusy,
    StoreError,
    UnknownCheckpoint,
    export_checkpoint,
    import_checkpoint,
    open_store,
)
from rewind.store.packs import read_index

CS = 4096  # small chunks keep the tests fast; the code does not care


@pytest.fixture(autouse=True)
def _no_stray_threads() -> Iterator[None]:
    """Every operation's worker threads are gone when it returns, even after an error."""
    yield
    assert not [t for t in threading.enumerate() if t.name.startswith("rewind-store")]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store", create=True, chunk_size=CS)


def chunk_files(store: Store) -> set[str]:
    """The chunks stored, loose or packed."""
    return {p.name for p in (store.root / "chunks").glob("*/*")} | \
        {h for pack in packs(store) for h, _, _ in read_index(pack)}


def packs(store: Store) -> list[Path]:
    return sorted((store.root / "packs").glob("*.pack"))


def rand(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def put(store: Store, data: bytes) -> BlobIndex:
    return store.put_blob(BytesIO(data))


def materialized(store: Store, blob: BlobIndex, tmp_path: Path) -> bytes:
    dest = tmp_path / "out"
    store.materialize(blob, dest)
    return dest.read_bytes()


def chain(store: Store, datas: list[bytes], **kwargs: object) -> list[CheckpointManifest]:
    """Commit one checkpoint per blob, each the parent of the next."""
    out: list[CheckpointManifest] = []
    for data in datas:
        out.append(store.commit("m", {"ram": put(store, data)}, parent=out[-1] if out else None, **kwargs))
    return out


def store_state(store: Store) -> tuple[set[str], list[str], list[str]]:
    return chunk_files(store), sorted(os.listdir(store.root / "checkpoints")), os.listdir(store.root / "tmp")


# -- blobs ------------------------------------------------------------------------------------

segments = st.lists(st.tuples(st.sampled_from(["zero", "random", "ones"]), st.integers(0, 3 * CS + 17)),
                    max_size=6)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return open_store(tmp_path_factory.mktemp("shared") / "store", create=True, chunk_size=CS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=segments, seed=st.integers(0, 2**32), as_file=st.booleans())
def test_round_trip_of_blobs_with_zero_runs_and_odd_sizes(shared_store: Store, tmp_path: Path,
                                                          parts: list[tuple[str, int]], seed: int,
                                                          as_file: bool) -> None:
    data = b"".join(bytes(n) if kind == "zero" else b"\xff" * n if kind == "ones" else rand(n, seed)
                    for kind, n in parts)
    if as_file:
        (tmp_path / "src").write_bytes(data)
        blob = shared_store.put_blob(tmp_path / "src")
    else:
        blob = put(shared_store, data)
    assert blob.size == len(data)
    assert [h is None for h in blob.chunks] == [not any(data[i:i + CS]) for i in range(0, len(data), CS)]
    assert materialized(shared_store, blob, tmp_path) == data
    assert BlobIndex.from_json(blob.to_json()) == blob


def test_blobs_put_within_one_packing_share_packs_named_when_it_ends(store: Store) -> None:
    with store.packing():
        a = store.put_blob(BytesIO(rand(2 * CS, seed=8)))
        b = store.put_blob(BytesIO(rand(2 * CS, seed=9)))
        assert packs(store) == [] and not store.has_chunks(a)  # not durable yet: not named
    assert len(packs(store)) == 1 and store.has_chunks(a) and store.has_chunks(b)
    with pytest.raises(RuntimeError, match="midway"), store.packing():
        store.put_blob(BytesIO(rand(CS, seed=10)))
        raise RuntimeError("midway")
    assert len(packs(store)) == 1 and not list((store.root / "tmp").iterdir())


def test_an_open_file_is_stored_from_its_position_and_left_at_its_end(store: Store, tmp_path: Path) -> None:
    """A file is mapped, not read: what is stored and where the file is left are as if read."""
    data = rand(5 * CS + 100, seed=7)
    (tmp_path / "src").write_bytes(data)
    with open(tmp_path / "src", "rb") as f:
        f.seek(CS + 3)
        blob = store.put_blob(f)
        assert f.tell() == len(data)
    assert materialized(store, blob, tmp_path) == data[CS + 3:]
    with open(tmp_path / "src", "rb") as f:
        f.seek(CS)
        assert store.put_blob(f, size=2 * CS) == put(store, data[CS:3 * CS]) and f.tell() == 3 * CS


@given(old=st.lists(st.sampled_from([None, "a" * 64, "b" * 64]), max_size=20),
       new=st.lists(st.sampled_from([None, "a" * 64, "c" * 64]), max_size=20))
def test_blob_index_json_is_exact_alone_and_against_a_newer_one(old: list[str | None],
                                                                 new: list[str | None]) -> None:
    a, b = BlobIndex(len(old) * CS, CS, old), BlobIndex(len(new) * CS - 5 if new else 0, CS, new)
    assert BlobIndex.from_json(a.to_json(base=b), base=b) == a
    assert BlobIndex.from_json(a.to_json()) == a


def test_the_same_blob_twice_adds_no_chunk_and_one_changed_chunk_adds_one(store: Store) -> None:
    data = rand(16 * CS) + rand(CS, seed=1) * 3  # the repeated chunk is stored once
    first = put(store, data)
    assert len(chunk_files(store)) == 17
    assert put(store, data) == first
    assert len(chunk_files(store)) == 17
    changed = bytearray(data)
    changed[5 * CS + 100] ^= 1
    second = put(store, bytes(changed))
    assert len(chunk_files(store)) == 18
    assert [i for i, (a, b) in enumerate(zip(first.chunks, second.chunks, strict=True)) if a != b] == [5]


def test_zero_chunks_take_no_space(store: Store, tmp_path: Path) -> None:
    data = bytes(256 * CS) + b"tail"
    blob = put(store, data)
    assert blob.chunks.count(None) == 256 and len(chunk_files(store)) == 1
    store.materialize(blob, tmp_path / "sparse")
    assert (tmp_path / "sparse").read_bytes() == data
    assert os.stat(tmp_path / "sparse").st_blocks * 512 <= 2 * CS  # a hole, not a megabyte of zeros


def test_holes_of_a_sparse_source_are_not_read(store: Store, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.write(rand(3 * CS))
        f.seek(13 * CS)
        f.write(rand(CS, seed=1))
        f.truncate(20 * CS + 7)
    reads = []
    real_read = store_module._read_exact
    monkeypatch.setattr(store_module, "_read_exact", lambda f, n: reads.append(n) or real_read(f, n))
    with open(path, "rb") as f:
        f.seek(5)  # a blob may start anywhere in a file
        blob = store.put_blob(f)
    assert materialized(store, blob, tmp_path) == path.read_bytes()[5:]
    assert blob.chunks.count(None) == 16 and len(reads) < 8  # 5 chunks hold data; holes are not read


def test_chunks_said_unchanged_come_from_the_known_index_unread(store: Store, tmp_path: Path) -> None:
    old = rand(8 * CS)
    known = put(store, old)
    new = bytearray(old)
    new[3 * CS:4 * CS] = rand(CS, seed=9)
    source = bytearray(new)
    source[0:CS] = b"x" * CS  # garbage where the caller promises 'unchanged': it must not be read
    (tmp_path / "src").write_bytes(source)
    blob = store.put_blob(tmp_path / "src", known=known, unchanged={0, 1, 2, 4, 5, 6, 7})
    assert materialized(store, blob, tmp_path) == bytes(new)
    with pytest.raises(InvalidArgument, match="known index"):
        store.put_blob(tmp_path / "src", unchanged={0})
    with pytest.raises(InvalidArgument, match="chunk 8 cannot be unchanged"):
        store.put_blob(BytesIO(bytes(9 * CS)), size=9 * CS, known=known, unchanged={8})


def test_a_file_still_being_written_is_stored_up_to_its_front(store: Store, tmp_path: Path) -> None:
    """With `written`, nothing above the front its writer tells is read, nor taken for a hole
    (a hole there may be written yet): here the writer writes each chunk only when asked for
    it, a few ahead of their turn, so a reader that did not wait would store zeros."""
    n = 16
    final = bytearray(n * CS)
    for i in (1, 2, 5, 6, 9, 13, 15):
        final[i * CS:(i + 1) * CS] = rand(CS, seed=i)
    path = tmp_path / "src"
    with path.open("wb") as f:
        f.truncate(n * CS)  # at its full size from the start, all holes
    done, asked = 0, []
    ahead = {3: 13, 8: 9}  # asked for chunk 3, the writer also writes 13 (a page written early)

    def written(want: int) -> int:
        nonlocal done
        asked.append(want)
        with path.open("r+b") as f:
            while done * CS < want:
                for i in (done, ahead.get(done)):
                    if i is not None and any(final[i * CS:(i + 1) * CS]):  # zeros stay holes
                        f.seek(i * CS)
                        f.write(final[i * CS:(i + 1) * CS])
                done += 1
        return done * CS

    blob = store.put_blob(path, written=written)
    assert materialized(store, blob, tmp_path) == bytes(final)
    assert asked == sorted(asked) and asked[-1] == n * CS
    assert [h is None for h in blob.chunks] == [not any(final[i * CS:(i + 1) * CS]) for i in range(n)]
    with pytest.raises(InvalidArgument, match="regular file"):
        store.put_blob(BytesIO(bytes(CS)), written=written)


def test_a_short_source_is_refused(store: Store) -> None:
    with pytest.raises(StoreError, match="ended after 100 bytes; 5000 were expected"):
        store.put_blob(BytesIO(rand(100)), size=5000)


# -- checkpoints and refs ---------------------------------------------------------------------

def test_commit_records_lineage_and_own_bytes(store: Store) -> None:
    a, b = chain(store, [rand(4 * CS), rand(4 * CS)[:3 * CS] + rand(CS, seed=5)], labels={"task": "t"},
                 meta={"engine": {"ram": 512}})
    assert b.parent == a.id and [e.id for e in b.history] == [a.id]
    assert a.own_bytes > 3 * CS and 0 < b.own_bytes < 2 * CS  # only the changed chunk is its own
    assert store.get(b.id) == b and store.list() == [a, b]
    assert b.labels == {"task": "t"} and b.meta == {"engine": {"ram": 512}}


def test_history_survives_deleting_the_middle_and_gc(store: Store, tmp_path: Path) -> None:
    datas = [rand(6 * CS, seed=i) + bytes(2 * CS) for i in range(5)]
    points = chain(store, datas)
    for p in points[1:4]:
        store.delete(p.id)
    report = store.gc()
    assert report.chunks_removed == 0, "chunks that history entries use were removed"
    newest = points[-1]
    third_back = store.get("~3", relative_to=newest)
    assert third_back.id == points[1].id and third_back.history[0].id == points[0].id
    assert materialized(store, third_back.blobs["ram"], tmp_path) == datas[1]
    assert store.get("~4", relative_to=newest.id) == points[0]  # its manifest is still there
    assert store.check(read_data=True).ok


def test_ref_errors(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = iter(["aaaaaaaa" + "0" * 24, "aaaaaaaa" + "1" * 24, "bbbbbbbb" + "0" * 24])
    monkeypatch.setattr(store_module, "new_checkpoint_id", lambda: next(ids))
    a, b, c = chain(store, [rand(CS, seed=i) for i in range(3)], history=1)
    with pytest.raises(BadRef, match="'aaaaaaaa' matches 2 checkpoints"):
        store.get("aaaaaaaa")
    assert store.get("aaaaaaaa1") == b == store.get("BBBBBBBB~1")
    with pytest.raises(BadRef, match="id prefix 'aaaa' is too short"):
        store.get("aaaa")
    with pytest.raises(UnknownCheckpoint, match="no checkpoint named 'ghost'"):
        store.get("ghost")
    with pytest.raises(UnknownCheckpoint, match="no checkpoint has an id starting with 'cccccccc'"):
        store.get("cccccccc")
    with pytest.raises(UnknownCheckpoint, match="'~2' is past the history kept: checkpoint bbbbbbbb0000 kee"):
        store.get("~2", relative_to=c)
    with pytest.raises(BadRef, match="'~1' counts back from a checkpoint, but none was given"):
        store.get("~1")
    store.delete(b.id)
    rebuilt = store.get("~1", relative_to="bbbbbbbb")  # from c's history, which keeps only b
    assert rebuilt.entry() == b.entry() and rebuilt.history == []
    assert store.get("~0", relative_to=c) == c == store.get("bbbbbbbb~0")
    with pytest.raises(UnknownCheckpoint, match="no checkpoint has an id starting with 'aaaaaaaa1'"):
        store.get("aaaaaaaa1")
    with pytest.raises(UnknownCheckpoint, match="no manifest of its own to delete"):
        store.delete("bbbbbbbb~1")


@pytest.mark.parametrize("name", ["", "a/b", "..x", "-x", "x" * 64, "deadbeef", "x~1"])
def test_bad_checkpoint_names(store: Store, name: str) -> None:
    with pytest.raises(InvalidArgument, match="checkpoint name"):
        store.commit("m", {}, name=name)
    assert store.list() == []


def test_a_taken_name(store: Store) -> None:
    first = store.commit("m", {}, name="before-upgrade")
    with pytest.raises(CheckpointExists, match=f"'before-upgrade' is taken by checkpoint {first.id[:12]}"):
        store.commit("m", {}, name="before-upgrade")
    assert store.get("before-upgrade~0") == first and len(store.list()) == 1


def test_one_name_is_taken_once_by_racing_commits(store: Store) -> None:
    def commit(_: int) -> str:
        try:
            return store.commit("m", {}, name="race").id
        except CheckpointExists:
            return "refused"

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(commit, range(4)))
    assert results.count("refused") == 3 and [m.name for m in store.list()] == ["race"]


def test_commit_refuses_blobs_whose_chunks_are_gone(store: Store) -> None:
    blob = put(store, rand(2 * CS))
    store.gc()  # nothing committed uses them yet
    with pytest.raises(StoreError, match="2 chunks of its blobs are missing"):
        store.commit("m", {"ram": blob})
    assert store.list() == []


# -- damage and interruption --------------------------------------------------------------------

def test_a_flipped_byte_in_a_chunk_is_found_and_refused(store: Store, tmp_path: Path) -> None:
    blob = put(store, rand(4 * CS))
    store.commit("m", {"ram": blob})
    victim = blob.chunks[2]
    assert victim is not None
    flip_stored_byte(store.root, victim)
    assert store.check().ok  # without reading data only presence is checked
    report = store.check(read_data=True)
    assert not report.ok and report.checkpoints == 1 and report.chunks == 4
    assert report.problems == [f"chunk {victim} is damaged: its content does not match its hash "
                               f"(used by blob 'ram' of checkpoint {store.list()[0].id[:12]})"]
    with pytest.raises(CorruptChunk, match=victim):
        store.materialize(blob, tmp_path / "restored")
    assert sorted(os.listdir(tmp_path)) == ["store"], "a partial file was left behind"
    for pack in packs(store):
        pack.unlink()
    assert "is missing" in store.check().problems[0]


def test_a_damaged_pack_is_reported_skipped_and_kept(store: Store, tmp_path: Path) -> None:
    """A pack whose trailer is not one: check says so and its chunks are missing; gc removes
    nothing of it (what it holds cannot be known); the other packs read on."""
    kept = store.commit("m", {"ram": put(store, rand(2 * CS, seed=5))})
    hurt = store.commit("m", {"ram": put(store, rand(2 * CS, seed=6))})
    [pack] = [p for p in packs(store) if {h for h, _, _ in read_index(p)} == hurt.hashes()]
    with open(pack, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"NOPE")
    fresh = open_store(store.root)
    problems = fresh.check().problems
    assert f"pack {pack.name} is damaged: its trailer is not one" in problems
    assert sum("is missing" in p for p in problems) == 2
    with pytest.raises(CorruptChunk, match="is missing"):
        fresh.materialize(hurt.blobs["ram"], tmp_path / "hurt")
    assert materialized(fresh, kept.blobs["ram"], tmp_path) == rand(2 * CS, seed=5)
    fresh.delete(hurt.id)
    fresh.gc()
    assert pack.exists()


def test_a_manifest_is_parsed_once_until_its_file_changes(store: Store,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A Store keeps the manifests it read or wrote (a committer reads each point's parent,
    most often the point it has just written): parsed again only if the file is another."""
    point = store.commit("m", {"ram": put(store, rand(CS))})
    parses = []
    parse = CheckpointManifest.from_json
    monkeypatch.setattr(CheckpointManifest, "from_json", lambda data: parses.append(1) or parse(data))
    assert store.get(point.id) == point and parses == []  # written by this Store
    other = open_store(store.root)
    assert other.get(point.id) == other.get(point.id) == point and len(parses) == 1
    path = store.root / "checkpoints" / f"{point.id}.json"
    copy = path.with_name("copy")
    shutil.copyfile(path, copy)
    os.replace(copy, path)  # the same manifest in another file
    assert other.get(point.id) == point and len(parses) == 2


def test_a_damaged_manifest_is_reported_and_stops_gc(store: Store) -> None:
    good = store.commit("m", {"ram": put(store, rand(CS))})
    bad = store.commit("m", {})
    (store.root / "checkpoints" / f"{bad.id}.json").write_text("{not json")
    assert store.list() == [good]
    assert "is damaged" in store.check().problems[0]
    with pytest.raises(StoreError, match="gc stopped, nothing removed"):
        store.gc()


_CHILD = textwrap.dedent("""
    import os, signal, sys
    from rewind.store import Store, open_store
    store, where, src = open_store(sys.argv[1]), sys.argv[2], sys.argv[3]
    die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    if where == "put_blob":
        store.put_blob(src, progress=lambda done, total: done >= total // 2 and die())
    else:  # die at the rename that would make the manifest visible
        blob = store.put_blob(src)
        rename = os.rename
        os.rename = lambda a, b: die() if os.path.dirname(b).endswith("/checkpoints") else rename(a, b)
        store.commit("victim", {"ram": blob}, name="never")
""")


@pytest.mark.parametrize("where", ["put_blob", "commit"])
def test_a_checkpoint_killed_midway_is_never_visible(store: Store, tmp_path: Path, where: str) -> None:
    kept = store.commit("m", {"ram": put(store, rand(8 * CS, seed=1))})
    (tmp_path / "src").write_bytes(rand(64 * CS, seed=2))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(store.root), where, str(tmp_path / "src")],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, child.stderr
    assert store.list() == [kept]
    assert store.check(read_data=True).ok
    store.gc()  # removes what the dead writer left: its chunks, its temp files, its lock note
    assert chunk_files(store) == kept.hashes() and not os.listdir(store.root / "tmp")
    assert not list((store.root / "locks").glob("*.json"))
    assert store.commit("m", {}, name="never").name == "never"


def test_out_of_space_leaves_nothing_visible(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = put(store, rand(4 * CS))

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StoreError, match="cannot store a blob: out of space"):
        put(store, rand(4 * CS, seed=3))
    with pytest.raises(StoreError, match="cannot commit a checkpoint: out of space"):
        store.commit("m", {"ram": blob})
    monkeypatch.undo()
    assert store.list() == [] and os.listdir(store.root / "tmp") == []


def test_a_held_lock_makes_others_wait_then_fail_clearly(store: Store) -> None:
    impatient = open_store(store.root, lock_timeout=0.2)
    with store.lock(operation="long-job"):
        put(impatient, rand(CS))  # shared with shared: fine
        with pytest.raises(StoreBusy, match=r"busy: long-job \(pid \d+ .*shared.*waited 0.2 s for gc"):
            impatient.gc()
    with store.lock(exclusive=True, operation="gc"), pytest.raises(StoreBusy, match="exclusively"):
        put(impatient, rand(CS))
    impatient.gc()


# -- export and import --------------------------------------------------------------------------

@pytest.fixture
def exported(store: Store, tmp_path: Path) -> tuple[Path, list[CheckpointManifest], list[bytes]]:
    datas = [rand(5 * CS, seed=i) + bytes(3 * CS) + rand(100, seed=i) for i in range(3)]
    points = chain(store, datas)
    export_checkpoint(store, points[-1].id, tmp_path / "cp.rewind")
    return tmp_path / "cp.rewind", points, datas


def test_export_and_import_round_trip(exported: tuple[Path, list[CheckpointManifest], list[bytes]],
                                      tmp_path: Path) -> None:
    path, points, datas = exported
    target = open_store(tmp_path / "target", create=True)  # another chunk size: blobs keep their own
    imported = import_checkpoint(target, path)
    assert target.list() == [imported]
    assert all(point.meta.pop("imported") is True for point in (imported, *imported.history))
    assert imported == points[-1]  # the same in all else
    assert materialized(target, imported.blobs["ram"], tmp_path) == datas[-1]
    assert materialized(target, target.get("~2", relative_to=imported).blobs["ram"], tmp_path) == datas[0]
    assert target.check(read_data=True).ok
    before = store_state(target)
    with pytest.raises(CheckpointExists, match="already in this store"):
        import_checkpoint(target, path)
    assert store_state(target) == before


def test_an_export_is_its_owners_alone_and_a_relative_store_path_is_made_absolute(
        exported: tuple[Path, list[CheckpointManifest], list[bytes]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, _, _ = exported
    assert path.stat().st_mode & 0o777 == 0o600  # it holds a guest's memory
    monkeypatch.chdir(tmp_path)
    assert open_store("store").root == tmp_path / "store"


@pytest.mark.parametrize("damage", ["cut-at-1/2", "cut-last-byte", "cut-after-magic", "flip-in-header",
                                    "flip-in-manifest", "flip-in-chunk", "flip-in-checksum", "extra-byte",
                                    "not-an-export"])
def test_a_damaged_export_is_refused_and_adds_nothing(
        exported: tuple[Path, list[CheckpointManifest], list[bytes]], tmp_path: Path, damage: str) -> None:
    path, points, _ = exported
    data = bytearray(path.read_bytes())
    kind, _, where = damage.partition("-in-")
    positions = {"header": 10, "manifest": 200, "chunk": len(data) - 1000, "checksum": len(data) - 5}
    if kind == "flip":
        data[positions[where]] ^= 0x01
    elif damage == "cut-at-1/2":
        data = data[:len(data) // 2]
    elif damage == "cut-last-byte":
        data = data[:-1]
    elif damage == "cut-after-magic":
        data = data[:8]
    elif damage == "extra-byte":
        data += b"\0"
    else:
        data = bytearray(b"PK\x03\x04 a zip file")
    path.write_bytes(data)
    target = open_store(tmp_path / "target", create=True)
    target.commit("m", {"ram": put(target, rand(CS, seed=42))})
    before = store_state(target)
    with pytest.raises(BadExport, match=re.escape(str(path))):
        import_checkpoint(target, path)
    assert store_state(target) == before


# scripts/fuzz-export sets this: every offset of the export, not a sample of them.
FUZZ_ALL = os.environ.get("REWIND_FUZZ_EXPORT") == "all"


def test_a_bit_flipped_or_a_cut_at_any_offset_is_refused(
        exported: tuple[Path, list[CheckpointManifest], list[bytes]], tmp_path: Path) -> None:
    """An export with one bit flipped at an offset, or cut short there, is refused with a
    clear error and adds nothing: 48 offsets here, every one with scripts/fuzz-export."""
    path, _, _ = exported
    original = path.read_bytes()
    offsets = range(len(original)) if FUZZ_ALL else sorted(random.Random(11).sample(range(len(original)), 48))
    target = open_store(tmp_path / "target", create=True)
    target.commit("m", {"ram": put(target, rand(CS, seed=42))})
    before = store_state(target)
    tried = 0
    for at in offsets:
        flipped = bytearray(original)
        flipped[at] ^= 1 << (at % 8)
        for damaged in (bytes(flipped), original[:at]):
            path.write_bytes(damaged)
            with pytest.raises(BadExport, match=re.escape(str(path))):
                import_checkpoint(target, path)
            tried += 1
    assert store_state(target) == before
    print(f"{tried} damaged exports of {len(original)} bytes refused, the store unchanged")


def forge(path: Path, change: Callable[[dict], None]) -> None:
    """Change an export's manifest as a forger would, with the file's checksum made right."""
    data = path.read_bytes()
    size = int.from_bytes(data[8:12], "big")
    manifest = json.loads(data[12:12 + size])
    change(manifest)
    body = json.dumps(manifest).encode()
    content = data[:8] + len(body).to_bytes(4, "big") + body + data[12 + size:-32]
    path.write_bytes(content + blake3.blake3(content).digest())


def one_byte_chunks(manifest: dict) -> None:
    manifest["blobs"]["ram"] = {"size": 1 << 22, "chunk_size": 1, "chunks": [1 << 22]}


def huge_history(manifest: dict) -> None:
    entry = {**manifest, "history": None, "blobs": {"ram": {"size": 1 << 40, "chunk_size": 1 << 16,
                                                            "chunks": [1 << 24]}}}
    manifest["history"] = [{k: v for k, v in entry.items() if k != "history"}] * 50


@pytest.mark.parametrize("change", [one_byte_chunks, huge_history], ids=["1-byte-chunks", "huge-history"])
def test_a_forged_manifest_is_refused_before_it_takes_memory(
        exported: tuple[Path, list[CheckpointManifest], list[bytes]], tmp_path: Path,
        change: Callable[[dict], None]) -> None:
    """A manifest of a few KB that claims many chunks is refused while parsing, with little memory."""
    path, _, _ = exported
    forge(path, change)
    target = open_store(tmp_path / "target", create=True)
    tracemalloc.start()
    try:
        with pytest.raises(BadExport, match="does not parse"):
            import_checkpoint(target, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and target.list() == []


# -- prune and gc ---------------------------------------------------------------------------------

def test_prune_by_keep_last(store: Store) -> None:
    a = [store.commit("a", {}) for _ in range(4)]
    b = [store.commit("b", {}) for _ in range(2)]
    assert store.prune(keep_last=2) == [a[1].id, a[0].id]
    assert store.list() == [a[2], a[3], *b]
    assert store.prune(keep_last=1, per_machine=False) == [b[0].id, a[3].id, a[2].id]
    assert store.list() == [b[1]]
    with pytest.raises(InvalidArgument, match="keep_last or keep_days"):
        store.prune()


def test_prune_by_keep_days(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 10 * 86400)
    old = [store.commit("m", {}) for _ in range(2)]
    monkeypatch.setattr(time, "time", lambda: now - 2 * 86400)
    recent = store.commit("m", {})
    monkeypatch.undo()
    assert sorted(store.prune(keep_days=5)) == sorted(m.id for m in old)
    assert store.list() == [recent]
    assert store.prune(keep_days=1, keep_last=1) == []  # a checkpoint kept by any policy stays


def test_gc_frees_what_nothing_uses_and_keeps_what_history_uses(store: Store, tmp_path: Path) -> None:
    shared = rand(4 * CS, seed=1)
    base = store.commit("m", {"ram": put(store, shared)})
    child = store.commit("m", {"ram": put(store, shared + rand(2 * CS, seed=2))}, parent=base)
    leaf = store.commit("other", {"ram": put(store, shared + rand(3 * CS, seed=3))})
    leaf_only = leaf.hashes() - child.hashes()
    [leaf_pack] = [p for p in packs(store) if {h for h, _, _ in read_index(p)} == leaf_only]
    leaf_bytes = leaf_pack.stat().st_size
    (store.root / "tmp" / "left-by-a-crash.tmp").write_bytes(b"x" * 100)
    store.delete(leaf.id)
    store.delete(base.id)  # still in child's history
    report = store.gc()
    assert report.chunks_removed == 3 and report.tmp_removed == 1
    assert len(leaf_only) == 3 and report.bytes_freed == leaf_bytes + 100
    assert chunk_files(store) == child.all_hashes()
    assert materialized(store, store.get("~1", relative_to=child).blobs["ram"], tmp_path) == shared
    store.delete(child.id)
    assert store.gc().chunks_removed == 6 and chunk_files(store) == set() and packs(store) == []


def test_gc_writes_a_mostly_unused_pack_again_with_what_is_used(store: Store, tmp_path: Path) -> None:
    """A pack more than half unused is written again with its used chunks alone (the new one
    durable before the old one goes); one mostly used is kept whole."""
    data = rand(4 * CS, seed=4)
    whole = store.commit("m", {"ram": put(store, data)})
    part = store.commit("m", {"ram": put(store, data[:CS])})  # its one chunk is in whole's pack
    [first] = packs(store)
    first_size = first.stat().st_size
    store.delete(whole.id)
    report = store.gc()
    assert (report.chunks_removed, report.packs_rewritten) == (3, 1)
    [kept] = packs(store)
    assert not first.exists() and report.bytes_freed == first_size - kept.stat().st_size
    assert chunk_files(store) == part.hashes()
    assert materialized(store, part.blobs["ram"], tmp_path) == data[:CS]
    again = store.commit("m", {"ram": put(store, data[:2 * CS])})
    store.gc()  # one chunk of two unused: kept whole
    assert store.delete(part.id) and store.gc().chunks_removed == 0 and kept.exists()
    assert materialized(store, again.blobs["ram"], tmp_path) == data[:2 * CS]


# -- opening -------------------------------------------------------------------------------------

def test_open_refuses_missing_and_damaged_stores(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="there is no checkpoint store at"):
        open_store(tmp_path / "nothing")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="holds other files"):
        open_store(tmp_path / "busy", create=True)
    with pytest.raises(InvalidArgument, match="chunk size"):
        open_store(tmp_path / "odd", create=True, chunk_size=1000)
    store = open_store(tmp_path / "s", create=True, chunk_size=8192)
    assert open_store(tmp_path / "s", create=True).chunk_size == 8192  # set once, at creation
    (store.root / "config.json").write_text("{")
    with pytest.raises(StoreError, match="is damaged: config.json is unreadable"):
        open_store(store.root)
    (store.root / "config.json").write_text('{"format": 1, "chunk_size": 8192}')
    (store.root / "chunks").rename(store.root / "lost")
    with pytest.raises(StoreError, match="is damaged: chunks missing"):
        open_store(store.root)



def test_a_durable_materialize_syncs_before_the_name_appears(store: Store, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches on disk trust a file because it exists: its data must be on disk before its name."""
    blob = store.put_blob(BytesIO(os.urandom(3 * CS)))
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    def rename(a: str, b: str) -> None:
        if Path(b).parent == tmp_path:  # not the store's own lock notes
            events.append(f"rename {Path(b).name}")
        real_rename(a, b)
    monkeypatch.setattr(os, "rename", rename)
    store.materialize(blob, tmp_path / "plain")
    assert events == ["rename plain"]
    events.clear()
    store.materialize(blob, tmp_path / "cached", durable=True)
    assert events == ["fsync", "rename cached"]


def test_gc_on_the_command_line_says_what_it_wrote_again(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", create=True, chunk_size=CS)
    data = rand(4 * CS, seed=11)
    whole = store.commit("m", {"ram": put(store, data)})
    store.commit("m", {"ram": put(store, data[:CS])})
    store.delete(whole.id)
    done = rewind_cli("gc", "--store", str(store.root))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith("removed 3 chunk(s), 1 pack(s) written again without them, freed ")


def test_new_chunks_are_durable_before_they_are_named(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack in packs/ is trusted whole: put_blob fsyncs each new pack before renaming it into
    place, and the folder before it returns (so before any manifest names its chunks)."""
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}"),
                                                 real_fsync(fd))[1])
    def rename(a: str, b: str) -> None:
        if "packs" in Path(b).parts:  # not the store's own lock notes
            events.append(f"rename {b}")
        real_rename(a, b)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(packs_module, "PACK_SIZE", CS)  # a pack a chunk
    store.put_blob(BytesIO(os.urandom(2 * CS)))
    assert [e.split()[0] for e in events] == ["fsync", "fsync", "rename", "rename", "fsync"]
    assert all(e.endswith(".pack.tmp") for e in events[:2]) and events[4] == f"fsync {store.root / 'packs'}"
    assert {e.split()[1] for e in events[2:4]} == {str(p) for p in packs(store)}
    events.clear()
    store.put_blob(BytesIO(bytes(2 * CS)))  # nothing new: nothing to write
    assert events == []


def test_only_the_owner_reads_the_store(store: Store) -> None:
    """Chunks and manifests hold guest memory: no group or other bits (nor on the store)."""
    blob = store.put_blob(BytesIO(os.urandom(2 * CS)))
    manifest = store.commit("m", {"ram": blob})
    files = [store.root / "checkpoints" / f"{manifest.id}.json", *packs(store)]
    assert len(files) == 2
    assert all(p.stat().st_mode & 0o077 == 0 for p in [*files, store.root]), \
        [(p, oct(p.stat().st_mode)) for p in files]


FROZEN = Path(__file__).parent / "data" / "store-v1"  # made once by rewind at format 1; never rewritten


def test_a_frozen_format_1_store_still_reads(tmp_path: Path) -> None:
    """A store written at format 1 (docs/format.md) opens, checks clean, resolves its references
    and gives back every blob byte for byte: a change to the format cannot slip by unnoticed.
    Its checkpoints: "first" (a 448 KiB memory blob whose last 128 KiB are zeros, and a device
    state) and "second" (its child: the same memory but for its second 64 KiB chunk)."""
    root = tmp_path / "store"
    shutil.copytree(FROZEN, root)
    for folder in ("tmp", "locks"):  # git keeps no empty folders
        (root / folder).mkdir(exist_ok=True)
    store = open_store(root)
    assert json.loads((root / "config.json").read_text())["format"] == 2 and (root / "packs").is_dir()
    report = store.check(read_data=True)
    assert report.ok and (report.checkpoints, report.chunks) == (2, 7), report
    second = store.get("second")
    first_id = "59ff565fdec188a664fe087e27117d6e"
    assert store.get("second~1").id == store.get("first").id == second.parent == first_id
    assert (second.machine, second.labels, second.meta["ram_base"]) == ("frozen", {"step": "2"}, first_id)
    assert [e.name for e in second.history] == ["first"]
    expected = {("first", "ram"): "cf87d728de9c117017ce9dce95afac1c44a112b35728a908983b627309024cc9",
                ("second", "ram"): "79ea5e325c6dc3946c6eabd8644aae13a7087d78d1e0efa982e30819df9a1601",
                ("first", "devstate"): "5b681dbc303c2b187375eee64ff4e40ffa42325d4cb755ef43625e12fc330b06",
                ("second", "devstate"): "5b681dbc303c2b187375eee64ff4e40ffa42325d4cb755ef43625e12fc330b06"}
    for (ref, blob), digest in expected.items():
        out = tmp_path / f"{ref}.{blob}"
        store.materialize(store.get(ref).blobs[blob], out)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == digest, (ref, blob)
    assert store.get("first").blobs["ram"].chunks[-2:] == [None, None]  # zero chunks are not stored
    more = store.commit("frozen", {"ram": store.put_blob(BytesIO(os.urandom(4 << 12)), chunk_size=4096)},
                        parent=second)  # upgraded: new chunks go into a pack beside the loose ones
    assert len(packs(store)) == 1 and store.check(read_data=True).ok and store.get("~1", relative_to=more)


def test_a_capture_committed_twice_is_committed_once(tmp_path: Path) -> None:
    """A committer killed after writing the manifest, before removing its journal, is run again
    by the next reader: that second commit must find the point stored, not fail (which left
    the journal in place and every store command failing with it)."""
    store = open_store(tmp_path / "store", create=True)
    caches = Caches.of(tmp_path / "home", tmp_path / "runtime")
    (tmp_path / "ram").write_bytes(os.urandom(128 << 10))
    (tmp_path / "devstate").write_bytes(b"devices")
    state = SavedState(ram=tmp_path / "ram", devstate=tmp_path / "devstate", disks=[], board="pc-q35-10.0")
    point_id = "0123456789abcdef0123456789abcdef"
    first = commit_capture(store, caches, point_id, state, machine="m", parent=None, name="p", labels=None,
                           meta={})
    again = commit_capture(store, caches, point_id, state, machine="m", parent=None, name="p", labels=None,
                           meta={})
    assert again.id == first.id == point_id and [m.id for m in store.list()] == [point_id]
    assert len(packs(store)) == 1  # memory and device state in one pack


def test_history_is_shortened_to_what_a_reader_accepts(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big machine's 32 points back would pass the chunks a manifest may hold; the writer keeps
    the newest that fit instead of writing a manifest every reader refuses as damaged."""
    monkeypatch.setattr(store_module.model, "MAX_MANIFEST_CHUNKS", 10)
    parent = None
    for i in range(4):
        blob = store.put_blob(BytesIO(os.urandom(4 * CS)))  # 4 chunks each
        parent = store.commit("big", {"ram": blob}, parent=parent, name=f"p{i}")
    assert [e.name for e in store.get("p3").history] == ["p2"]  # 4 + 4 fit in 10, 4 + 8 do not
    with pytest.raises(InvalidArgument, match="more than a manifest holds"):
        store.commit("big", {"ram": store.put_blob(BytesIO(os.urandom(11 * CS)))})
