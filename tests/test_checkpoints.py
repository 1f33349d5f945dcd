"""Checkpoints of real guests: consistency of memory and disk, restore in place, new machines
from a point, forks, history that survives deletions, corruption refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import pytest
from conftest import flip_stored_byte

from rewind import Busy, Home, MachineNotRunning, Sandbox
from rewind.engine import machine as machine_module
from rewind.engine import pending, timeline
from rewind.engine.checkpoint import Caches, blob_digest
from rewind.engine.engine import Engine
from rewind.engine.process.qemu import QMP_SOCKET, guest_ram_ranges, process_alive
from rewind.engine.process.qmp import Monitor
from rewind.store import BlobIndex, CheckpointExists, CorruptChunk, open_store

# A process that keeps a count in memory and writes it to a file at each step, checking
# first that the file still holds what it last wrote. Memory and disk captured at different
# moments would break that: the restored process would find a file from another moment.
COUNTER = r"""
import os, time
count = 0
path = "/root/count"
while True:
    if os.path.exists(path):
        on_disk = int(open(path).read() or 0)
        if on_disk != count:
            open("/root/mismatch", "a").write(f"memory {count} file {on_disk}\n")
    count += 1
    with open(path + ".tmp", "w") as f:
        f.write(str(count))
    os.replace(path + ".tmp", path)
    time.sleep(0.005)
"""

# A server with state only in memory: each request returns one more than the last.
SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000)); s.listen()
hits = 0
while True:
    c, _ = s.accept(); hits += 1; c.sendall(str(hits).encode()); c.close()
"""
ASK = ("python3 -c 'import socket; "
       "s = socket.create_connection((\"127.0.0.1\", 7000)); print(s.recv(9).decode())'")


def _count(sbx: Sandbox) -> int:
    return int(sbx.files.read_text("/root/count"))


def test_memory_and_disk_agree_and_processes_come_back(home: Home) -> None:
    sbx = Sandbox.create("worker", home=home)
    sbx.files.write("/root/counter.py", COUNTER)
    sbx.files.write("/root/server.py", SERVER)
    for script in ("counter", "server"):
        sbx.exec(f"nohup python3 /root/{script}.py >/dev/null 2>&1 &")
    time.sleep(3)
    assert [sbx.exec(ASK).stdout.strip() for _ in range(3)] == ["1", "2", "3"]
    sbx.files.write("/root/project/keep.txt", "precious\n")
    before_checkpoint = _count(sbx)
    point = sbx.checkpoint(name="before-damage", labels={"step": "3"})

    assert sbx.exec(ASK).stdout.strip() == "4"
    sbx.exec("rm -rf /root/project /usr/share/doc")
    time.sleep(1)
    before_restore = _count(sbx)

    identity = sbx.exec("hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address").stdout
    pid = sbx.info().pid
    restored = sbx.restore("before-damage")
    assert restored.id == point.id
    assert sbx.status == "running" and sbx.name == "worker" and sbx.info().pid != pid
    assert sbx.exec("hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address").stdout == identity
    assert sbx.files.read_text("/root/project/keep.txt") == "precious\n"
    assert sbx.exec("ls /usr/share/doc | wc -l").stdout.strip() != "0"
    # The server kept its in-memory count from the checkpoint (3), not from later (4).
    assert sbx.exec(ASK).stdout.strip() == "4"
    # The counter went back to the checkpoint's moment and runs on from there, never having
    # seen a file from another moment.
    restored_count = _count(sbx)
    assert before_checkpoint <= restored_count < before_restore
    time.sleep(1)
    assert _count(sbx) > restored_count
    assert sbx.exec("cat /root/mismatch 2>/dev/null").stdout == ""
    assert abs(float(sbx.exec("date +%s.%N").stdout) - time.time()) < 5, "clock not set to the present"

    # The QEMU it left writes its memory out, then its committer ends it.
    left = [c for c in sbx.history() if c.labels.get("auto") == "before-restore"]
    assert not left, "the state it left is a branch of its own, not in this history"
    assert not process_alive(pid, sbx._machine.record.uuid), "the QEMU the restore left is still running"
    machine = sbx._machine
    in_use = {Path(d) for d in machine.record.disks}
    assert set(machine.disk_dir.glob("*.qcow2")) <= in_use, "layers nothing uses are left behind"
    saved = [m for m in open_store(home.store).list() if m.labels.get("auto") == "before-restore"]
    assert len(saved) == 1 and saved[0].parent == point.id
    assert not list((home.root / "cache" / "devstate").glob("*.qmp")), "its monitor socket remains"

    # The restore is undone by restoring the state it left: written out after the restore
    # returned, from the stopped QEMU, it holds that moment's disk and processes.
    sbx.restore(saved[0].id)
    assert sbx.exec("test -e /root/project").exit_code != 0
    assert sbx.exec("ls /usr/share/doc 2>/dev/null | wc -l").stdout.strip() == "0"
    assert sbx.exec(ASK).stdout.strip() == "5"


