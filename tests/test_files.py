"""Files in the guest: text, binary, 100 MB, errors, atomic host downloads."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from rewind import Sandbox
from rewind.errors import GuestFileError, InvalidArgument


def test_write_then_read_text_and_binary(sbx: Sandbox) -> None:
    sbx.files.write("/root/notes/hello.txt", "héllo\n")
    assert sbx.files.read_text("/root/notes/hello.txt") == "héllo\n"
    blob = bytes(range(256)) * 4096 + b"\0\r\n\xff"
    sbx.files.write("/root/blob.bin", blob, mode=0o600)
    assert sbx.files.read("/root/blob.bin") == blob
    assert sbx.exec("stat -c %a /root/blob.bin").stdout.strip() == "600"
    assert sbx.exec("sha256sum /root/blob.bin").stdout.split()[0] == hashlib.sha256(blob).hexdigest()


def test_empty_file_round_trips(sbx: Sandbox) -> None:
    sbx.files.write("/root/empty", b"")
    assert sbx.files.read("/root/empty") == b""


def test_100_mb_upload_and_download(sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for _ in range(100):
            f.write(os.urandom(1 << 20))
    os.chmod(src, 0o750)
    sbx.files.upload(src, "/root/big.bin")
    guest_sum = sbx.exec("sha256sum /root/big.bin").stdout.split()[0]
    assert guest_sum == hashlib.sha256(src.read_bytes()).hexdigest()
    assert sbx.exec("stat -c %a /root/big.bin").stdout.strip() == "750"
    back = tmp_path / "back.bin"
    sbx.files.download("/root/big.bin", back)
    assert back.read_bytes() == src.read_bytes()
    sbx.exec("rm /root/big.bin")


def test_missing_file_and_directory_are_clear_errors(sbx: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(GuestFileError, match="/root/nope"):
        sbx.files.read("/root/nope")
    with pytest.raises(GuestFileError, match="not a regular file"):
        sbx.files.read("/root")
    with pytest.raises(GuestFileError):
        sbx.files.download("/root/nope", tmp_path / "x")
    assert list(tmp_path.iterdir()) == [], "a failed download left a file on the host"


def test_a_file_larger_than_max_bytes_is_refused_and_leaves_nothing(sbx: Sandbox, tmp_path: Path) -> None:
    sbx.exec("head -c 3M /dev/zero > /root/three.bin", check=True)
    with pytest.raises(GuestFileError, match="larger than 1048576 bytes"):
        sbx.files.read("/root/three.bin", max_bytes=1 << 20)
    with pytest.raises(GuestFileError, match="larger than"):
        sbx.files.download("/root/three.bin", tmp_path / "x", max_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == [], "a refused download left a file on the host"
    assert len(sbx.files.read("/root/three.bin", max_bytes=3 << 20)) == 3 << 20
    with pytest.raises(InvalidArgument, match="max_bytes must be a positive"):
        sbx.files.read("/root/three.bin", max_bytes=0)
    assert sbx.exec("rm /root/three.bin").ok, "the machine stopped answering after a refused read"


def test_relative_guest_path_is_refused(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument, match="absolute"):
        sbx.files.write("relative.txt", "x")


def test_upload_of_a_missing_host_file_is_refused(sbx: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not a file"):
        sbx.files.upload(tmp_path / "nope", "/root/x")


def test_overwrite_replaces_the_whole_file(sbx: Sandbox) -> None:
    sbx.files.write("/root/over.txt", "a long first version\n")
    sbx.files.write("/root/over.txt", "short\n")
    assert sbx.files.read_text("/root/over.txt") == "short\n"
    assert sbx.exec("ls -a /root | grep -c rewind- || true").stdout.strip() == "0", "temp file left"
