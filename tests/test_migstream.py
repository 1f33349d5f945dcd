"""The memory splitter as a process, without QEMU: whatever it is fed, it reads its pipe to
the end (a QEMU 7.2 whose background snapshot loses its reader hangs with guest memory
write-protected) and reports the outcome in its result file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from io import BytesIO
from pathlib import Path

import pytest

from rewind.engine.memory import migstream
from rewind.engine.memory.migstream import FILE_MAGIC, FILE_VERSION, split_stream, write_with_pages


def _split(tmp_path: Path, stream: bytes) -> tuple[dict, int]:
    """Run the splitter on `stream`; (its result, how many bytes the writer got to write)."""
    read_end, write_end = os.pipe()
    ready_r, ready_w = os.pipe()
    ram = os.open(tmp_path / "ram", os.O_WRONLY | os.O_CREAT, 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "rewind.engine.memory.migstream", str(read_end), str(ram),
                             "ram0", *(str(tmp_path / name) for name in ("devstate", "done", "front")),
                             str(ready_w)],
                            pass_fds=(read_end, ram, ready_w))
    for fd in (read_end, ram, ready_w):
        os.close(fd)
    assert os.read(ready_r, 1) == b"r"
    os.close(ready_r)
    written = 0

    def write() -> None:
        nonlocal written
        with os.fdopen(write_end, "wb", buffering=0) as pipe:
            for at in range(0, len(stream), 65536):
                try:
                    written += pipe.write(stream[at:at + 65536])
                except BrokenPipeError:
                    return

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(timeout=60)
    assert not writer.is_alive(), "the splitter stopped reading: QEMU would hang"
    assert proc.wait(timeout=60) in (0, 1)
    return json.loads((tmp_path / "done").read_text()), written


def test_a_bad_stream_is_read_to_its_end_and_reported(tmp_path: Path) -> None:
    garbage = os.urandom(1 << 20) * 8  # far more than the pipe holds
    result, written = _split(tmp_path, garbage)
    assert "error" in result and "bad magic" in result["error"]
    assert written == len(garbage)


def test_a_stream_cut_short_is_reported(tmp_path: Path) -> None:
    result, _ = _split(tmp_path, struct.pack(">II", FILE_MAGIC, FILE_VERSION) + b"\x00" * 100)
    assert "error" in result and "cpu_s" in result


def test_pages_written_over_a_device_stream_read_back_as_written(tmp_path: Path) -> None:
    """write_with_pages puts a capture's pages ahead of its device-only stream, as QEMU's RAM
    section; the splitter, which reads QEMU's own streams, finds those pages (zero ones as
    holes) and the device sections after them unchanged."""
    page = 4096
    image = bytearray(64 * page)
    for n in (3, 4, 5, 20, 40):
        image[n * page:(n + 1) * page] = bytes([n]) * page
    (tmp_path / "image").write_bytes(bytes(image))
    devices = b"\x04"  # QEMU_VM_EOF: a device-only save with no device in it
    devstate = tmp_path / "saved"
    devstate.write_bytes(struct.pack(">II", FILE_MAGIC, FILE_VERSION) + devices)
    runs = [(3, 6), (10, 12), (40, 41)]  # 10 and 11 were written, and are zero
    read_end, write_end = os.pipe()
    fd = os.open(tmp_path / "image", os.O_RDONLY)
    try:
        writer = threading.Thread(target=lambda: (write_with_pages(devstate, "ram0", len(image), fd, runs,
                                                                   write_end), os.close(write_end)))
        writer.start()
        ram = os.open(tmp_path / "ram", os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(read_end, "rb") as src, open(tmp_path / "devstate", "wb") as dst:
            result = split_stream(src, "ram0", ram, dst)
        writer.join()
    finally:
        os.close(fd)
    os.close(ram)
    got = (tmp_path / "ram").read_bytes()
    assert result.pages_written == 4 and result.zero_pages == 2
    image[20 * page:21 * page] = bytes(page)  # not among the pages written
    assert got == bytes(image)
    assert (tmp_path / "devstate").read_bytes().endswith(devices)


def _stream_of(tmp_path: Path, image: bytes, runs: list[tuple[int, int]]) -> bytes:
    """A migration stream sending the pages `runs` ([first, last) page ranges, in this order)
    of `image`, then a device state with no device in it."""
    (tmp_path / "image").write_bytes(image)
    (tmp_path / "saved").write_bytes(struct.pack(">II", FILE_MAGIC, FILE_VERSION) + b"\x04")
    read_end, write_end = os.pipe()
    fd = os.open(tmp_path / "image", os.O_RDONLY)
    def write() -> None:
        write_with_pages(tmp_path / "saved", "ram0", len(image), fd, runs, write_end)
        os.close(write_end)

    writer = threading.Thread(target=write)
    writer.start()
    with os.fdopen(read_end, "rb") as pipe:
        stream = pipe.read()
    writer.join()
    os.close(fd)
    return stream


def test_the_front_told_covers_only_pages_already_written(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The splitter tells how much of the image from its start is final, for a committer that
    stores it meanwhile: never past a page still to come, even one sent ahead of its turn (a
    page the guest wrote during the write-out), and all of it at the end."""
    monkeypatch.setattr(migstream, "FRONT_STEP", 1)
    page, pages = 4096, 64
    image = b"".join(bytes([n]) * page if n % 3 else bytes(page) for n in range(pages))
    order = [(0, 10), (40, 41), (20, 21), (10, 20), (21, 40), (41, pages)]
    stream = _stream_of(tmp_path, image, order)
    ram = os.open(tmp_path / "ram", os.O_RDWR | os.O_CREAT, 0o600)
    told: list[int] = []

    def tell(front: int) -> None:
        assert os.fstat(ram).st_size == len(image)  # sized before any front is told
        assert os.pread(ram, front, 0) == image[:front]
        told.append(front)

    with BytesIO(stream) as src, open(tmp_path / "devstate", "wb") as dst:
        result = migstream.split_stream(src, "ram0", ram, dst, tell)
    os.close(ram)
    assert told == sorted(told) and told[-1] == len(image)
    assert len([f for f in told if f < len(image)]) > 3  # told as it comes, not only at the end
    assert result.pages_resent == 0
    assert (tmp_path / "ram").read_bytes() == image


