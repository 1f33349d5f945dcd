"""Shared fixtures. Tests that claim a machine's behaviour run real QEMU guests.

One built image (and its booted template) is shared by the whole suite: it
lives where REWIND_IMAGES points, else in the default home's image cache,
and is built on first use. Each test gets its own REWIND_HOME; every machine
a test starts is deleted (its QEMU ended by PID) when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rewind import Home, RewindError, Sandbox
from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.engine.engine import Engine
from rewind.engine.process.qemu import process_alive
from rewind.image import build_image


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs the built image runs guests: mark it `guest` (`-m "not guest"` is the
    quick tier). Tests that start QEMU some other way carry the mark themselves."""
    for item in items:
        if "images_dir" in item.fixturenames:
            item.add_marker(pytest.mark.guest)


@pytest.fixture(autouse=True)
def _qemu_only_in_guest_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside `guest` tests, REWIND_QEMU names a QEMU that refuses to run and says why, so a
    test that starts one unmarked fails at once instead of slowing the quick tier."""
    if request.node.get_closest_marker("guest") is not None:
        return
    refuse = tmp_path_factory.getbasetemp() / "qemu-not-in-this-tier"
    if not refuse.exists():
        refuse.write_text("#!/bin/sh\necho 'this test starts QEMU: mark it guest' >&2\nexit 1\n")
        refuse.chmod(0o755)
    monkeypatch.setenv("REWIND_QEMU", str(refuse))


@pytest.fixture
def no_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    """No store password or new password from this process's environment."""
    for name in ("REWIND_PASSWORD", "REWIND_PASSWORD_FILE", "REWIND_NEW_PASSWORD",
                 "REWIND_NEW_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def images_dir() -> Path:
    path = Path(os.environ.get("REWIND_IMAGES") or Home.from_env().root / "images")
    build_image(path, report=lambda step: print(f"image: {step}", file=sys.stderr))
    Engine(Home(root=path.parent / "template-home", images=path)).template(DEFAULT_MEMORY_MIB, DEFAULT_CPUS)
    return path


def cleanup_home(home: Home) -> None:
    engine = Engine(home)
    for machine in engine.list():
        pid, tag = machine.record.pid, machine.record.uuid
        machine.delete()
        assert pid is None or not process_alive(pid, tag), f"QEMU {pid} outlived its machine"
    with contextlib.suppress(RewindError):
        engine.settle()  # background commits end before their home goes
    shutil.rmtree(home.runtime, ignore_errors=True)  # memory files on tmpfs


@pytest.fixture
def home(tmp_path: Path, images_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Home]:
    """A fresh REWIND_HOME sharing the suite's image; machines left in it are deleted."""
    h = Home(root=tmp_path / "home", images=images_dir)
    monkeypatch.setenv("REWIND_HOME", str(h.root))
    monkeypatch.setenv("REWIND_IMAGES", str(images_dir))
    yield h
    cleanup_home(h)


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[Home]:
    h = Home(root=tmp_path_factory.mktemp("shared") / "home", images=images_dir)
    yield h
    cleanup_home(h)


@pytest.fixture(scope="module")
def sbx(shared_home: Home) -> Sandbox:
    """One machine shared by a module's tests that do not care about a pristine guest."""
    return Sandbox.create("shared", home=shared_home)


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0,
               every: float = 0.05) -> None:
    """Return once `condition()` is true; fail, naming `what`, if it is not within `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(every)


def rewind_cli(*args: str, env: dict[str, str] | None = None, input: bytes | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed `rewind` command as a user would."""
    return subprocess.run([sys.executable, "-m", "rewind.cli", *args], capture_output=True, input=input,
                          env={**os.environ, **(env or {})}, timeout=timeout, check=False)


def processes_using(paths: list[Path]) -> list[int]:
    """The PIDs of processes with a file open or mapped under `paths` (QEMU, its network
    filter, the home's spawner...): those this test's machine started, found one by one."""
    roots = tuple(str(p) + "/" for p in paths)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = list((entry / "fd").iterdir())
            targets = [line.split(maxsplit=5)[-1] for line in (entry / "maps").read_text().splitlines()
                       if len(line.split(maxsplit=5)) == 6]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for fd in fds:
            with contextlib.suppress(OSError):  # closed since the listing: a busy QEMU was missed whole
                targets.append(os.readlink(fd))
        if any(t.startswith(roots) for t in targets):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def flip_stored_byte(store_root: Path, h: str) -> None:
    """Damage chunk `h` where the store keeps it: one byte in the middle of its frame, in its
    pack or its own file."""
    from rewind.store.packs import read_index

    places = [(pack, at, n) for pack in (store_root / "packs").glob("*.pack")
              for found, at, n in read_index(pack) if found == h]
    loose = store_root / "chunks" / h[:2] / h
    path, at, n = places[0] if places else (loose, 0, loose.stat().st_size)
    with open(path, "r+b") as f:
        f.seek(at + n // 2)
        byte = f.read(1)
        f.seek(at + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
