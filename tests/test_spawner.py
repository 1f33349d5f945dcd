"""The home's spawner: background processes forked from one warm process (no QEMU needed)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until

from rewind.engine.process import spawner
from rewind.engine.process.qemu import start_ticks
from rewind.engine.process.unixsock import connect_unix


def _spawner_pids(runtime: Path) -> list[int]:
    """The spawners serving `runtime` (not their children, which share their command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"rewind.engine.process.spawner" in cmdline and str(runtime).encode() in cmdline
        if ours and start_ticks(int(proc.name)):
            found.append(int(proc.name))
    children = set()
    for pid in found:
        with contextlib.suppress(OSError):
            if int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]) in found:
                children.add(pid)
    return [pid for pid in found if pid not in children]


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o700)
    yield folder
    pids = _spawner_pids(folder)
    shutil.rmtree(folder)
    for pid in pids:  # its folder is gone: it ends by itself
        wait_until(lambda pid=pid: start_ticks(pid) is None, f"process {pid} to end", timeout=10)


def _quick(wait: bool = True) -> spawner.Request:
    # A committer whose journal does not exist (committed already) ends at once, with status 0.
    return spawner.Request("commit", ["/nonexistent", "/nonexistent", "/nonexistent/point.json"], wait=wait)


def test_children_are_forked_by_one_spawner_per_home(runtime: Path) -> None:
    first = spawner.spawn(runtime, _quick())
    assert first is not None and first.wait(10) == 0
    [pid] = _spawner_pids(runtime)
    second = spawner.spawn(runtime, _quick())
    assert second is not None and second.wait(10) == 0
    assert first.pid != second.pid and pid not in (first.pid, second.pid)
    assert _spawner_pids(runtime) == [pid]  # the same one served both


def test_a_spawner_of_other_code_is_not_used_and_ends(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert spawner.spawn(runtime, _quick(wait=False)) is not None
    [old] = _spawner_pids(runtime)
    monkeypatch.setattr(spawner, "code_version", lambda: "an upgraded rewind")
    assert spawner.spawn(runtime, _quick()) is None  # the caller starts a fresh process instead
    wait_until(lambda: start_ticks(old) is None, "the old spawner to end", timeout=10)
    assert not (runtime / spawner.SOCKET).exists()


def test_a_spawner_ends_when_its_runtime_folder_goes(runtime: Path) -> None:
    assert spawner.spawn(runtime, _quick(wait=False)) is not None
    [pid] = _spawner_pids(runtime)
    (runtime / spawner.SOCKET).unlink()
    wait_until(lambda: start_ticks(pid) is None, f"process {pid} to end", timeout=10)


def test_bad_requests_are_refused_without_harm(runtime: Path) -> None:
    assert spawner.spawn(runtime, _quick()) is not None
    [pid] = _spawner_pids(runtime)
    good = {"target": "commit", "args": [], "version": spawner.PROTOCOL, "code": spawner.code_version()}
    for bad in (b"not json", b"[]", *(json.dumps({**good, **change}).encode() for change in (
            {"target": "rm -rf /"}, {"args": "x"}, {"version": 99},
            {"password": {"LD_PRELOAD": "/tmp/x.so"}}))):  # only the store password's variables
        with connect_unix(runtime / spawner.SOCKET, timeout=10) as sock:
            sock.sendall(bad + b"\n")
            try:
                answer = sock.makefile("rb").readline()
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # no child: closed unanswered
    served = spawner.spawn(runtime, _quick())
    assert served is not None and served.wait(10) == 0
    assert _spawner_pids(runtime) == [pid]


def test_file_descriptors_go_to_the_child_alone(runtime: Path, tmp_path: Path) -> None:
    """A splitter gets its pipe, memory file and ready pipe by descriptor; the spawner keeps
    no copy (a reader left there would keep QEMU's stream from ever seeing its reader go)."""
    stream_r, stream_w = os.pipe()
    ready_r, ready_w = os.pipe()
    ram = os.open(tmp_path / "ram", os.O_WRONLY | os.O_CREAT, 0o600)
    done = tmp_path / "done"
    args = ["{fd0}", "{fd1}", "pc.ram", str(tmp_path / "devstate"), str(done), str(tmp_path / "front"),
            "{fd2}"]
    request = spawner.Request("split", args, wait=True)
    child = spawner.spawn(runtime, request, fds=(stream_r, ram, ready_w))
    for fd in (stream_r, ram, ready_w):
        os.close(fd)
    assert child is not None
    assert os.read(ready_r, 1) == b"r"
    os.close(stream_w)  # an empty stream: the split fails, and says so
    assert child.wait(10) == 1
    assert "error" in json.loads(done.read_text())
    assert os.read(ready_r, 1) == b""  # no copy of the ready pipe's write end is left anywhere
    os.close(ready_r)
