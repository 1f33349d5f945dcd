"""Encrypted stores (store/crypto.py, docs/format.md §2.11): keys, sealed objects, keyed chunk
names, encrypted exports. All but the last test run no guest."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import subprocess
import sys
import time
from io import BytesIO
from pathlib import Path

import blake3
import pytest
from conftest import flip_stored_byte, rewind_cli

import rewind.store.crypto as crypto
from rewind.crashpoints import CRASH_ENV, LOG_ENV
from rewind.errors import InvalidArgument
from rewind.home import Home
from rewind.store import (
    BadExport,
    CorruptChunk,
    Store,
    StoreError,
    WrongPassword,
    export_checkpoint,
    import_checkpoint,
    open_store,
)

CS = 4096
PASSWORD = "correct horse"
MARKER = b"SECRET-MARKER-7f3a9c"


pytestmark = pytest.mark.usefixtures("no_passwords")


def make(path: Path, password: str = PASSWORD) -> Store:
    return open_store(path, create=True, encrypt=True, password=password, chunk_size=CS)


def secret_blob(n_chunks: int = 8) -> bytes:
    """Chunks that each hold the marker (and compress), with a zero chunk among them."""
    return b"".join((MARKER + bytes([i]) * 64) * (CS // (len(MARKER) + 64)) + bytes(CS % (len(MARKER) + 64))
                    if i != 3 else bytes(CS) for i in range(n_chunks))


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_an_encrypted_store_keeps_nothing_in_the_clear(tmp_path: Path) -> None:
    store = make(tmp_path / "store")
    data = secret_blob()
    point = store.commit("web", {"ram": store.put_blob(BytesIO(data))}, name="before-deploy",
                         labels={"who": "MARKERLABEL"}, meta={"context": MARKER.decode()})
    config = json.loads((tmp_path / "store" / "config.json").read_text())
    assert config["format"] == 3 and store.encrypted and len(store.key_slots()) == 1
    for name, content in files_of(tmp_path / "store").items():
        for secret in (MARKER, b"before-deploy", b"MARKERLABEL", b'"web"'):
            assert secret not in content, (name, secret)
    again = open_store(tmp_path / "store", password=PASSWORD)
    assert again.get("before-deploy").labels == {"who": "MARKERLABEL"}
    again.materialize(again.get(point.id).blobs["ram"], tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    assert again.get(point.id).blobs["ram"].chunks[3] is None  # zero chunks are still not stored
    assert again.check(read_data=True).ok


def test_plain_stores_stay_as_they_were(tmp_path: Path) -> None:
    store = open_store(tmp_path / "plain", create=True, chunk_size=CS)
    assert json.loads((tmp_path / "plain" / "config.json").read_text()) == {"format": 2, "chunk_size": CS}
    assert not store.encrypted and not (tmp_path / "plain" / "keys").exists()
    blob = store.put_blob(BytesIO(secret_blob()))
    assert blob.chunks[0] == blake3.blake3(secret_blob()[:CS]).hexdigest()  # unkeyed, as ever
    with pytest.raises(InvalidArgument, match="not encrypted"):
        store.add_key("x")


def test_a_wrong_or_missing_password_is_refused_and_writes_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    make(tmp_path / "store")
    before = files_of(tmp_path / "store")
    with pytest.raises(WrongPassword, match="wrong password"):
        open_store(tmp_path / "store", password="incorrect horse")
    with pytest.raises(WrongPassword, match="REWIND_PASSWORD"):
        open_store(tmp_path / "store")
    with pytest.raises(WrongPassword):  # a prompt that gets nothing
        open_store(tmp_path / "store", password=lambda: "")
    assert files_of(tmp_path / "store") == before
    monkeypatch.setenv("REWIND_PASSWORD", PASSWORD)
    assert open_store(tmp_path / "store").encrypted
    (tmp_path / "pw").write_text("incorrect horse\n")
    monkeypatch.setenv("REWIND_PASSWORD_FILE", str(tmp_path / "pw"))  # the file wins over the variable
    with pytest.raises(WrongPassword):
        open_store(tmp_path / "store")
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    assert open_store(tmp_path / "store").encrypted
    monkeypatch.delenv("REWIND_PASSWORD_FILE")
    monkeypatch.delenv("REWIND_PASSWORD")
    with pytest.raises(WrongPassword):  # no store is made without a password either
        open_store(tmp_path / "new", create=True, encrypt=True, password=lambda: "")
    assert not (tmp_path / "new").exists()


def _no_scrypt(*_: object) -> bytes:
    raise AssertionError("scrypt ran")


def test_a_process_pays_scrypt_once_per_key_file_and_password(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    make(tmp_path / "store")
    first = open_store(tmp_path / "store", password=PASSWORD)
    monkeypatch.setattr(crypto, "_derive", _no_scrypt)
    assert open_store(tmp_path / "store", password=PASSWORD).keys == first.keys  # remembered
    with pytest.raises(AssertionError, match="scrypt ran"):  # another password is tried in full
        open_store(tmp_path / "store", password="incorrect horse")


def test_a_helper_handed_the_keys_skips_scrypt_but_still_needs_the_password(tmp_path: Path) -> None:
    """What a committer gets from its parent (engine/pending.py start_committer): the keys this
    process unlocked, through a pipe; with them a child opens the store without scrypt, with
    the right password only."""
    import rewind.store

    make(tmp_path / "store")
    open_store(tmp_path / "store", password=PASSWORD)
    handed = rewind.store.unlocked_for_child()
    assert PASSWORD.encode() not in handed
    child = ("import sys, rewind.store, rewind.store.crypto as c\n"
             "rewind.store.take_unlocked(open(int(sys.argv[1]), 'rb').read())\n"
             "c._derive = lambda *a: sys.exit(3)\n"  # scrypt would end the child with 3
             "rewind.store.open_store(sys.argv[2], password=sys.argv[3])\n")
    for password, code in ((PASSWORD, 0), ("incorrect horse", 3)):
        read, write = os.pipe()
        os.write(write, handed)
        os.close(write)
        done = subprocess.run([sys.executable, "-c", child, str(read), str(tmp_path / "store"), password],
                              pass_fds=(read,), capture_output=True, text=True)
        os.close(read)
        assert done.returncode == code, done.stderr


def test_keys_add_list_remove_and_change_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make(tmp_path / "store")
    first = store.key_id
    with pytest.raises(InvalidArgument, match="last"):
        store.remove_key(first)
    second = store.add_key("second password")
    assert [s.id for s in store.key_slots()] == [first, second]
    slot = json.loads((tmp_path / "store" / "keys" / second).read_text())
    assert {"n", "r", "p", "salt", "data", "kdf"} <= slot.keys() and slot["kdf"] == "scrypt"
    assert open_store(tmp_path / "store", password="second password").key_id == second
    store.remove_key(second)
    with pytest.raises(WrongPassword):
        open_store(tmp_path / "store", password="second password")
    with pytest.raises(InvalidArgument, match="no key"):
        store.remove_key("0123456789abcdef")

    point = store.commit("web", {"ram": store.put_blob(BytesIO(secret_blob()))})
    new = store.change_password("new password")
    assert [s.id for s in store.key_slots()] == [new]
    with pytest.raises(WrongPassword):
        open_store(tmp_path / "store", password=PASSWORD)
    reopened = open_store(tmp_path / "store", password="new password")
    reopened.materialize(reopened.get(point.id).blobs["ram"], tmp_path / "out")  # the same master key
    assert (tmp_path / "out").read_bytes() == secret_blob()

    # A crash after the new key file is written leaves both keys working, never neither.
    def crash(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(crypto, "remove_key", crash)
    with pytest.raises(KeyboardInterrupt):
        reopened.change_password("newer password")
    for password in ("new password", "newer password"):
        assert open_store(tmp_path / "store", password=password)


def test_a_flipped_byte_anywhere_is_refused(tmp_path: Path) -> None:
    store = make(tmp_path / "store")
    point = store.commit("web", {"ram": store.put_blob(BytesIO(secret_blob()))}, name="p")
    h = point.blobs["ram"].chunks[0]
    assert h is not None
    flip_stored_byte(store.root, h)
    fresh = open_store(store.root, password=PASSWORD)
    with pytest.raises(CorruptChunk, match="authentication"):
        fresh.materialize(point.blobs["ram"], tmp_path / "out")
    assert not fresh.check(read_data=True).ok
    manifest = store.root / "checkpoints" / f"{point.id}.json"
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 1
    manifest.write_bytes(bytes(raw))
    fresh = open_store(store.root, password=PASSWORD)
    with pytest.raises(StoreError, match="damaged.*authentication"):
        fresh.get(point.id)
    assert fresh.list() == []
    key = next((store.root / "keys").iterdir())
    slot = json.loads(key.read_text())
    sealed = bytearray(crypto._unb64(slot["data"]))
    sealed[-1] ^= 1
    key.write_text(json.dumps({**slot, "data": crypto._b64(bytes(sealed))}))
    with pytest.raises(WrongPassword):
        open_store(store.root, password=PASSWORD)


def test_a_making_that_died_before_its_config_leaves_no_key_behind(tmp_path: Path) -> None:
    make(tmp_path / "store")
    (tmp_path / "store" / "config.json").unlink()  # as if killed just before it was written
    store = make(tmp_path / "store")
    assert len(store.key_slots()) == 1 and open_store(store.root, password=PASSWORD).keys == store.keys


def test_a_key_file_asking_for_too_much_work_is_refused(tmp_path: Path) -> None:
    make(tmp_path / "store")
    key = next((tmp_path / "store" / "keys").iterdir())
    slot = json.loads(key.read_text())
    for change in ({"n": 1 << 20, "r": 16}, {"p": 1000}, {"n": 1000}):
        key.write_text(json.dumps({**slot, **change}))
        with pytest.raises(StoreError, match="damaged"):
            open_store(tmp_path / "store", password=PASSWORD)


def test_a_config_turned_back_to_plain_is_refused(tmp_path: Path) -> None:
    """A writer of the folder cannot make rewind write in the clear beside sealed objects."""
    make(tmp_path / "store")
    (tmp_path / "store" / "config.json").write_text(json.dumps({"format": 2, "chunk_size": CS}))
    with pytest.raises(StoreError, match="key files"):
        open_store(tmp_path / "store")


def test_chunk_names_are_keyed_and_still_deduplicate(tmp_path: Path) -> None:
    one, two = make(tmp_path / "one"), make(tmp_path / "two")
    data = secret_blob()
    a = one.put_blob(BytesIO(data))
    packs = sorted((one.root / "packs").iterdir())
    assert one.put_blob(BytesIO(data)).chunks == a.chunks
    assert sorted((one.root / "packs").iterdir()) == packs  # nothing new written
    b = two.put_blob(BytesIO(data))
    plain = [blake3.blake3(data[i:i + CS]).hexdigest() for i in range(0, len(data), CS)]
    assert a.chunks[0] not in (b.chunks[0], plain[0])  # a name says nothing without the key
    assert a.chunks[3] is None and b.chunks[3] is None
    assert a.chunks[0] == one.keys.name_chunk(data[:CS])  # type: ignore[union-attr]


def test_export_and_import_of_an_encrypted_store(tmp_path: Path) -> None:
    store = make(tmp_path / "store")
    point = store.commit("web", {"ram": store.put_blob(BytesIO(secret_blob()))}, name="p")
    out = tmp_path / "point.rwnd"
    export_checkpoint(store, "p", out)
    assert out.read_bytes().startswith(b"RWNDENC1")
    assert MARKER not in out.read_bytes() and b'"web"' not in out.read_bytes()

    with pytest.raises(BadExport, match="encrypted export"):
        import_checkpoint(open_store(tmp_path / "plain", create=True), out)
    with pytest.raises(BadExport, match="another encrypted store"):
        import_checkpoint(make(tmp_path / "other"), out)
    plain = open_store(tmp_path / "plain")
    plain_point = plain.commit("web", {"ram": plain.put_blob(BytesIO(b"x" * CS))})
    export_checkpoint(plain, plain_point.id, tmp_path / "plain.rwnd")
    with pytest.raises(BadExport, match="plain export"):
        import_checkpoint(store, tmp_path / "plain.rwnd")

    store.add_key("another")
    store.delete("p")
    by_other_key = open_store(store.root, password="another")
    assert import_checkpoint(by_other_key, out).id == point.id
    by_other_key.materialize(by_other_key.get("p").blobs["ram"], tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == secret_blob()

    damaged = bytearray(out.read_bytes())
    damaged[40] ^= 1
    (tmp_path / "damaged.rwnd").write_bytes(bytes(damaged))
    by_other_key.delete("p")
    with pytest.raises(BadExport):
        import_checkpoint(by_other_key, tmp_path / "damaged.rwnd")


def test_the_store_verbs(tmp_path: Path) -> None:
    env = {"REWIND_HOME": str(tmp_path / "home"), "REWIND_STORE": str(tmp_path / "store")}
    said = rewind_cli("store", "init", "--encrypt", "--json", env=env)  # no terminal, no password
    assert said.returncode == 1 and len(said.stderr.decode().strip().splitlines()) == 1, said.stderr
    assert b"REWIND_PASSWORD" in said.stderr and not (tmp_path / "store").exists()
    env["REWIND_PASSWORD"] = PASSWORD
    said = rewind_cli("store", "init", "--encrypt", "--json", env=env)
    assert said.returncode == 0, said.stderr
    first = json.loads(said.stdout)["key"]
    assert json.loads(said.stdout)["encrypted"] is True
    said = rewind_cli("store", "init", "--encrypt", env=env)
    assert said.returncode == 1 and b"already" in said.stderr

    said = rewind_cli("store", "key", "add", "--json", env={**env, "REWIND_NEW_PASSWORD": "two"})
    assert said.returncode == 0, said.stderr
    second = json.loads(said.stdout)["id"]
    listed = json.loads(rewind_cli("store", "key", "list", "--json", env=env).stdout)
    assert [(k["id"], k["current"]) for k in listed] == [(first, True), (second, False)]
    said = rewind_cli("store", "key", "passwd", "--json", env={**env, "REWIND_NEW_PASSWORD": "three"})
    assert said.returncode == 0, said.stderr
    third = json.loads(said.stdout)["added"]
    env["REWIND_PASSWORD"] = "three"
    listed = json.loads(rewind_cli("store", "key", "list", "--json", env=env).stdout)
    assert [k["id"] for k in listed] == [second, third]
    assert rewind_cli("store", "key", "remove", second, env=env).returncode == 0
    said = rewind_cli("store", "key", "remove", third, env=env)
    assert said.returncode == 1 and b"last" in said.stderr
    said = rewind_cli("store", "check", env={**env, "REWIND_PASSWORD": "wrong"})
    assert said.returncode == 1 and said.stderr.decode().count("\n") == 1 and b"wrong password" in said.stderr
    assert rewind_cli("store", "check", env=env).returncode == 0


def _opens(root: Path, password: str) -> bool:
    try:
        open_store(root, password=password).check()
        return True
    except WrongPassword:
        return False


@pytest.mark.parametrize("verb", ["passwd", "remove"])
def test_a_crash_at_any_step_of_a_key_change_leaves_the_store_open_to_a_password(
        tmp_path: Path, verb: str) -> None:
    """`rewind store key passwd|remove` killed before each of its durable steps in turn: the
    store still opens, with the old password or the new one, and then the change completes."""
    log = tmp_path / "crashes"
    for step in range(1, 20):
        root = tmp_path / f"store-{step}"
        store = make(root)
        second = store.add_key("second")
        args = ["store", "key", "passwd"] if verb == "passwd" else ["store", "key", "remove", second]
        env = {"REWIND_HOME": str(tmp_path / "home"), "REWIND_STORE": str(root), "REWIND_PASSWORD": PASSWORD,
               "REWIND_NEW_PASSWORD": "new", CRASH_ENV: f"cli:{step}", LOG_ENV: str(log)}
        done = rewind_cli(*args, env=env)
        opening = {pw for pw in (PASSWORD, "second", "new") if _opens(root, pw)}
        if done.returncode == 0:  # no step left to crash at: the change is whole
            assert opening == ({"second", "new"} if verb == "passwd" else {PASSWORD})
            assert step > 1
            return
        assert done.returncode == -9, done.stderr  # killed at that step
        assert opening & {PASSWORD, "new"}, f"no password opens the store after a crash at step {step}"
    raise AssertionError("the key change never completed")


# Made once by data/make_encrypted_store.py; never rewritten.
FROZEN = Path(__file__).parent / "data" / "store-encrypted"
FROZEN_PASSWORD = "frozen-store-password"


def test_a_frozen_encrypted_store_still_reads(tmp_path: Path) -> None:
    """The encrypted format as first written (key file, sealed packs and manifests) opens with
    its password and gives back every blob byte for byte; a wrong password is refused."""
    root = tmp_path / "store"
    shutil.copytree(FROZEN, root)
    for folder in ("tmp", "locks", "chunks"):  # git keeps no empty folders
        (root / folder).mkdir(exist_ok=True)
    with pytest.raises(WrongPassword):
        open_store(root, password="not-the-password")
    store = open_store(root, password=FROZEN_PASSWORD)
    report = store.check(read_data=True)
    assert report.ok and (report.checkpoints, report.chunks) == (2, 4), report
    assert store.get("second").parent == store.get("first").id and store.get("second~1").name == "first"
    expected = {("first", "ram"): "eb42df8f7da6b1fbbf4b7d84739d659f02fabd4e9d7e8f48e4afb232b5032c08",
                ("second", "ram"): "fc76f21a501ef8f804d6332cdbde68e155c42f470b88c686611eee0e7cac542f",
                ("first", "devstate"): "0eb4dbf0cfa19a2703d7a547c05b7fd76c20c68709b79f9bc0124629a8542b24",
                ("second", "devstate"): "0eb4dbf0cfa19a2703d7a547c05b7fd76c20c68709b79f9bc0124629a8542b24"}
    for (ref, blob), digest in expected.items():
        out = tmp_path / f"{ref}.{blob}"
        store.materialize(store.get(ref).blobs[blob], out)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == digest, (ref, blob)
    assert store.get("first").blobs["ram"].chunks[-1] is None


def test_a_machine_checkpointed_into_an_encrypted_store(home: Home, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither a file's content nor a process's memory can be found in the store's files, and a
    second home that has the password makes a machine from the point and reads the file back."""
    from conftest import cleanup_home

    from rewind import Sandbox
    from rewind.signers import signing_key, trust

    disk_marker, memory_marker = "DISKMARK-4e1f0b9d2a", "MEMMARK-93c7a1e5d0"
    store_path = tmp_path / "shared-store"
    open_store(store_path, create=True, encrypt=True, password=PASSWORD)  # the default chunk size
    monkeypatch.setenv("REWIND_STORE", str(store_path))
    monkeypatch.setenv("REWIND_PASSWORD", PASSWORD)
    sbx = Sandbox.create("secret")
    sbx.exec(f"printf '{disk_marker}%.0s' $(seq 1000) > /root/marker.txt && sync", check=True)
    sbx.exec(f"""nohup python3 -c "import time; s='{memory_marker}'*1000; time.sleep(600)" """
             ">/dev/null 2>&1 &", check=True)
    point = sbx.checkpoint(name="with-secrets", wait=True)
    for path in store_path.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert disk_marker.encode() not in content and memory_marker.encode() not in content, path

    other = Home(root=tmp_path / "other-home", images=home.images)
    trust(other, signing_key(home).public)  # the point is signed by the first home
    try:
        copy = Sandbox.create("copy", from_checkpoint=point.id, home=other)
        assert copy.files.read("/root/marker.txt").decode() == disk_marker * 1000
        running = copy.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        assert memory_marker in running  # the process that held it runs on in the new machine
    finally:
        cleanup_home(other)