def test_history_branches_and_new_machines_from_points(home: Home) -> None:
    sbx = Sandbox.create("hist", home=home)
    ids = []
    for step in range(3):
        sbx.files.write("/root/step", str(step))
        ids.append(sbx.checkpoint(name=f"s{step}").id)
    assert [c.ref for c in sbx.history()] == ["~0", "~1", "~2"]
    assert [c.id for c in sbx.history()] == ids[::-1]
    assert sbx.history()[0].parent == ids[1]

    # Going back and saving again branches: the new point's parent is s0, not s2.
    sbx.restore("~2")
    assert sbx.files.read_text("/root/step") == "0"
    sbx.files.write("/root/step", "0b")
    branch = sbx.checkpoint(name="s0b")
    assert branch.parent == ids[0]
    assert [c.name for c in sbx.history()] == ["s0b", "s0"]

    # A new machine from a point shares it but gets its own identity.
    child = Sandbox.create("from-s2", from_checkpoint="s2", at="~1", home=home)
    assert child.files.read_text("/root/step") == "1"
    assert child.exec("hostname").stdout.strip() == "from-s2"
    assert child.exec("cat /etc/machine-id").stdout != sbx.exec("cat /etc/machine-id").stdout


def test_deleting_middle_points_keeps_the_newest_whole(home: Home) -> None:
    sbx = Sandbox.create("chain", home=home)
    for step in range(4):
        sbx.files.write("/root/step", str(step))
        sbx.checkpoint(name=f"c{step}", wait=True)  # in the store, for the store's own API below
    store = open_store(home.store)
    store.delete("c1")
    store.delete("c2")
    store.gc()
    assert store.check(read_data=True).ok
    again = Sandbox.create("again", from_checkpoint="c3", at="~2", home=home)
    assert again.files.read_text("/root/step") == "1"


def test_fork_runs_side_by_side_with_its_own_identity(home: Home) -> None:
    src = Sandbox.create("src", home=home)
    src.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    src.files.write("/root/shared", "before fork")
    child = src.fork("kid", labels={"role": "try"})
    child.files.write("/root/shared", "child wrote")
    src.files.write("/root/other", "source wrote")
    assert src.files.read_text("/root/shared") == "before fork"
    assert child.exec("cat /root/other 2>/dev/null || echo absent").stdout.strip() == "absent"
    assert child.exec("pgrep -x sleep").exit_code == 0, "the fork lost the source's processes"
    assert child.exec("hostname").stdout.strip() == "kid" and src.exec("hostname").stdout.strip() == "src"
    assert child.exec("cat /sys/class/net/eth0/address").stdout != src.exec(
        "cat /sys/class/net/eth0/address").stdout
    assert child.labels == {"role": "try"}
    assert child.info().status == "running"
    assert child._machine.record.extra["forked_from"] == "src"


