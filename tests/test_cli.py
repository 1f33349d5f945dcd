"""The `rewind` command line, run as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import rewind_cli

from rewind import Home


def test_start_exec_cp_ls_stop_rm(home: Home, tmp_path: Path) -> None:
    r = rewind_cli("start", "cli-box", "--label", "who=cli", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "running"

    r = rewind_cli("exec", "cli-box", "--", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")

    r = rewind_cli("exec", "cli-box", "--cwd", "/tmp", "--env", "A=1", "--", "sh", "-c", "echo $A $PWD")
    assert r.stdout == b"1 /tmp\n"

    r = rewind_cli("exec", "cli-box", "-i", "--", "wc -c", input=b"12345")
    assert r.stdout.strip() == b"5"

    r = rewind_cli("exec", "cli-box", "--json", "--timeout", "1", "--", "sleep 10")
    assert r.returncode == 124 and json.loads(r.stdout)["timed_out"] is True

    src = tmp_path / "in.bin"
    src.write_bytes(bytes(range(256)))
    assert rewind_cli("cp", str(src), "cli-box:/root/in.bin").returncode == 0
    assert rewind_cli("cp", "cli-box:/root/in.bin", str(tmp_path / "out.bin")).returncode == 0
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()

    listed = json.loads(rewind_cli("ls", "--json").stdout)
    assert [(m["name"], m["status"], m["labels"]) for m in listed] == [("cli-box", "running", {"who": "cli"})]
    assert b"cli-box" in rewind_cli("ls").stdout

    assert rewind_cli("stop", "cli-box").returncode == 0
    assert json.loads(rewind_cli("ls", "--json").stdout)[0]["status"] == "stopped"
    assert rewind_cli("rm", "cli-box").returncode == 0
    assert json.loads(rewind_cli("ls", "--json").stdout) == []


def _one_line_error(r, *words: str) -> None:
    err = r.stderr.decode()
    assert r.returncode != 0
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_errors_are_one_line_without_traceback(home: Home) -> None:
    _one_line_error(rewind_cli("exec", "nobody", "--", "true"), "no machine named 'nobody'")
    _one_line_error(rewind_cli("start", "bad/name"), "invalid machine name")
    _one_line_error(rewind_cli("start", "tiny", "--memory", "64M"), "memory must be at least")
    _one_line_error(rewind_cli("start", "tiny", "--memory", "lots"), "not a size")
    _one_line_error(rewind_cli("cp", "a", "b"), "NAME:/absolute/path")
    _one_line_error(rewind_cli("rm", "nobody"), "no machine named")
    _one_line_error(rewind_cli("start", "x", "--label", "novalue"), "KEY=VALUE")


def test_doctor_reports_accel_qemu_and_image(home: Home) -> None:
    r = rewind_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["accel"] in ("kvm", "tcg") and report["image"] == "built"
    assert report["qemu"].startswith("QEMU emulator version")


def test_demo_runs(home: Home) -> None:
    r = rewind_cli("demo", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "Linux" in out and "first" in out and "exit 3" in out and "deleted" in out
    assert json.loads(rewind_cli("ls", "--json").stdout) == []
