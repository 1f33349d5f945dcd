"""An encrypted store in a bucket (docs/format.md §2.10, §2.11), through a real S3 server:
`rclone serve s3` over a temporary folder on 127.0.0.1, whose files are every object the
bucket holds. Two homes on this machine stand for two hosts."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from io import BytesIO
from pathlib import Path

import pytest
from conftest import cleanup_home, rewind_cli
from test_s3_store import _point_at, _until, server  # noqa: F401 (the module's server fixture)

from rewind import Home, Sandbox
from rewind.bench.s3 import RcloneS3
from rewind.errors import InvalidArgument
from rewind.signers import signing_key, trust
from rewind.store import CorruptChunk, StoreError, WrongPassword, open_store
from rewind.store.cache import UPLOAD_ENV, CachedStore, PushReport, cache_root
from rewind.store.locks import held_file

CS = 4096
PASSWORD = "correct horse"
MARKER = b"BUCKET-MARKER-5e81d2"


@pytest.fixture(autouse=True)
def _env(no_passwords: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UPLOAD_ENV, raising=False)


@pytest.fixture
def bucket(server: RcloneS3 | None, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:  # noqa: F811
    """A new store's URL, and the folder whose files are its objects."""
    if server is None:
        pytest.skip("reads the server's files: rclone only")
    prefix = f"e-{secrets.token_hex(4)}"
    return f"s3://{_point_at(monkeypatch, server)}/{prefix}", server.folder / server.bucket / prefix