def test_the_password_is_asked_for_on_a_terminal(tmp_path: Path) -> None:
    """With no password in the environment, the CLI asks on the terminal (twice for a new one)."""
    env = {**os.environ, "REWIND_HOME": str(tmp_path / "home"), "REWIND_STORE": str(tmp_path / "store")}

    def run(*args: str, answers: list[str]) -> tuple[int, str]:
        pid, fd = pty.fork()
        if pid == 0:  # the child: its terminal is the pty
            os.execve(sys.executable, [sys.executable, "-m", "rewind.cli", *args], env)
        said, deadline = b"", time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 1024)
            except OSError:  # EIO: the child closed the terminal
                break
            said += chunk
            if answers and said.rstrip().endswith(b":"):
                os.write(fd, answers.pop(0).encode() + b"\n")
                said += b"|"
        os.close(fd)
        return os.waitpid(pid, 0)[1], said.decode(errors="replace")

    status, said = run("store", "init", "--encrypt", answers=[PASSWORD, PASSWORD])
    assert status == 0 and "again" in said and "made an encrypted" in said, said
    status, said = run("store", "key", "list", answers=[PASSWORD])
    assert status == 0 and "*" in said, said
    status, said = run("store", "key", "list", answers=["wrong"])
    assert status != 0 and "wrong password" in said, said
