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
from pathlib import Path

from rewind.engine.migstream import FILE_MAGIC, FILE_VERSION, split_stream, write_with_pages


def _split(tmp_path: Path, stream: bytes) -> tuple[dict, int]:
    """Run the splitter on `stream`; (its result, how many bytes the writer got to write)."""
    read_end, write_end = os.pipe()
    ready_r, ready_w = os.pipe()
    ram = os.open(tmp_path / "ram", os.O_WRONLY | os.O_CREAT, 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "rewind.engine.migstream", str(read_end), str(ram), "ram0",
                             str(tmp_path / "devstate"), str(tmp_path / "done"), str(ready_w)],
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
