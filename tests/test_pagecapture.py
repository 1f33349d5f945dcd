"""The assembler of a capture by pages, on plain files (no QEMU): the image it finishes is the
mapped file with the guest's written pages over it, and it says so as a splitter does."""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

from rewind.engine.memory import pagecapture
from rewind.engine.memory.prefault import PAGE
from rewind.store.locks import acquire, is_held

PAGES = 32
WRITTEN = [(2, 4), (15, 16), (31, 32)]  # [first, last) page runs the guest wrote


def _page(i: int, base: dict[int, bytes]) -> bytes:
    if any(first <= i < last for first, last in WRITTEN):
        return b"W" * PAGE
    return base.get(i, bytes(PAGE))


def test_an_assembler_fills_the_image_from_the_file_outside_the_written_pages(tmp_path: Path) -> None:
    base_content = {i: bytes([65 + i]) * PAGE for i in (*range(0, 4), *range(10, 20))}  # the rest: holes
    base_content[24] = bytes(PAGE)  # data, but zero
    base = tmp_path / "base.ram"
    with open(base, "wb") as f:
        f.truncate(PAGES * PAGE)
        for i, data in base_content.items():
            f.seek(i * PAGE)
            f.write(data)
    image_path, devstate, done = tmp_path / "point.ram", tmp_path / "devstate", tmp_path / "devstate.done"
    image = os.open(image_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(image, PAGES * PAGE)
    for first, last in WRITTEN:  # what the capture copied while the guest was stopped
        os.pwrite(image, b"W" * PAGE * (last - first), first * PAGE)
    lock = acquire(devstate, exclusive=True, timeout=0)
    assert lock is not None
    os.write(lock, b"device state")
    runs = os.memfd_create("runs")
    os.write(runs, array("Q", [n for run in WRITTEN for n in run]).tobytes())
    source = os.open(base, os.O_RDONLY)

    fds = [str(fd) for fd in (source, image, lock, runs)]
    assert pagecapture.main([*fds, str(done), str(devstate), "0.5"]) == 0

    got = image_path.read_bytes()
    assert [got[i * PAGE:(i + 1) * PAGE] == _page(i, base_content) for i in range(PAGES)] == [True] * PAGES
    written_or_data = {i for i in range(PAGES) if i in base_content or _page(i, base_content)[0] == ord("W")}
    assert os.stat(image_path).st_blocks * 512 <= len(written_or_data) * PAGE, "holes were filled"
    with open(image_path, "rb") as f:  # the file's zero page is a hole, as a splitter leaves one
        assert os.lseek(f.fileno(), 24 * PAGE, os.SEEK_DATA) == 31 * PAGE
    result = json.loads(done.read_text())
    assert result["pages_written"] == 4 and result["devstate_bytes"] == len(b"device state")
    assert result["cpu_s"] >= 0.5
    assert not is_held(devstate)  # let go once the result is written: waiters see it ended


def test_a_guest_that_wrote_nothing_gets_the_file_itself(tmp_path: Path) -> None:
    base = tmp_path / "base.ram"
    base.write_bytes(os.urandom(PAGES * PAGE))
    image = os.open(tmp_path / "point.ram", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(image, PAGES * PAGE)
    lock = acquire(tmp_path / "devstate", exclusive=True, timeout=0)
    assert lock is not None
    runs = os.memfd_create("runs")
    source = os.open(base, os.O_RDONLY)
    done = tmp_path / "done"
    assert pagecapture.main([str(fd) for fd in (source, image, lock, runs)]
                            + [str(done), str(tmp_path / "devstate"), "0"]) == 0
    assert (tmp_path / "point.ram").read_bytes() == base.read_bytes()
    assert json.loads(done.read_text())["pages_written"] == 0
