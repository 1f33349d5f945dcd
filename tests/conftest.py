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
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewind import Home, RewindError, Sandbox
from rewind.engine import DEFAULT_CPUS, DEFAULT_MEMORY_MIB
from rewind.engine.machine import Engine
from rewind.engine.qemu import process_alive
from rewind.image import build_image


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
