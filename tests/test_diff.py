"""`diff` on real guests: what a step did to files (read on the host from the disk layers),
packages, processes and listening sockets; between points, branches, a point and the machine
now; and in a failed try's outcome. One machine serves the module, its tests in order."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import rewind_cli
from serving import served

from rewind import Home, Sandbox, try_in_copy
from rewind.engine.changes.filediff import is_noise

LISTENER = ("python3 -c 'import socket, time; s = socket.socket(); s.bind((\"0.0.0.0\", 8123)); "
            "s.listen(); time.sleep(3600)'")
# Waits until the listener is listening (8123 is 1FBB in /proc/net/tcp), so a checkpoint sees it.
WAIT_LISTENING = ("for i in $(seq 300); do grep -q ':1FBB 00000000:0000 0A' /proc/net/tcp && break; "
                  "sleep 0.1; done")

STEP = " && ".join([
    "echo more >> /root/proj/edit.txt",
    "rm /root/proj/gone.txt",
    "chmod 700 /root/proj/mode.sh",
    "chown 1000:1000 /root/proj/owned.txt",
    "echo new > /root/proj/new.txt",
    "ln -s new.txt /root/proj/link",
    "mkdir /root/proj/sub && echo x > /root/proj/sub/f",
    "dpkg -i /root/rewind-hello.deb >/dev/null",
    f"(setsid nohup {LISTENER} >/dev/null 2>&1 &)",
    WAIT_LISTENING,
])
EXPECTED = {
    "/root/proj/edit.txt": "modified", "/root/proj/gone.txt": "deleted", "/root/proj/mode.sh": "modified",
    "/root/proj/owned.txt": "modified", "/root/proj/new.txt": "added", "/root/proj/link": "added",
    "/root/proj/sub": "added", "/root/proj/sub/f": "added",
    "/usr/bin/rewind-hello": "added", "/usr/share/doc/rewind-hello": "added",
    "/usr/share/doc/rewind-hello/README": "added",
}


def _deb(tmp: Path) -> Path:
    """A tiny Debian package, built on the host."""
    root = tmp / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: rewind-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.com>\n"
        "Description: a test package\n")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/rewind-hello").write_text("#!/bin/sh\necho hello\n")
    (root / "usr/bin/rewind-hello").chmod(0o755)
    (root / "usr/share/doc/rewind-hello").mkdir(parents=True)
    (root / "usr/share/doc/rewind-hello/README").write_text("hello\n")
    out = tmp / "rewind-hello.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(out)], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def stepped(sbx: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shared machine before and after STEP, each a checkpoint."""
    deb = _deb(tmp_path_factory.mktemp("deb"))
    sbx.files.upload(deb, "/root/rewind-hello.deb")
    sbx.exec("mkdir -p /root/proj && cd /root/proj && echo a > edit.txt && echo b > gone.txt "
             "&& echo c > mode.sh && echo d > owned.txt", check=True)
    before = sbx.checkpoint()
    sbx.exec(STEP, check=True, timeout=120)
    after = sbx.checkpoint()
    return {"before": before, "after": after}


def _changes(d, noise: bool = False) -> dict[str, str]:
    return {c.path: c.kind for c in d.files if noise or not c.noise}


def test_a_step_is_reported_exactly(sbx: Sandbox, stepped: dict) -> None:
    d = sbx.diff(stepped["before"], stepped["after"])
    assert _changes(d) == EXPECTED, d.files
    by_path = {c.path: c for c in d.files}
    assert by_path["/root/proj/mode.sh"].before.mode == 0o644
    assert by_path["/root/proj/mode.sh"].after.mode == 0o700
    owned = by_path["/root/proj/owned.txt"].after
    assert (owned.uid, owned.gid) == (1000, 1000)
    assert (by_path["/root/proj/edit.txt"].before.size, by_path["/root/proj/edit.txt"].after.size) == (2, 7)
    assert by_path["/root/proj/link"].after.type == "symlink"
    assert by_path["/root/proj/link"].after.target == "new.txt"
    assert by_path["/root/proj/sub"].after.type == "dir"
    assert [(p.name, p.kind, p.after) for p in d.packages] == [("rewind-hello", "installed", "1.0")]
    assert d.processes_ended == []
    assert len(d.processes_started) == 1 and "s.bind((\"0.0.0.0\", 8123))" in d.processes_started[0]
    assert d.listening_opened == ["tcp 0.0.0.0:8123"] and d.listening_closed == []
    assert d.notes == [] and d.network is None and d.labels is None
    # With noise: the package database and logs, never anything outside the noise list.
    everything = sbx.diff(stepped["before"], stepped["after"], noise=True)
    extra = set(_changes(everything, noise=True)) - set(EXPECTED)
    assert "/var/lib/dpkg/status" in extra and all(is_noise(p) for p in extra)
    # Back the other way: each change reversed.
    back = sbx.diff(stepped["after"], stepped["before"])
    flip = {"added": "deleted", "deleted": "added", "modified": "modified"}
    assert _changes(back) == {p: flip[k] for p, k in EXPECTED.items()}
    assert [(p.name, p.kind) for p in back.packages] == [("rewind-hello", "removed")]


