"""QEMU versions: the capture paths on the QEMU in use (10 where backports are installed), QEMU
7.2 beside it (Debian 12's own, what hosts without backports run), and points carried between
the two: forward they run, backward they are refused with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import rewind_cli

from rewind import Home, Sandbox, try_in_copy
from rewind.engine import pending
from rewind.engine.engine import Engine
from rewind.engine.process.qemu import QEMU_ENV, qemu_build
from rewind.errors import NeedsNewerQemu
from rewind.store import open_store

LEGACY_QEMU = Path(__file__).parents[1] / ".cache/qemu-7.2/usr/bin/qemu-system-x86_64"
PATTERN = "head -c {mib}M /dev/urandom > /dev/shm/p && sha256sum /dev/shm/p > /root/p.sum"


@pytest.fixture
def legacy_qemu(monkeypatch: pytest.MonkeyPatch) -> str:
    if not LEGACY_QEMU.is_file():
        pytest.fail(f"QEMU 7.2 is not unpacked at {LEGACY_QEMU}: run scripts/install")
    return str(LEGACY_QEMU)


# 1 GiB of data no page of which is zero or like another, made quicker than from /dev/urandom
# (20 s under TCG): 16 MiB of random bytes, 64 times, each copy after a line of its own. Checked
# by sums of slices across it: reading it whole took longer than the rest of the test.
GIB = ("mount -o remount,size=1100M /dev/shm && head -c 16M /dev/urandom > /root/r && "
       "for i in $(seq 64); do echo $i; cat /root/r; done > /dev/shm/big && rm /root/r")
SLICES = "for at in 0 333 666 1000; do dd if=/dev/shm/big bs=1M skip=$at count=8 2>/dev/null | md5sum; done"


def test_a_machine_with_a_gib_in_use_checkpoints_restores_and_branches(home: Home) -> None:
    """Over pagecapture's limit a checkpoint is a background snapshot: on QEMU 9 and later the
    guest stayed stopped after it, and the call waited 300 s for a RESUME that never came."""
    sbx = Sandbox.create("big", memory=1536, home=home)
    sbx.exec(GIB, check=True, timeout=300)
    sums = sbx.exec(SLICES, check=True).stdout
    point = sbx.checkpoint()
    (journal,) = pending.journals(home)
    assert pending.load(journal).ram_pages is None  # streamed, not captured by pages
    assert sbx.exec("echo on").stdout == "on\n"  # it runs on
    sbx.exec("head -c 512M /dev/zero > /dev/shm/big", check=True)  # overwritten after the point
    child = sbx.fork("big-child")
    sbx.restore(point)
    assert sbx.exec(SLICES).stdout == sums
    assert child.exec(SLICES).stdout != sums  # the fork kept the change
    assert Sandbox.create("big-again", from_checkpoint=point.id, home=home).exec(SLICES).stdout == sums


def test_plain_migrations_write_points_that_run(home: Home) -> None:
    """Past pagecapture's limit, the copy a try runs in comes from a held capture (the guest
    stays stopped while its memory is migrated) and the state a restore leaves is migrated
    after it: plain migrations (on QEMU 10 their stream has a command before RAM's last part,
    see test_migstream). Each makes a point that runs with its memory whole."""
    sbx = Sandbox.create("plain", home=home)
    sbx.exec(PATTERN.format(mib=100), check=True)
    start = sbx.checkpoint()
    sbx.exec("head -c 100M /dev/urandom > /dev/shm/q && sha256sum /dev/shm/q > /root/q.sum", check=True)
    outcome = try_in_copy(sbx, "sha256sum -c /root/p.sum /root/q.sum", diff=False)
    assert outcome.kept == "copy", outcome.log  # the copy's memory came whole
    sbx.restore(start)
    assert not sbx.exec("test -e /root/q.sum").ok
    sbx.history()  # waits until the state it left is stored
    (left,) = [m for m in open_store(home.store).list() if m.labels.get("auto") == "before-restore"]
    sbx.restore(left.id)
    assert sbx.exec("sha256sum -c /root/p.sum /root/q.sum").ok


def test_a_restored_machine_streams_a_big_checkpoint(home: Home) -> None:
    """A machine whose QEMU loaded a point (a restore, a kept copy) then wrote past pagecapture's
    limit: its background snapshot made QEMU 10.0.2 abort (qobject/json-writer.c: Assertion
    `depth' failed, in the stream's JSON description of its devices, which QEMU no longer writes:
    suppress-vmdesc), and the checkpoint failed with "QMP cont failed: Disconnected"."""
    sbx = Sandbox.create("again", home=home)
    start = sbx.checkpoint()
    sbx.restore(start)  # its QEMU now runs from a loaded state
    sbx.exec(PATTERN.format(mib=100), check=True)
    big = sbx.checkpoint()  # 100 MiB written: past the by-pages limit, so streamed
    sbx.exec("rm /dev/shm/p /root/p.sum", check=True)
    sbx.restore(big)
    assert sbx.exec("sha256sum -c /root/p.sum").ok


def test_qemu_7_2_runs_machines_and_its_points_run_on_the_qemu_in_use(
        home: Home, legacy_qemu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QEMU_ENV, legacy_qemu)
    assert qemu_build().version[:2] == (7, 2)
    old = Sandbox.create("old", home=home)  # its own template, saved by 7.2
    old.exec(PATTERN.format(mib=100), check=True)  # a background snapshot: 7.2 runs the guest on itself
    point = old.checkpoint(name="on-7.2")
    old.exec("rm /dev/shm/p", check=True)
    old.restore(point)
    assert old.exec("sha256sum -c /root/p.sum").ok
    assert Engine(home).get("old").record.board == "pc-q35-7.2"
    doctor = rewind_cli("doctor", "--json", env={QEMU_ENV: legacy_qemu})
    assert '"qemu": "7.2.' in doctor.stdout.decode()

    monkeypatch.delenv(QEMU_ENV)
    if qemu_build().version[:2] == (7, 2):
        return  # no newer QEMU on this host to carry points to
    newer = Sandbox.create("newer", from_checkpoint="on-7.2", home=home)  # loaded on its own board
    assert newer.exec("sha256sum -c /root/p.sum").ok
    assert Engine(home).get("newer").record.board == "pc-q35-7.2"
    newer.checkpoint(name="on-newer-qemu")  # still of that board: 7.2 runs it
    fresh = Sandbox.create("fresh", home=home)
    fresh.exec("echo made > /root/mark", check=True)
    fresh.checkpoint(name="fresh-point")

    monkeypatch.setenv(QEMU_ENV, legacy_qemu)
    assert Sandbox.create("back", from_checkpoint="on-newer-qemu", home=home).exec("cat /root/p.sum").ok
    with pytest.raises(NeedsNewerQemu, match=r"saved by a newer QEMU \(board pc-q35-\d+\.\d+\)"):
        Sandbox.create("refused", from_checkpoint="fresh-point", home=home)
    assert not (home.machines / "refused").exists()
    with pytest.raises(NeedsNewerQemu, match="newer QEMU"):
        fresh.restore("fresh-point")  # refused before the machine is left: it runs on
    assert fresh.exec("cat /root/mark").stdout == "made\n"
    failed = rewind_cli("create", "again", "--from", "fresh-point", env={QEMU_ENV: legacy_qemu})
    assert failed.returncode != 0
    assert failed.stderr.decode().strip().count("\n") == 0 and "newer QEMU" in failed.stderr.decode()
