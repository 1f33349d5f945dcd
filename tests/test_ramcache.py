"""The memory-image cache's release rules, on plain files (no QEMU maps them): what trim
releases past the budget, and that an image a start holds is never taken from it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until

from rewind.engine.memory import ramcache
from rewind.store.locks import acquire

MIB = 1 << 20


def _image(folder: Path, name: str, age_s: float = 600.0) -> Path:
    path = folder / name
    path.write_bytes(b"\x01" * MIB)  # allocated, as a capture's non-zero pages are
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def _fds_on(path: Path) -> int:
    """How many of this process's descriptors are open on `path`."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            count += os.readlink(fd) == str(path)
    return count


def test_trim_releases_the_oldest_past_the_budget(tmp_path: Path) -> None:
    oldest, old, newer = (_image(tmp_path, f"{age}.ram", age) for age in (900, 600, 300))
    released = ramcache.trim(tmp_path, lambda: [], limit=2 * MIB)
    assert released == MIB
    assert not oldest.exists() and old.exists() and newer.exists()


def test_trim_keeps_pinned_recent_template_and_held_images(tmp_path: Path) -> None:
    pinned = _image(tmp_path, "pinned.ram")
    recent = _image(tmp_path, "recent.ram", age_s=ramcache.GRACE_S / 2)
    template = _image(tmp_path, f"{ramcache.TEMPLATE_PREFIX}img.ram")
    held = _image(tmp_path, "held.ram")
    free = _image(tmp_path, "free.ram")
    with ramcache.starting(held):
        assert ramcache.trim(tmp_path, lambda: [pinned], limit=1) == MIB
        assert not free.exists()
        assert all(p.exists() for p in (pinned, recent, template, held))
    assert ramcache.trim(tmp_path, lambda: [pinned], limit=1) == MIB  # the start is done with it
    assert not held.exists() and recent.exists()
    # To nothing (no machine left, or tmpfs short), a recent image goes too.
    assert ramcache.trim(tmp_path, lambda: [pinned], limit=0) == MIB
    assert not recent.exists() and pinned.exists() and template.exists()


def test_a_start_never_gets_an_image_released_under_it(tmp_path: Path) -> None:
    """A start that comes while a release holds the image waits, then finds it gone, even
    when a new image has been made under that name meanwhile; it never runs on a file that
    is no longer the cache's."""
    image = _image(tmp_path, "point.ram")
    release = acquire(image, exclusive=True, timeout=0, create=False)
    assert release is not None
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            with ramcache.starting(image):
                outcome.append(None)
        except FileNotFoundError as e:
            outcome.append(e)

    starter = threading.Thread(target=start)
    starter.start()
    # The release's hold, and the start's waiting for its own.
    wait_until(lambda: _fds_on(image) >= 2 or not starter.is_alive(), "the start opening the image",
               timeout=10, every=0.005)
    assert starter.is_alive(), outcome
    image.unlink()
    image.write_bytes(b"\x02" * MIB)  # brought back from the store under the same name
    os.close(release)
    starter.join(timeout=ramcache.START_WAIT_S + 5)
    assert len(outcome) == 1 and isinstance(outcome[0], FileNotFoundError)


def test_starting_an_image_that_is_gone_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), ramcache.starting(tmp_path / "gone.ram"):
        pass
    assert not (tmp_path / "gone.ram").exists(), "the hold made a file"