def test_a_corrupt_chunk_is_found_and_refused(home: Home) -> None:
    sbx = Sandbox.create("corrupt", home=home)
    point = sbx.checkpoint(name="p", wait=True)
    store = open_store(home.store)
    manifest = store.get(point.id)
    victim = next(h for h in manifest.blobs["devstate"].chunks if h)
    flip_stored_byte(home.store, victim)
    report = store.check(read_data=True)
    assert not report.ok and any(victim in p for p in report.problems)
    for cached in (home.root / "cache" / "devstate").iterdir():
        cached.unlink()  # make the restore read from the store
    with pytest.raises(CorruptChunk):
        sbx.restore("p")
    assert sbx.status == "running" and sbx.exec("true").ok, "a refused restore harmed the machine"


def test_checkpoint_errors(home: Home) -> None:
    sbx = Sandbox.create("errs", home=home)
    with pytest.raises(LookupError):
        sbx.restore("nosuchpoint")
    with pytest.raises(LookupError):
        sbx.restore("~5")
    outcome: list[str] = []
    together = threading.Barrier(2)

    def one() -> None:
        together.wait()
        try:
            outcome.append(sbx.checkpoint().id)
        except Busy as e:
            outcome.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum("already running" in o for o in outcome) == 1, outcome
    sbx.checkpoint(name="taken")
    with pytest.raises(CheckpointExists):
        sbx.checkpoint(name="taken")
    sbx.stop()
    with pytest.raises(MachineNotRunning):
        sbx.checkpoint()