def _secret_blob(n: int = 8) -> bytes:
    return b"".join((MARKER + bytes([i]) * 40) * (CS // (len(MARKER) + 40)) + bytes(CS % (len(MARKER) + 40))
                    for i in range(n))


def _objects(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _open(url: str, home: Path, password: str = PASSWORD, create: bool = False) -> CachedStore:
    store = open_store(url, create=create, encrypt=create, password=password, home=home, chunk_size=CS)
    assert isinstance(store, CachedStore)
    return store


def test_an_encrypted_bucket_keeps_nothing_in_the_clear(bucket: tuple[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    url, folder = bucket
    monkeypatch.setenv(UPLOAD_ENV, "sync")
    a = _open(url, tmp_path / "a", create=True)
    assert a.encrypted
    data = _secret_blob()
    with a.lock():
        point = a.commit("web", {"ram": a.put_blob(BytesIO(data))}, name="before-deploy",
                         labels={"who": "MARKERLABEL"}, meta={"context": MARKER.decode()})
    assert not a.queued()
    objects = _objects(folder)
    assert {k.split("/")[0] for k in objects} >= {"config.json", "keys", "chunks", "checkpoints", "names"}
    for key, content in objects.items():
        for secret in (MARKER, b"before-deploy", b"MARKERLABEL", b'"web"'):
            assert secret not in content and secret not in key.encode(), (key, secret)
    assert json.loads(objects["config.json"])["format"] == 3
    # A second home with the password reads the point; one with a wrong password writes nothing.
    with pytest.raises(WrongPassword, match="wrong password"):
        _open(url, tmp_path / "b", password="wrong")
    assert not cache_root(url, tmp_path / "b").exists()
    b = _open(url, tmp_path / "b")
    got = b.get("before-deploy")
    assert got.id == point.id and got.labels == {"who": "MARKERLABEL"}
    b.materialize(got.blobs["ram"], tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    assert b.check(read_data=True).ok
    # The detached uploader gets the keys, not the password: here there is none in the environment.
    monkeypatch.delenv(UPLOAD_ENV)
    with b.lock():
        later = b.commit("web", {"ram": b.put_blob(BytesIO(data[::-1]))}, name="later")
    _until(lambda: not b.queued(), 60, "the detached uploader")
    assert a.get("later").id == later.id
    # A flipped byte in a bucket object is refused on read.
    key = next(k for k in objects if k.startswith("chunks/"))
    raw = bytearray((folder / key).read_bytes())
    raw[len(raw) // 2] ^= 1
    (folder / key).write_bytes(bytes(raw))
    c = _open(url, tmp_path / "c")
    with pytest.raises(CorruptChunk, match="authentication"):
        c.materialize(c.get(point.id).blobs["ram"], tmp_path / "out2")
    assert not c.check(read_data=True).ok
    manifest = next(k for k in objects if k.startswith("checkpoints/"))
    raw = bytearray((folder / manifest).read_bytes())
    raw[-1] ^= 1
    (folder / manifest).write_bytes(bytes(raw))
    with pytest.raises(StoreError):
        _open(url, tmp_path / "d").get(point.id)


def test_keys_of_an_encrypted_bucket(bucket: tuple[str, Path], tmp_path: Path) -> None:
    url, folder = bucket
    a = _open(url, tmp_path / "a", create=True)
    first = a.key_id
    added = a.add_key("second password")
    assert {s.id for s in a.key_slots()} == {first, added}
    assert sorted(os.listdir(folder / "keys")) == sorted([first, added])
    # Another home that never saw the new key opens with its password: it finds it in the bucket.
    b = _open(url, tmp_path / "b")
    assert b.key_id == first
    c = _open(url, tmp_path / "c", password="second password")
    assert c.key_id == added
    b.remove_key(first)
    with pytest.raises(InvalidArgument, match="last"):
        c.remove_key(added)
    assert os.listdir(folder / "keys") == [added]
    new = c.change_password("third password")
    assert os.listdir(folder / "keys") == [new]
    # A home that never had the store's cache can only open it with the new password.
    with pytest.raises(WrongPassword):
        _open(url, tmp_path / "d", password="second password")
    assert _open(url, tmp_path / "d", password="third password").key_id == new


def test_the_cli_makes_an_encrypted_bucket_and_manages_its_keys(bucket: tuple[str, Path],
                                                                tmp_path: Path) -> None:
    url, folder = bucket
    env = {"REWIND_HOME": str(tmp_path / "h"), "REWIND_STORE": url, "REWIND_PASSWORD": PASSWORD}
    made = rewind_cli("store", "init", "--encrypt", env=env)
    assert made.returncode == 0 and b"encrypted" in made.stdout, made.stderr
    assert json.loads((folder / "config.json").read_bytes())["format"] == 3
    added = rewind_cli("store", "key", "add", env={**env, "REWIND_NEW_PASSWORD": "other"})
    assert added.returncode == 0, added.stderr
    listed = rewind_cli("store", "key", "list", "--json", env={**env, "REWIND_HOME": str(tmp_path / "h2")})
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 2, listed.stderr
    wrong = rewind_cli("store", "check", env={**env, "REWIND_HOME": str(tmp_path / "h3"),
                                              "REWIND_PASSWORD": "nope"})
    assert wrong.returncode != 0 and b"wrong password" in wrong.stderr and b"Traceback" not in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    assert not cache_root(url, tmp_path / "h3").exists()


def test_push_counts_what_an_upload_already_running_sent(bucket: tuple[str, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = bucket
    monkeypatch.setenv(UPLOAD_ENV, "off")
    a = _open(url, tmp_path / "a", create=True)
    with a.lock():
        point = a.commit("web", {"ram": a.put_blob(BytesIO(_secret_blob(4)))}).id
    reports: list[PushReport] = []
    with held_file(a.root / "outbox.lock", 5):  # an upload running, as the detached one would
        waiting = threading.Thread(target=lambda: reports.append(a.push()))
        waiting.start()
        time.sleep(0.5)
        a._push(PushReport())
    waiting.join()
    [report] = reports
    assert report.points == [point] and report.meanwhile == 1 and report.chunks == 4 and report.bytes > 0
    assert not a.queued()
    a.wait_uploaded(point)  # already there: returns at once


@pytest.mark.slow  # over 30 s here: its first upload sends the image's disk layers
def test_a_machine_checkpointed_into_an_encrypted_bucket(home: Home, bucket: tuple[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither a file's content nor a process's memory is in any object of the bucket; the
    point taken with wait=True is in the bucket when it returns, and a second home with the
    password at once makes a machine from it and reads both back."""
    url, folder = bucket
    disk_marker, memory_marker = "DISKMARK-b61f0c2e7a", "MEMMARK-0d4e9b71c3"
    open_store(url, create=True, encrypt=True, password=PASSWORD, home=home.root)
    monkeypatch.setenv("REWIND_STORE", url)
    monkeypatch.setenv("REWIND_PASSWORD", PASSWORD)
    sbx = Sandbox.create("secret")
    sbx.exec(f"printf '{disk_marker}%.0s' $(seq 1000) > /root/marker.txt && sync", check=True)
    sbx.exec(f"""nohup python3 -c "import time; s='{memory_marker}'*1000; time.sleep(600)" """
             ">/dev/null 2>&1 &", check=True)
    point = sbx.checkpoint(name="with-secrets", wait=True)
    assert point.uploaded is True
    other = Home(root=tmp_path / "other-home", images=home.images)
    trust(other, signing_key(home).public)  # the point is signed by this home
    try:
        copy = Sandbox.create("copy", from_checkpoint="with-secrets", home=other)
        assert copy.files.read("/root/marker.txt").decode() == disk_marker * 1000
        running = copy.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        assert memory_marker in running  # the process that held it runs on in the new machine
    finally:
        cleanup_home(other)
    objects = _objects(folder)
    assert any(k.startswith("chunks/") for k in objects)
    for key, content in objects.items():
        assert disk_marker.encode() not in content and memory_marker.encode() not in content, key
    # The CLI says where a point is: --wait=local returns once stored here; log and doctor say
    # what is not uploaded yet; push waits for the upload running and says what it sent.
    env = {"REWIND_HOME": str(home.root)}
    local = rewind_cli("checkpoint", "secret", "--wait=local", env=env)
    assert local.returncode == 0, local.stderr
    assert b"stored on this host (uploading)" in local.stdout or b"uploaded" in local.stdout
    pushed = rewind_cli("store", "push", env=env)
    said = pushed.stdout + pushed.stderr
    assert pushed.returncode == 0 and (b"uploaded 1 checkpoint(s)" in said or b"nothing left" in said), said
    logged = rewind_cli("log", "secret", env=env)
    assert b"UPLOADED" in logged.stdout and b"not yet" not in logged.stdout, logged.stdout
    doctor = rewind_cli("doctor", env=env)
    assert b"0 checkpoint(s) stored on this host, not uploaded yet" in doctor.stdout, doctor.stdout


def test_the_http_api_takes_wait_local() -> None:
    from rewind.serve.api import CheckpointBody

    assert CheckpointBody(wait="local").wait == "local" and CheckpointBody(wait=True).wait is True
    with pytest.raises(ValueError, match="wait"):
        CheckpointBody(wait="later")


def test_gc_and_names_in_an_encrypted_bucket(bucket: tuple[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url, folder = bucket
    monkeypatch.setenv(UPLOAD_ENV, "sync")
    a = _open(url, tmp_path / "a", create=True)
    with a.lock():
        gone = a.commit("web", {"ram": a.put_blob(BytesIO(os.urandom(3 * CS)))}, name="gone")
        kept = a.commit("web", {"ram": a.put_blob(BytesIO(_secret_blob(2)))}, name="kept")
    assert sorted(os.listdir(folder / "names")) == sorted([a._name_key("gone")[6:], a._name_key("kept")[6:]])
    a.delete("gone")
    report = a.gc()
    assert report.chunks_removed >= 3
    assert os.listdir(folder / "names") == [a._name_key("kept")[6:]]
    assert _open(url, tmp_path / "c").get("kept").id == kept.id and a.check(read_data=True).ok
    assert gone.id not in {m.id for m in _open(url, tmp_path / "d").list()}


def test_a_making_that_died_leaves_no_key_that_counts(bucket: tuple[str, Path], tmp_path: Path) -> None:
    """A key file left in the bucket by a making that died before its config opens other
    keys: the next making removes it, and it never opens the store."""
    url, folder = bucket
    from rewind.store import crypto

    dead = crypto.new_slot(crypto.Keys.new(), PASSWORD)
    (folder / "keys").mkdir(parents=True)
    (folder / "keys" / dead.id).write_text(json.dumps(dead.to_json()))
    a = _open(url, tmp_path / "a", create=True)
    assert a.key_id != dead.id and os.listdir(folder / "keys") == [a.key_id]
    # Put back (a writer of the bucket), it is still not taken for the store's key.
    (folder / "keys" / dead.id).write_text(json.dumps(dead.to_json()))
    b = _open(url, tmp_path / "b")
    assert b.key_id == a.key_id