def test_a_page_sent_twice_is_counted(tmp_path: Path) -> None:
    """What a committer read below the front may be stale if a page comes again (a migration's
    later pass): the result says so, and the committer reads the image again."""
    image = bytes(range(256)) * 16 * 8
    stream = _stream_of(tmp_path, image, [(0, 8), (3, 5)])
    ram = os.open(tmp_path / "ram", os.O_RDWR | os.O_CREAT, 0o600)
    with BytesIO(stream) as src, open(tmp_path / "devstate", "wb") as dst:
        result = migstream.split_stream(src, "ram0", ram, dst)
    os.close(ram)
    assert result.pages_resent == 2
    assert (tmp_path / "ram").read_bytes() == image


def test_a_command_between_ram_sections_is_kept_and_the_pages_after_it_split(tmp_path: Path) -> None:
    """QEMU 10's plain migration sends a command (switchover start) before RAM's last part;
    read as the end of RAM, the pages after it went into the device state."""
    page = 4096
    image = b"".join(bytes([n + 1]) * page for n in range(8))
    name = b"\x04ram0"
    footer = struct.pack(">BI", migstream.SECTION_FOOTER, 5)

    def part(kind: int, first: int, last: int) -> bytes:
        def record(n: int) -> bytes:  # the first page of a part names its block, the others continue
            flags = migstream.FLAG_PAGE | (migstream.FLAG_CONTINUE if n > first else 0)
            data = image[n * page:(n + 1) * page]
            return struct.pack(">Q", n * page | flags) + (b"" if n > first else name) + data
        pages = b"".join(record(n) for n in range(first, last))
        return struct.pack(">BI", kind, 5) + pages + struct.pack(">Q", migstream.FLAG_EOS) + footer

    command = struct.pack(">BHH", migstream.SECTION_COMMAND, 11, 2) + b"ok"
    devices = b"\x04devices\x1f"
    stream = b"".join([
        struct.pack(">II", FILE_MAGIC, FILE_VERSION),
        struct.pack(">BI", migstream.SECTION_START, 5), b"\x03ram", struct.pack(">II", 0, 4),
        struct.pack(">Q", len(image) | migstream.FLAG_MEM_SIZE), name, struct.pack(">QQ", len(image), 0),
        struct.pack(">Q", migstream.FLAG_EOS), footer,
        part(migstream.SECTION_PART, 0, 5), command, part(migstream.SECTION_END, 5, 8), devices])
    ram = os.open(tmp_path / "ram", os.O_RDWR | os.O_CREAT, 0o600)
    with BytesIO(stream) as src, open(tmp_path / "devstate", "wb") as dst:
        result = split_stream(src, "ram0", ram, dst)
    os.close(ram)
    assert (tmp_path / "ram").read_bytes() == image and result.pages_written == 8
    kept = (tmp_path / "devstate").read_bytes()
    assert command in kept and kept.endswith(footer + devices) and image[5 * page:6 * page] not in kept