def test_two_checkpoints_given_one_name_at_once(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """Of two machines' checkpoints given one name at the same moment, one takes it and the
    other is refused; both passed the name check before, and the second commit then failed for
    good, with every store verb after it (issue 11)."""
    machines = [Sandbox.create(f"twin-{i}", home=home) for i in range(2)]
    both_capturing = threading.Barrier(2)
    real_capture = timeline.capture

    def capture_together(*args: object, **kwargs: object) -> object:
        with contextlib.suppress(threading.BrokenBarrierError):
            both_capturing.wait(timeout=2)  # broken when only one can get here: the fixed case
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(timeline, "capture", capture_together)
    outcome: list[str] = []

    def take(sbx: Sandbox) -> None:
        try:
            outcome.append(sbx.checkpoint(name="shared-name").id)
        except CheckpointExists as e:
            outcome.append(str(e))

    threads = [threading.Thread(target=take, args=(m,)) for m in machines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum("is taken" in o for o in outcome) == 1, outcome
    Engine(home).settle()  # raised "captured but not yet stored" for the loser's point
    assert [c.name for m in machines for c in m.history() if c.name] == ["shared-name"]


def test_a_killed_checkpoint_leaves_nothing_half_made(home: Home) -> None:
    """Kill `rewind checkpoint` at several moments: no half checkpoint is visible, the store
    passes its check, the machine runs on, and the next checkpoint works."""
    sbx = Sandbox.create("killme", home=home)
    sbx.checkpoint(name="base")
    for delay in (0.3, 0.8, 1.3):
        proc = subprocess.Popen([sys.executable, "-m", "rewind.cli", "checkpoint", "killme"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = open_store(home.store)
        assert store.check().ok
        assert sbx.exec("echo alive").stdout == "alive\n"
    # Killed just after stopping the guest: the next session finds it paused and resumes it.
    with Monitor(sbx._machine.path / QMP_SOCKET) as mon:
        mon.cmd("stop")
    assert sbx.exec("echo alive").stdout == "alive\n"
    sbx.files.write("/root/after", "written")
    last = sbx.checkpoint(name="after-kills")
    sbx.files.write("/root/after", "changed")
    sbx.restore(last.id)
    assert sbx.files.read_text("/root/after") == "written"
    assert open_store(home.store).check(read_data=True).ok


def test_rules_changed_during_a_checkpoint_are_kept(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """New network rules set by another handle while a checkpoint is capturing survive it (the
    checkpoint saved a record read before, and turned the internet back on)."""
    sbx = Sandbox.create("racer", home=home)
    other = Sandbox.get("racer", home=home)
    real_capture = timeline.capture

    def capture_while_rules_change(*args: object, **kwargs: object) -> object:
        changer = threading.Thread(target=other.network.off)
        changer.start()
        changer.join(timeout=60)
        assert not changer.is_alive(), "setting the rules waited for the checkpoint"
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(timeline, "capture", capture_while_rules_change)
    sbx.checkpoint()
    assert Sandbox.get("racer", home=home).network.get()["internet"] is False


def test_a_handle_follows_a_restore_made_through_another(home: Home) -> None:
    """Handles share a machine: one restores it (a new QEMU), the other's next call reaches it."""
    first = Sandbox.create("shared", home=home)
    point = first.checkpoint()
    second = Sandbox.get("shared", home=home)
    second.restore(point.id)
    Engine(home).settle()  # the QEMU the restore replaced has ended
    assert first.exec("echo here", check=True).stdout == "here\n"


def test_a_checkpoint_cut_short_after_its_capture_loses_nothing(home: Home,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint that dies after freezing the disk and journaling the point but before the
    machine's record is saved (a kill) leaves a record that is still true: the machine runs,
    writes and checkpoints again, and the point it journaled is stored."""
    sbx = Sandbox.create("cut", home=home)
    sbx.files.write("/root/before", "1")

    def killed(*_: object) -> None:
        raise KeyboardInterrupt  # as a kill would stop it

    with monkeypatch.context() as patch:
        patch.setattr(machine_module.Machine, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            sbx.checkpoint()
    sbx.files.write("/root/after", "2")
    point = sbx.checkpoint()
    sbx.exec("rm /root/before /root/after && sync", check=True)
    sbx.restore(point.id)
    assert sbx.exec("cat /root/before /root/after", check=True).stdout == "12"
    assert open_store(home.store).check(read_data=True).ok


def test_a_checkpoint_returns_when_captured_and_is_stored_later(home: Home,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    sbx = Sandbox.create("later", home=home)
    sbx.files.write("/root/f", "one")
    first = sbx.checkpoint(name="one")
    assert first.own_bytes is None  # captured; its memory is still being written and stored
    assert [c.id for c in sbx.history()] == [first.id]  # anything reading checkpoints waits for it
    assert sbx.history()[0].own_bytes > 0

    # A committer that dies (here: never starts) leaves its journal; the next reader commits it.
    monkeypatch.setattr(pending, "start_committer", lambda *_: None)
    sbx.files.write("/root/f", "two")
    second = sbx.checkpoint(name="two")
    assert list((home.root / "pending").glob("*.json")), "no journal for the pending checkpoint"
    assert [c.id for c in sbx.history()] == [second.id, first.id]
    assert not list((home.root / "pending").glob("*.json"))
    sbx.files.write("/root/f", "three")
    old_qemu = sbx.info().pid
    sbx.restore("one")  # the QEMU it leaves waits for a committer to end it: here, the next reader
    assert sbx.files.read_text("/root/f") == "one"
    assert process_alive(old_qemu, sbx._machine.record.uuid)
    sbx.history()
    assert not process_alive(old_qemu, sbx._machine.record.uuid)
    sbx.restore("two")
    assert sbx.files.read_text("/root/f") == "two"
    assert open_store(home.store).check(read_data=True).ok


def test_a_journal_left_after_its_point_was_stored_is_no_lost_point(home: Home,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A committer killed after it stored a point and removed the capture's result, before it
    removed the journal: the next reader finds the point stored, instead of waiting for a
    capture that ended long ago and calling the point lost."""
    sbx = Sandbox.create("leftover", home=home)
    monkeypatch.setattr(pending, "start_committer", lambda *_: None)
    point = sbx.checkpoint(name="kept")
    (journal,) = pending.journals(home)
    saved = journal.read_bytes()
    assert [c.id for c in sbx.history()] == [point.id]  # committed by this reader
    journal.write_bytes(saved)  # as a committer killed before its last step leaves it
    assert not Path(pending.load(journal).done).exists()
    assert pending.settle(home) == [] and not journal.exists()
    assert [c.id for c in sbx.history()] == [point.id]
    assert not pending.take_lost(home)


def test_a_restore_keeps_the_memory_image_it_starts_from(home: Home) -> None:
    """The checkpoint a restore takes of the state it leaves trims old memory images; the
    one the restore is about to start from must not be among them, however old."""
    sbx = Sandbox.create("trim", home=home)
    images = []
    for step in range(5):
        sbx.files.write("/root/step", str(step))
        images.append(home.runtime / "ram" / f"{sbx.checkpoint(name=f't{step}', wait=True).id}.ram")
    for age, image in enumerate(reversed(images)):  # made an hour ago, t0 first
        with contextlib.suppress(FileNotFoundError):
            os.utime(image, (time.time() - 3600 - age, time.time() - 3600 - age))
    sbx.restore("t1")
    assert sbx.files.read_text("/root/step") == "1"
    sbx.restore("t3")
    assert sbx.files.read_text("/root/step") == "3"


def test_guest_ram_ranges_follow_the_q35_layout() -> None:
    # populate() reads guest memory by physical address: below the PCI hole, then from 4 GiB.
    assert guest_ram_ranges(512) == [(0, 512 << 20)]
    assert guest_ram_ranges(2815) == [(0, 2815 << 20)]
    assert guest_ram_ranges(2816) == [(0, 2 << 30), (4 << 30, 768 << 20)]
    assert guest_ram_ranges(4096) == [(0, 2 << 30), (4 << 30, 2 << 30)]
    assert sum(size for _, size in guest_ram_ranges(3000)) == 3000 << 20


def test_memory_stored_by_its_changes_restores_byte_identical(home: Home) -> None:
    """A machine restored from a point maps that point's memory file; its next point stores
    only the chunks its QEMU has written since (pagemap.py) and takes the rest from the first.
    Stored so, the memory must come back byte for byte once the local copy is gone."""
    sbx = Sandbox.create("delta", home=home)
    base = sbx.checkpoint(wait=True)
    sbx.restore(base)
    sbx.exec("head -c 8M /dev/urandom > /dev/shm/pattern && sha256sum /dev/shm/pattern > /root/pattern.sum",
             check=True)
    point = sbx.checkpoint(wait=True)
    manifest = open_store(home.store).get(point.id)
    assert manifest.meta["ram_base"] == base.id  # stored by its changes alone
    caches = Caches.of(home.root, home.runtime)
    captured = caches.ram / f"{point.id}.ram"
    with captured.open("rb") as f:
        as_captured = blake3.blake3(f.read()).hexdigest()
    cached = caches.ram / f"{blob_digest(manifest.blobs['ram'])}.ram"
    assert os.path.samefile(captured, cached)
    captured.unlink()
    cached.unlink()  # no local copy left: the next machine from it unpacks the store's

    again = Sandbox.create("delta-again", from_checkpoint=point.id, home=home)
    with cached.open("rb") as f:
        assert blake3.blake3(f.read()).hexdigest() == as_captured
    assert again.exec("sha256sum -c /root/pattern.sum").ok
    # Guest memory and device state are the user's alone (issue 11: they were 0644, in a 0755 folder).
    assert home.runtime.stat().st_mode & 0o777 == 0o700
    private = [p for p in [*caches.ram.iterdir(), *caches.devstate.iterdir()] if p.is_file()]
    assert private and [(p.name, oct(p.stat().st_mode)) for p in private if p.stat().st_mode & 0o077] == []
    # The chunks the second point took from the first are the first's own.
    first = open_store(home.store).get(base.id).blobs["ram"]
    same = sum(a == b for a, b in zip(first.chunks, manifest.blobs["ram"].chunks, strict=True))
    assert same > len(first.chunks) // 2


def test_memory_stored_as_it_is_written_out_restores_byte_identical(home: Home, tmp_path: Path) -> None:
    """A machine that has written more than pagecapture's limit streams all its memory out
    (a background snapshot) and its committer stores it as it comes, up to the front the
    splitter tells, while the guest writes on (its pages then come ahead of their turn).
    Stored so, the memory is the captured image byte for byte, and runs once no local copy
    is left."""
    sbx = Sandbox.create("stream", home=home)
    sbx.exec("head -c 100M /dev/urandom > /dev/shm/pattern && sha256sum /dev/shm/pattern > /root/pattern.sum",
             check=True)
    sbx.exec("nohup sh -c 'while :; do head -c 16M /dev/urandom > /dev/shm/churn; done' >/dev/null 2>&1 &",
             check=True)
    point = sbx.checkpoint()
    (journal,) = pending.journals(home)
    assert pending.load(journal).ram_pages is None  # streamed, not captured by pages
    sbx.history()  # waits until it is stored
    sbx.exec("pkill -f churn; true")
    assert [s.followed for s in pending.read_commit_stats(home) if s.id == point.id] == [True]
    manifest = open_store(home.store).get(point.id)
    caches = Caches.of(home.root, home.runtime)
    captured = caches.ram / f"{point.id}.ram"
    stored = tmp_path / "stored.ram"
    try:
        open_store(home.store).materialize(manifest.blobs["ram"], stored)
        with captured.open("rb") as a, stored.open("rb") as b:
            assert blake3.blake3(a.read()).hexdigest() == blake3.blake3(b.read()).hexdigest()
    finally:
        stored.unlink(missing_ok=True)
    captured.unlink()
    (caches.ram / f"{blob_digest(manifest.blobs['ram'])}.ram").unlink()
    again = Sandbox.create("stream-again", from_checkpoint=point.id, home=home)
    assert again.exec("sha256sum -c /root/pattern.sum").ok


def test_a_first_checkpoint_is_stored_by_its_changes_from_the_template(home: Home) -> None:
    """A new machine maps its template's memory; its first point is stored from the chunks its
    QEMU wrote since, the rest taken from the template's memory, stored once per store.
    Stored so, the memory must come back byte for byte once the local copies are gone."""
    sbx = Sandbox.create("fresh", home=home)
    template_ram = Path(sbx._machine.record.ram)
    sbx.exec("head -c 8M /dev/urandom > /dev/shm/pattern && sha256sum /dev/shm/pattern > /root/pattern.sum",
             check=True)
    point = sbx.checkpoint(wait=True)
    store = open_store(home.store)
    ram = store.get(point.id).blobs["ram"]
    caches = Caches.of(home.root, home.runtime)
    st = template_ram.stat()
    key = caches.blobs / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{ram.chunk_size}.json"
    template = BlobIndex.from_json(json.loads(key.read_text()))  # the template's memory, stored
    assert store.has_chunks(template)
    same = sum(a == b for a, b in zip(template.chunks, ram.chunks, strict=True))
    assert same > len(template.chunks) // 2
    captured = caches.ram / f"{point.id}.ram"
    with captured.open("rb") as f:
        as_captured = blake3.blake3(f.read()).hexdigest()
    captured.unlink()
    (caches.ram / f"{blob_digest(ram)}.ram").unlink()
    again = Sandbox.create("fresh-again", from_checkpoint=point.id, home=home)
    with (caches.ram / f"{blob_digest(ram)}.ram").open("rb") as f:
        assert blake3.blake3(f.read()).hexdigest() == as_captured
    assert again.exec("sha256sum -c /root/pattern.sum").ok
