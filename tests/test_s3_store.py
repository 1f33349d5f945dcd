"""A store in an S3 bucket, through a real S3 server: `rclone serve s3` over a temporary
folder on 127.0.0.1 (rclone comes with the test extras, beside this Python).

Set REWIND_TEST_S3_ENDPOINT (and REWIND_TEST_S3_BUCKET, an existing bucket; credentials
from the usual AWS variables) to run the same tests against another server; the tests that
stop the server mid-upload then skip. Two homes on this machine stand for two hosts.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import rewind_cli

from rewind import Home, Sandbox
from rewind.bench.s3 import RcloneS3
from rewind.signers import signing_key, trust
from rewind.store import Store, open_store
from rewind.store.cache import UPLOAD_ENV, CachedStore
from rewind.store.errors import RemoteUnavailable, StoreBusy
from rewind.store.remote import TTL, LockNote, lock_notes, remote_lock

CHUNK = 256 * 1024


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RcloneS3 | None]:
    """rclone on 127.0.0.1, or None when REWIND_TEST_S3_ENDPOINT names another server."""
    if os.environ.get("REWIND_TEST_S3_ENDPOINT"):
        yield None
        return
    server = RcloneS3.make(tmp_path_factory.mktemp("rclone"))
    yield server
    server.stop()


def _point_at(monkeypatch: pytest.MonkeyPatch, server: RcloneS3 | None) -> str:
    """Point boto3 at the server under test; the bucket to use."""
    if server is None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", os.environ["REWIND_TEST_S3_ENDPOINT"])
        return os.environ.get("REWIND_TEST_S3_BUCKET", "rewind-test")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return server.bucket


@pytest.fixture
def url(server: RcloneS3 | None, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new store's URL in the server's bucket (its own prefix)."""
    monkeypatch.delenv(UPLOAD_ENV, raising=False)
    return f"s3://{_point_at(monkeypatch, server)}/t-{secrets.token_hex(4)}"


def _open(url: str, home: Path, create: bool = False) -> CachedStore:
    store = open_store(url, create=create, home=home)
    assert isinstance(store, CachedStore)
    return store


def _blob(pool: list[bytes], picks: list[int]) -> bytes:
    return b"".join(pool[i] for i in picks)


def _commit(store: Store, data: bytes, name: str | None = None) -> str:
    with store.lock():
        return store.commit("web", {"x": store.put_blob(_Bytes(data))}, name=name).id


