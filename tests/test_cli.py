"""The `rewind` command line, run as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import rewind_cli
from test_store import forge

from rewind import Home


def test_start_exec_cp_ls_stop_rm(home: Home, tmp_path: Path) -> None:
    r = rewind_cli("start", "cli-box", "--label", "who=cli", "--label", "note=[/bold]", "--json")
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
    assert [(m["name"], m["status"], m["labels"]) for m in listed] == \
        [("cli-box", "running", {"who": "cli", "note": "[/bold]"})]
    table = rewind_cli("ls")
    assert table.returncode == 0 and b"cli-box" in table.stdout and b"note=[/bold]" in table.stdout

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
    _one_line_error(rewind_cli("log", "~" + "9" * 5000), "reference of 5001 characters names nothing")


def test_doctor_reports_accel_qemu_and_image(home: Home) -> None:
    r = rewind_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["accel"] in ("kvm", "tcg") and report["image"] == "built"
    assert re.fullmatch(r"\d+\.\d+\.\d+", report["qemu"]) and report["qemu_board"].startswith("pc-q35-")
    assert report["merged_layers"] == {"files": 0, "mib": 0.0}  # a new home


def test_demo_runs(home: Home) -> None:
    r = rewind_cli("demo", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "Linux" in out and "first" in out and "exit 3" in out and "deleted" in out
    # The work and the process's count come back; the failed try and the guarded edit leave no trace.
    assert "the plan\n2\n" in out and "the original is kept" in out
    assert "$ cat /work/notes.txt\nthe plan\n" in out
    assert json.loads(rewind_cli("ls", "--json").stdout) == []


def test_checkpoint_verbs(home: Home, tmp_path: Path) -> None:
    assert rewind_cli("start", "ck").returncode == 0
    rewind_cli("exec", "ck", "--", "echo one > /root/v")
    r = rewind_cli("checkpoint", "ck", "--name", "one", "-o", str(tmp_path / "one.ckpt"), "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["name"] == "one" and first["pause_ms"] >= 0 and first["own_bytes"] is None
    rewind_cli("exec", "ck", "--", "echo two > /root/v")
    assert rewind_cli("checkpoint", "ck", "--name", "two", "--label", "k=v").returncode == 0

    log = json.loads(rewind_cli("log", "ck", "--json").stdout)
    assert [(p["ref"], p["name"]) for p in log] == [("~0", "two"), ("~1", "one")]
    from_file = json.loads(rewind_cli("log", str(tmp_path / "one.ckpt"), "--json").stdout)
    assert [p["name"] for p in from_file] == ["one"]

    assert rewind_cli("restore", "ck", "~1").returncode == 0
    assert rewind_cli("exec", "ck", "--", "cat /root/v").stdout == b"one\n"
    assert rewind_cli("create", "copy", "--from", str(tmp_path / "one.ckpt")).returncode == 0
    assert rewind_cli("exec", "copy", "--", "cat /root/v; hostname").stdout == b"one\ncopy\n"
    r = rewind_cli("branch", "ck", "kid", "--count", "2", "--json")
    assert [m["name"] for m in json.loads(r.stdout)] == ["kid-1", "kid-2"]

    check = json.loads(rewind_cli("store", "check", "--read-data", "--json").stdout)
    assert check["ok"] and check["checkpoints"] >= 3
    export = tmp_path / "two.rwx"
    assert rewind_cli("export", "two", str(export)).returncode == 0
    other = tmp_path / "other-store"
    r = rewind_cli("import", str(export), "--store", str(other), "--json")
    assert json.loads(r.stdout)["name"] == "two"
    assert rewind_cli("create", "imported", "--from", "two", "--store", str(other)).returncode == 0
    assert rewind_cli("exec", "imported", "--", "cat /root/v").stdout == b"two\n"
    # A file's own network rules are not taken: a machine from an imported point starts offline.
    rules = json.loads(rewind_cli("network", "imported", "--json").stdout)
    assert rules["internet"] is False and rules["allow"] == []

    def grant_host_and_huge_memory(manifest: dict) -> None:
        manifest["id"], manifest["name"] = "f" * 32, "forged"
        manifest["meta"]["network"] = {"internet": True, "allow": ["127.0.0.1"], "deny": []}
        manifest["meta"]["memory_mib"] = 1 << 30
    forged = tmp_path / "forged.rwx"
    forged.write_bytes(export.read_bytes())
    forge(forged, grant_host_and_huge_memory)
    _one_line_error(rewind_cli("import", str(forged), "--store", str(other)), "signature", "does not match")
    # Unsigned, such a file is taken only when asked to, and what it says of itself still checked.
    forge(forged, lambda manifest: manifest.pop("signature"))
    _one_line_error(rewind_cli("import", str(forged), "--store", str(other)), "unsigned", "--allow-unsigned")
    assert rewind_cli("import", str(forged), "--store", str(other), "--allow-unsigned").returncode == 0
    _one_line_error(rewind_cli("create", "forged", "--from", "forged", "--store", str(other)), "unsigned")
    _one_line_error(rewind_cli("create", "forged", "--from", "forged", "--store", str(other),
                               "--allow-unsigned"), "cannot run", "memory")

    damaged = tmp_path / "damaged.rwx"
    data = bytearray(export.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    _one_line_error(rewind_cli("import", str(damaged), "--store", str(tmp_path / "third")), "damaged")
    _one_line_error(rewind_cli("restore", "ck", "~9"), "~9")
    _one_line_error(rewind_cli("log", "nobody"), "nobody")
    assert rewind_cli("prune", "--keep-last", "1").returncode == 0
    assert rewind_cli("gc", "--json").returncode == 0
    assert json.loads(rewind_cli("store", "check", "--json").stdout)["ok"]
