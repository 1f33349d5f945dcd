"""Signed checkpoints: a home signs what it commits, and runs only points signed by a key it
trusts (store/signing.py, signers.py). The store-level tests need no QEMU; the last one runs
a point made in one home in another, through a store both use."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from io import BytesIO
from pathlib import Path

import pytest
from conftest import cleanup_home, rewind_cli

from rewind import Home, Sandbox
from rewind.errors import AlreadyExists, InvalidArgument, NotFound
from rewind.signers import (
    check_signed,
    distrust,
    is_home_store,
    own_key,
    signer_of,
    signing_key,
    trust,
    trust_list,
    use_key,
)
from rewind.store import (
    CheckpointManifest,
    Store,
    UntrustedCheckpoint,
    export_checkpoint,
    import_checkpoint,
    open_store,
)
from rewind.store.signing import SigningKey, fingerprint, verify

CS = 4096
FROZEN = Path(__file__).parent / "data" / "store-v1"  # written before signing: every point unsigned


def _home(tmp_path: Path, name: str) -> Home:
    return Home(root=tmp_path / name, images=tmp_path / "images")


def _commit(store: Store, key: SigningKey | None, name: str | None = None,
            parent: str | None = None) -> CheckpointManifest:
    store.signer = key
    blob = store.put_blob(BytesIO(os.urandom(2 * CS)), chunk_size=CS)
    return store.commit("web", {"disk.0": blob}, parent=parent, name=name, meta={"memory_mib": 512})


def _manifest_file(store: Store, manifest: CheckpointManifest) -> Path:
    return store.root / "checkpoints" / f"{manifest.id}.json"


def _reread(store: Store, manifest: CheckpointManifest) -> CheckpointManifest:
    return open_store(store.root).get(manifest.id)  # a new Store: nothing cached


def test_a_signed_manifest_verifies_and_names_its_signer(tmp_path: Path) -> None:
    key = SigningKey.generate()
    store = open_store(tmp_path / "store", create=True)
    first = _commit(store, key, name="first")
    second = _commit(store, key, parent=first.id)
    stored = json.loads(_manifest_file(store, second).read_text())
    assert stored["signature"]["key"] == key.public and stored["signature"]["version"] == 1
    again = _reread(store, second)
    assert verify(again).state == "good" and verify(again).key == key.public
    # A point rebuilt from another's history is vouched for by that manifest's signature.
    _manifest_file(store, first).unlink()
    back = open_store(store.root).get(f"{second.id}~1")
    assert back.id == first.id and back.signature is None and verify(back).state == "good"
    assert key.public.startswith("ed25519:") and len(fingerprint(key.public)) == 16


def test_a_byte_changed_in_a_signed_manifest_makes_its_signature_bad(tmp_path: Path) -> None:
    key = SigningKey.generate()
    store = open_store(tmp_path / "store", create=True)
    point = _commit(store, key, name="point")
    path = _manifest_file(store, point)
    data = json.loads(path.read_text())
    data["meta"]["memory_mib"] = 513  # one byte of the file
    path.write_text(json.dumps(data, separators=(",", ":")))
    changed = _reread(store, point)
    assert verify(changed).state == "bad"
    home = _home(tmp_path, "home")
    with pytest.raises(UntrustedCheckpoint, match=f"does not match it.*{fingerprint(key.public)}|"
                                                  f"{fingerprint(key.public)}.*does not match it"):
        check_signed(home, changed, "run", local=True)
    # So is a signature moved onto another manifest, or one whose bytes were changed.
    other = _commit(store, key, name="other")
    data["meta"]["memory_mib"] = 512
    data["signature"] = json.loads(_manifest_file(store, other).read_text())["signature"]
    path.write_text(json.dumps(data, separators=(",", ":")))
    assert verify(_reread(store, point)).state == "bad"
    data["signature"]["sig"] = "!!not base64"
    path.write_text(json.dumps(data, separators=(",", ":")))
    assert verify(_reread(store, point)).state == "bad"


def test_only_the_homes_own_key_and_trusted_keys_pass(tmp_path: Path) -> None:
    a, b = _home(tmp_path, "a"), _home(tmp_path, "b")
    store = open_store(tmp_path / "shared", create=True)
    point = _reread(store, _commit(store, signing_key(a)))
    check_signed(a, point, "run", local=False)  # its own
    with pytest.raises(UntrustedCheckpoint, match=f"signed by key {fingerprint(own_key(a) or '')}.*"
                                                  "does not trust.*rewind trust add ed25519:"):
        check_signed(b, point, "run", local=False)
    assert signer_of(b, point) == f"{fingerprint(own_key(a) or '')}, not trusted"
    entry = trust(b, own_key(a) or "", name="alice")
    check_signed(b, point, "run", local=False)
    assert signer_of(b, point) == f"alice ({entry.fingerprint})"
    assert signer_of(a, point) == f"this home ({entry.fingerprint})"
    distrust(b, "alice")
    with pytest.raises(UntrustedCheckpoint):
        check_signed(b, point, "run", local=False)


def test_unsigned_points_run_from_the_homes_own_store_and_elsewhere_only_when_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = _home(tmp_path, "home")
    monkeypatch.delenv("REWIND_ALLOW_UNSIGNED", raising=False)
    own = open_store(home.store, create=True)
    shared = open_store(tmp_path / "shared", create=True)
    assert is_home_store(home, own) and not is_home_store(home, shared)
    point = _commit(shared, None)
    assert verify(point).state == "unsigned" and signer_of(home, point) == "unsigned"
    check_signed(home, point, "run", local=True)
    with pytest.raises(UntrustedCheckpoint, match="unsigned.*--allow-unsigned or REWIND_ALLOW_UNSIGNED=1"):
        check_signed(home, point, "run", local=False)
    check_signed(home, point, "run", local=False, allow_unsigned=True)
    monkeypatch.setenv("REWIND_ALLOW_UNSIGNED", "1")
    check_signed(home, point, "run", local=False)
    monkeypatch.setenv("REWIND_ALLOW_UNSIGNED", "0")
    with pytest.raises(UntrustedCheckpoint, match="unsigned"):
        check_signed(home, point, "run", local=True)


def test_the_frozen_store_of_format_1_still_reads_its_points_as_unsigned(tmp_path: Path) -> None:
    copy = tmp_path / "store-v1"
    shutil.copytree(FROZEN, copy)
    for folder in ("tmp", "locks"):  # git keeps no empty folders
        (copy / folder).mkdir(exist_ok=True)
    points = open_store(copy).list()
    assert points and all(verify(p).state == "unsigned" for p in points)


def test_the_signing_key_is_private_made_once_and_kept(tmp_path: Path) -> None:
    home = _home(tmp_path, "home")
    assert own_key(home) is None  # none until one is needed
    key = signing_key(home)
    assert stat.S_IMODE(home.signing_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.signing_key.parent.stat().st_mode) == 0o700
    assert signing_key(home).public == key.public == own_key(home)
    assert [p.name for p in home.signing_key.parent.iterdir()] == ["signing.key"]  # no temporary left
    assert key.public not in repr(key) and b"PRIVATE KEY" in home.signing_key.read_bytes()


def test_processes_making_the_key_at_once_keep_one(tmp_path: Path) -> None:
    home = _home(tmp_path, "home")
    code = "import sys; from rewind import Home; from rewind.signers import signing_key; " \
           "print(signing_key(Home.from_env(sys.argv[1])).public)"
    runs = [subprocess.Popen([sys.executable, "-c", code, str(home.root)], stdout=subprocess.PIPE)
            for _ in range(6)]
    keys = {run.communicate(timeout=60)[0].decode().strip() for run in runs}
    assert keys == {own_key(home)} and [p.name for p in home.signing_key.parent.iterdir()] == ["signing.key"]


def test_a_fleet_node_home_takes_the_drivers_key_and_no_other(tmp_path: Path) -> None:
    node, driver = _home(tmp_path, "node"), SigningKey.generate()
    use_key(node, driver)
    use_key(node, driver)  # again: the same key, nothing to do
    assert own_key(node) == driver.public
    with pytest.raises(InvalidArgument, match="another key"):
        use_key(node, SigningKey.generate())


def test_trust_add_list_and_remove(tmp_path: Path) -> None:
    home = _home(tmp_path, "home")
    one, two = SigningKey.generate().public, SigningKey.generate().public
    trust(home, one, name="ci")
    trust(home, two)
    listed = trust_list(home)
    assert [(k.key, k.name) for k in listed.keys] == [(one, "ci"), (two, None)]
    saved = json.loads(home.trust_file.read_text())
    assert saved["version"] == 1 and [k["key"] for k in saved["keys"]] == [one, two]
    assert stat.S_IMODE(home.trust_file.stat().st_mode) == 0o600
    with pytest.raises(AlreadyExists):
        trust(home, one)
    with pytest.raises(AlreadyExists, match="named 'ci'"):
        trust(home, SigningKey.generate().public, name="ci")
    with pytest.raises(InvalidArgument, match="own key"):
        trust(home, signing_key(home).public)
    with pytest.raises(InvalidArgument, match="not a public key"):
        trust(home, "ed25519:AAAA")
    assert distrust(home, fingerprint(two)).key == two  # by fingerprint, by name, by key
    assert distrust(home, "ci").key == one
    with pytest.raises(NotFound):
        distrust(home, one)
    assert trust_list(home).keys == []


def test_an_import_is_refused_unless_its_signer_is_trusted(tmp_path: Path) -> None:
    a, b = _home(tmp_path, "a"), _home(tmp_path, "b")
    source = open_store(tmp_path / "a-store", create=True)
    point = _commit(source, signing_key(a), name="travels")
    exported = tmp_path / "point.rewind"
    export_checkpoint(source, point.id, exported)
    target = open_store(tmp_path / "b-store", create=True)

    def check(manifest: CheckpointManifest) -> None:
        check_signed(b, manifest, "import", local=False)

    with pytest.raises(UntrustedCheckpoint, match="will not import"):
        import_checkpoint(target, exported, check=check)
    assert target.list() == [] and not list((target.root / "tmp").iterdir())  # nothing added
    trust(b, own_key(a) or "")
    imported = import_checkpoint(target, exported, check=check)
    # The import mark is the importer's: the signature still holds once it is added.
    again = _reread(target, imported)
    assert again.meta["imported"] is True and verify(again).state == "good"


def test_the_cli_shows_the_key_and_keeps_the_trust_list(tmp_path: Path) -> None:
    env = {"REWIND_HOME": str(tmp_path / "home")}
    shown = rewind_cli("key", "show", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    key = json.loads(shown.stdout)
    assert key["key"].startswith("ed25519:") and key["fingerprint"] == fingerprint(key["key"])
    assert key["key"] in rewind_cli("key", "show", env=env).stdout.decode()
    other = SigningKey.generate().public
    added = rewind_cli("trust", "add", other, "--name", "ci", env=env)
    assert added.returncode == 0, added.stderr
    listed = json.loads(rewind_cli("trust", "list", "--json", env=env).stdout)
    assert [(k["key"], k["name"]) for k in listed] == [(key["key"], "this home"), (other, "ci")]
    bad = rewind_cli("trust", "add", "ed25519:nope", env=env)
    assert bad.returncode == 1 and b"not a public key" in bad.stderr and b"Traceback" not in bad.stderr
    assert rewind_cli("trust", "remove", "ci", env=env).returncode == 0
    assert len(json.loads(rewind_cli("trust", "list", "--json", env=env).stdout)) == 1
    # `checkpoints` and `log` say who signed each point.
    home = Home(root=tmp_path / "home", images=tmp_path / "images")
    store = open_store(tmp_path / "shared", create=True)
    mine = _commit(store, signing_key(home), name="mine")
    theirs = _commit(store, SigningKey.generate(), name="theirs", parent=mine.id)
    unsigned = _commit(store, None, name="old")
    env["REWIND_STORE"] = str(store.root)
    listed = json.loads(rewind_cli("checkpoints", "--json", env=env).stdout)
    fp = key["fingerprint"]
    assert {c["name"]: c["signer"] for c in listed} == {
        "mine": f"this home ({fp})", "old": "unsigned",
        "theirs": f"{fingerprint(theirs.signature.key if theirs.signature else '')}, not trusted"}
    log = json.loads(rewind_cli("log", "theirs", "--json", env=env).stdout)
    assert [c["ref"] for c in log] == ["~0", "~1"] and log[0]["signer"] == log[1]["signer"]
    table = rewind_cli("checkpoints", env=env).stdout.decode()
    assert "SIGNED BY" in table and "unsigned" in table and unsigned.id[:12] in table


def test_a_point_made_in_one_home_runs_in_another_once_it_trusts_the_first(
        home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Home A checkpoints into a store both homes use; home B refuses the point, with the
    signer named and nothing made, until it trusts A's key."""
    monkeypatch.setenv("REWIND_STORE", str(tmp_path / "shared-store"))
    with Sandbox.create(home=home) as sbx:
        sbx.exec("echo made-in-home-a > /root/mark && sync", check=True)
        point = sbx.checkpoint(name="from-a", wait=True)
    a_key = own_key(home)
    assert a_key is not None
    other = Home(root=tmp_path / "home-b", images=home.images)
    try:
        with pytest.raises(UntrustedCheckpoint, match=f"signed by key {fingerprint(a_key)}"):
            Sandbox.create(from_checkpoint=point.id, home=other)
        assert not other.machines.exists() or not list(other.machines.iterdir())
        trust(other, a_key, name="home-a")
        with Sandbox.create(from_checkpoint="from-a", home=other) as copy:
            assert copy.exec("cat /root/mark", check=True).stdout.strip() == "made-in-home-a"
            assert copy.history()[0].signer == f"home-a ({fingerprint(a_key)})"
            # Once A's key is no longer trusted, a restore to its point is refused and the
            # machine runs on as it was.
            copy.exec("echo changed-in-home-b > /root/mark && sync", check=True)
            distrust(other, "home-a")
            with pytest.raises(UntrustedCheckpoint, match=f"will not restore.*{fingerprint(a_key)}"):
                copy.restore(point.id)
            assert copy.exec("cat /root/mark", check=True).stdout.strip() == "changed-in-home-b"
    finally:
        cleanup_home(other)