class _Bytes:
    """A file object over bytes (put_blob reads it as a stream)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        out = self.data[self.pos:] if n < 0 else self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def tell(self) -> int:
        return self.pos


def _content(store: Store, ref: str, out: Path) -> bytes:
    store.materialize(store.get(ref).blobs["x"], out)
    return out.read_bytes()


def test_a_point_committed_in_one_home_is_read_in_another(url: str, tmp_path: Path) -> None:
    a = _open(url, tmp_path / "a", create=True)
    data = os.urandom(3 * CHUNK + 100) + bytes(2 * CHUNK)
    point = _commit(a, data, name="shared")
    assert a.get("shared").id == point  # usable here at once, before it is uploaded
    _until(lambda: not a.queued(), 30, "the detached uploader")  # the default: in the background
    b = _open(url, tmp_path / "b")
    assert _content(b, "shared", tmp_path / "out") == data
    assert b.check(read_data=True).ok
    # The same bytes committed in the second home upload no chunk: the bucket dedups across homes.
    os.environ[UPLOAD_ENV] = "off"
    try:
        _commit(b, data, name="again")
    finally:
        del os.environ[UPLOAD_ENV]
    report = b.push()
    assert len(report.points) == 1 and report.chunks == 0 and report.bytes == 0
    assert {m.name for m in _open(url, tmp_path / "c").list()} == {"shared", "again"}
    uploads = [json.loads(line) for line in (a.root / "uploads.jsonl").read_text().splitlines()]
    assert [u["id"] for u in uploads] == [point] and uploads[0]["chunks"] == 4


def test_the_cli_checks_the_bucket_and_the_doctor_says_it_answers(url: str, tmp_path: Path) -> None:
    env = {"REWIND_HOME": str(tmp_path / "h"), "REWIND_STORE": url}
    made = rewind_cli("store", "check", env=env)
    assert made.returncode == 0 and b"ok: 0 checkpoint(s)" in made.stdout, made.stderr
    doctor = rewind_cli("doctor", "--json", env=env)
    status = json.loads(doctor.stdout)["store_status"]
    assert status["answers"] and status["url"] == url
    dead = rewind_cli("store", "check", env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
    assert dead.returncode != 0 and b"does not answer" in dead.stderr and b"Traceback" not in dead.stderr


def test_commits_in_one_home_and_gc_in_another_lose_nothing(url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Home A commits, uploads, deletes and collects garbage in a loop while home B commits
    points that share chunks with A's deleted ones: none of B's points may lose a chunk."""
    monkeypatch.setenv(UPLOAD_ENV, "sync")
    pool = [os.urandom(CHUNK) for _ in range(6)]
    a, b = _open(url, tmp_path / "a", create=True), _open(url, tmp_path / "b", create=True)
    wanted: dict[str, bytes] = {}
    errors: list[BaseException] = []
    collected = []

    def home_a() -> None:
        try:
            for i in range(4):
                # A chunk of its own too: gc has something to remove whatever B has committed
                # by then (B's points may already use every chunk of the pool).
                point = _commit(a, _blob(pool, [i % 6, (i + 1) % 6]) + os.urandom(CHUNK))
                a.delete(point)
                collected.append(a.gc())
        except BaseException as e:
            errors.append(e)

    def home_b() -> None:
        try:
            for i in range(6):
                data = _blob(pool, [(i + 1) % 6, (i + 2) % 6]) + os.urandom(100)
                wanted[_commit(b, data)] = data
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=home_a), threading.Thread(target=home_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not b.queued()
    assert sum(r.chunks_removed for r in collected) > 0  # gc did remove A's garbage meanwhile
    c = _open(url, tmp_path / "c")
    assert c.check(read_data=True).ok
    for point, data in wanted.items():
        assert _content(c, point, tmp_path / f"{point}.out") == data


def test_a_server_stopped_mid_upload_leaves_the_point_here_and_the_upload_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("REWIND_TEST_S3_ENDPOINT"):
        pytest.skip("stops the server: rclone only")
    server = RcloneS3.make(tmp_path / "s3", bwlimit="8M")  # 32 MiB take 4 s: time to stop it midway
    try:
        _point_at(monkeypatch, server)
        monkeypatch.setenv(UPLOAD_ENV, "off")
        url = f"s3://{server.bucket}/resume"
        a = _open(url, tmp_path / "a", create=True)
        data = os.urandom(128 * CHUNK)
        point = _commit(a, data, name="big")
        failed: list[BaseException] = []

        def push() -> None:
            try:
                a.push()
            except BaseException as e:
                failed.append(e)

        uploader = threading.Thread(target=push)
        uploader.start()
        _until(lambda: len(server.chunk_files()) >= 2, 30, "the first chunks to arrive")
        server.stop()
        uploader.join()
        assert failed and isinstance(failed[0], RemoteUnavailable), failed
        assert "does not answer" in str(failed[0])
        # rclone 1.74 writes a PUT in place: the one cut short is there, shorter.
        sizes = a._chunk_sizes(a.get("big").all_hashes())
        sent_before = sum(p.stat().st_size == sizes[p.name] for p in server.chunk_files())
        assert 0 < sent_before < 128
        assert a.queued() == [point] and _content(a, "big", tmp_path / "here") == data  # intact here

        server.bwlimit = None
        server.start()
        report = a.push()
        assert report.points == [point] and report.chunks == 128 - sent_before  # only what was missing
        b = _open(url, tmp_path / "b")
        assert b.check(read_data=True).ok
        assert _content(b, "big", tmp_path / "there") == data
    finally:
        server.stop()


def test_a_checkpoint_taken_in_one_home_runs_as_a_new_machine_in_another(
        home: Home, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWIND_STORE", url)
    with Sandbox.create(home=home) as sbx:
        sbx.exec("echo made-in-home-a > /root/mark && sync", check=True)
        taken = time.monotonic()
        # wait=True: it returns once the point is in the bucket, whoever uploaded it.
        point = sbx.checkpoint(name="from-a", wait=True)
    uploaded = time.monotonic() - taken
    assert point.uploaded is True and _open(url, home.root).queued() == []
    other = Home(root=tmp_path / "home-b", images=home.images)
    trust(other, signing_key(home).public)  # the point is signed by home A
    try:
        with Sandbox.create(from_checkpoint="from-a", home=other) as copy:
            assert copy.exec("cat /root/mark", check=True).stdout.strip() == "made-in-home-a"
            assert copy._machine.record.parent == point.id
    finally:
        shutil.rmtree(other.runtime, ignore_errors=True)
    assert uploaded < 120


def test_lock_objects_keep_gc_off_an_upload_and_a_stale_one_is_ignored(url: str, tmp_path: Path) -> None:
    a = _open(url, tmp_path / "a", create=True)
    a.lock_timeout = 1.0
    with remote_lock(a.objects, exclusive=False, operation="upload", timeout=5), \
            pytest.raises(StoreBusy, match="upload .* shared"):
        a.gc()
    # A holder that died leaves its object; once it is older than the TTL it no longer counts.
    dead = LockNote(operation="upload", exclusive=False, host="gone", pid=1, time=time.time() - TTL - 1)
    a.objects.put("locks/0123456789abcdef.json", json.dumps(asdict(dead)).encode())
    a.gc()
    assert not [k for k in lock_notes(a.objects) if k.endswith("0123456789abcdef.json")]  # gc removed it