def test_content_of_one_file(sbx: Sandbox, stepped: dict) -> None:
    text = sbx.diff_content("/root/proj/edit.txt", stepped["before"], stepped["after"])
    assert text.splitlines()[-2:] == [" a", "+more"]
    assert sbx.diff_content("/root/proj/edit.txt", stepped["after"], stepped["after"]) == ""


def test_diff_against_the_machine_now(sbx: Sandbox, stepped: dict) -> None:
    sbx.exec("echo now > /root/proj/now.txt && rm /root/proj/new.txt", check=True)
    d = sbx.diff()  # from its last point (~0, stepped["after"]) to now
    assert _changes(d) == {"/root/proj/now.txt": "added", "/root/proj/new.txt": "deleted"}
    assert d.after == f"machine {sbx.name} now"
    assert d.processes_started == [] and d.listening_opened == []
    sbx.set_labels({"stage": "review"})
    assert sbx.diff("~1").labels == {"before": {}, "after": {"stage": "review"}}
    sbx.set_labels({"stage": None})


def test_diff_between_branches(sbx: Sandbox, stepped: dict) -> None:
    copy = sbx.fork()
    try:
        copy.exec("echo c > /root/proj/copy-only.txt", check=True)
        ours = sbx.checkpoint()
        theirs = copy.checkpoint()
        d = sbx.diff(ours, theirs)
        assert _changes(d) == {"/root/proj/copy-only.txt": "added"}
        assert "/etc/hostname" in _changes(sbx.diff(ours, theirs, noise=True), noise=True)
    finally:
        copy.delete()


def test_a_failed_try_says_what_the_step_did(sbx: Sandbox, stepped: dict) -> None:
    outcome = try_in_copy(sbx, "echo t > /root/proj/tried.txt && rm /root/proj/edit.txt && false")
    assert outcome.kept == "original"
    assert outcome.diff is not None
    assert _changes(outcome.diff) == {"/root/proj/tried.txt": "added", "/root/proj/edit.txt": "deleted"}
    assert sbx.exec("test -e /root/proj/tried.txt").exit_code == 1


def test_cli(sbx: Sandbox, shared_home: Home, stepped: dict) -> None:
    env = {"REWIND_HOME": str(shared_home.root), "REWIND_IMAGES": str(shared_home.images)}
    r = rewind_cli("diff", stepped["before"].id, stepped["after"].id, "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {f["path"]: f["kind"] for f in data["files"]} == EXPECTED
    r = rewind_cli("diff", stepped["before"].id, stepped["after"].id, "--paths", "/root/proj/*", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "/root/proj/" in out and "+ new.txt" in out and "rewind-hello" in out
    assert "/usr/bin/" not in out
    r = rewind_cli("try", sbx.name, "--diff", "--", "echo z > /root/proj/z.txt && false", env=env)
    assert r.returncode == 1 and b"+ z.txt" in r.stderr and b"1 paths (1 added" in r.stderr
    r = rewind_cli("diff", "no-such-machine-or-point", env=env)
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr
    r = rewind_cli("diff", stepped["after"].id, "--content", "/root/proj/edit.txt", env=env)
    assert r.returncode == 0 and b"+more" in r.stdout


def test_over_http(sbx: Sandbox, shared_home: Home, stepped: dict, tmp_path: Path) -> None:
    with served(shared_home, tmp_path / "serve.log", None) as url:
        remote = Sandbox.connect(url).get(sbx.name)
        d = remote.diff(stepped["before"].id, stepped["after"].id)
        assert _changes(d) == EXPECTED
        assert [p.name for p in d.packages] == ["rewind-hello"]
        assert d.listening_opened == ["tcp 0.0.0.0:8123"]
        text = remote.diff_content("/root/proj/edit.txt", stepped["before"], stepped["after"])
        assert text == sbx.diff_content("/root/proj/edit.txt", stepped["before"], stepped["after"])
        assert "+more" in text
        assert set(_changes(remote.diff(stepped["before"].id, stepped["after"].id, paths=["/usr/*"]))) == \
            {p for p in EXPECTED if p.startswith("/usr/")}
        r = rewind_cli("diff", sbx.name, stepped["before"].id, "--json", env={"REWIND_URL": url})
        assert r.returncode == 0, r.stderr
        files = {f["path"]: f["kind"] for f in json.loads(r.stdout)["files"] if not f["noise"]}
        assert files == _changes(sbx.diff(stepped["before"])) and "/root/proj/gone.txt" in files
