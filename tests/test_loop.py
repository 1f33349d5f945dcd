"""The agent's loop: points usable the moment they are captured, stored by what changed."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from invariants import unrecorded_processes
from test_checkpoints import ASK, SERVER

from rewind import Home, Sandbox, try_in_copy
from rewind.engine import pending, timeline
from rewind.engine.engine import Engine
from rewind.engine.memory import pagecapture, prefault, ramcache, snapshot
from rewind.engine.memory.migstream import has_configuration
from rewind.engine.process.qemu import PID_FILE, process_alive, qemu_build
from rewind.errors import NotFound
from rewind.store import open_store

# 16 MiB in the guest's memory (a file on its tmpfs), every byte known from a seed.
PATTERN = ("python3 -c 'import hashlib,sys; s=sys.argv[1].encode(); "
           "open(\"/dev/shm/pattern\",\"r+b\" if sys.argv[2]==\"part\" else \"wb\").write(b\"\".join("
           "hashlib.sha256(s+i.to_bytes(4,\"big\")).digest() for i in range(1<<19 if sys.argv[2]==\"all\" "
           "else 1<<15)))' ")


def _expected(seed: str, part_seed: str | None = None) -> str:
    blocks = [hashlib.sha256(seed.encode() + i.to_bytes(4, "big")).digest() for i in range(1 << 19)]
    if part_seed is not None:
        blocks[:1 << 15] = [hashlib.sha256(part_seed.encode() + i.to_bytes(4, "big")).digest()
                            for i in range(1 << 15)]
    return hashlib.sha256(b"".join(blocks)).hexdigest()


def test_a_point_stored_by_its_changes_restores_identical_memory(home: Home) -> None:
    """The second point is stored by the chunks that differ from the first; after every local
    copy is dropped, its memory comes back from the store byte for byte."""
    sbx = Sandbox.create("pattern", home=home)
    sbx.exec(PATTERN + "one all", check=True, timeout=120)
    first = sbx.checkpoint(wait=True)
    sbx.exec(PATTERN + "two part", check=True, timeout=120)  # 1 MiB of the 16 rewritten
    second = sbx.checkpoint(wait=True)
    assert second.own_bytes < 24 << 20, "the second point stored more than what changed"
    ram = home.runtime / "ram" / f"{second.id}.ram"
    captured = hashlib.sha256(ram.read_bytes()).hexdigest()
    sbx.delete()

    shutil.rmtree(home.runtime / "ram")  # every memory image on this host
    shutil.rmtree(home.root / "cache")
    store = open_store(home.store)
    store.materialize(store.get(second.id).blobs["ram"], home.root / "from-store.ram")
    assert hashlib.sha256((home.root / "from-store.ram").read_bytes()).hexdigest() == captured
    (home.root / "from-store.ram").unlink()
    again = Sandbox.create("again", home=home, from_checkpoint=second)  # a Checkpoint, as returned
    got = again.exec("sha256sum /dev/shm/pattern", check=True, timeout=60).stdout.split()[0]
    assert got == _expected("one", "two")
    assert first.id in [c.id for c in again.history()]


def test_a_try_copies_a_restored_machine_by_the_pages_it_wrote(home: Home) -> None:
    """A try's copy of a machine that maps a point's memory file is captured without a
    migration: QEMU saves its devices alone and the pages its guest wrote since are copied
    over the file (snapshot.capture's `over`). The copy runs that memory byte for byte, and
    its point comes back from the store once every local copy is gone."""
    sbx = Sandbox.create("copied", home=home)
    sbx.exec(PATTERN + "one all", check=True, timeout=120)
    sbx.restore(sbx.checkpoint(wait=True))
    sbx.exec(PATTERN + "two part", check=True, timeout=120)  # written since: in no file yet
    sbx.files.write("/root/server.py", SERVER)
    sbx.exec("nohup python3 /root/server.py >/dev/null 2>&1 &")
    assert sbx.exec(ASK + " || (sleep 2; " + ASK + ")").stdout.split()[-1] == "1"

    outcome = try_in_copy(sbx, f"sha256sum /dev/shm/pattern && {ASK}", verify="true")
    assert outcome.passed, outcome.reason
    assert outcome.log.split()[0] == _expected("one", "two") and outcome.log.split()[-1] == "2"
    assert sbx.exec(ASK).stdout.strip() == "3"  # the kept copy's server, where the step left it
    point = next(c for c in sbx.history() if c.labels.get("auto") == "fork")
    store = open_store(home.store)
    store.materialize(store.get(point.id).blobs["devstate"], home.root / "devstate")
    assert not has_configuration(home.root / "devstate"), "the copy was migrated, not copied"
    sbx.delete()

    shutil.rmtree(home.runtime / "ram")  # every memory image on this host
    shutil.rmtree(home.root / "cache")
    again = Sandbox.create("again", home=home, from_checkpoint=point)
    assert again.exec("sha256sum /dev/shm/pattern", check=True).stdout.split()[0] == _expected("one", "two")
    assert again.exec(ASK).stdout.strip() == "2"


@pytest.mark.slow  # over 30 s here
def test_a_point_runs_before_its_image_is_filled(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture by pages copies the pages the guest wrote into the point's image; the rest
    is filled from the file QEMU maps, later. With every fill held back, a restore and a
    try's copy run the point from that file with the pages loaded over it: the memory and
    the processes are the point's. Once filled, those points and the next one (from a QEMU
    so started) are stored, and come back byte for byte from the store alone."""
    go, fills = threading.Event(), []
    fill_detached = pagecapture.PageImage.fill_detached

    def fill_later(image: pagecapture.PageImage) -> None:
        later = copy.copy(image)  # with descriptors of its own: the capture closes its ones
        later._base, later._ram, later._lock = (os.dup(fd) for fd in (image._base, image._ram, image._lock))

        def fill() -> None:
            go.wait(60)  # without the overlay, a restore would wait for this fill
            fill_detached(later)
            later.close()
        fills.append(threading.Thread(target=fill))
        fills[-1].start()
    monkeypatch.setattr(pagecapture.PageImage, "fill_detached", fill_later)
    # Python's start reads tens of MiB into the guest's page cache: captured by pages all the same.
    monkeypatch.setattr(timeline, "WRITTEN_LIMIT", 256 << 20)
    monkeypatch.setattr(pending, "WRITTEN_LIMIT", 256 << 20)
    sbx = Sandbox.create("overlaid", home=home)
    sbx.files.write("/root/server.py", SERVER)
    sbx.exec("nohup python3 /root/server.py >/dev/null 2>&1 &")
    assert sbx.exec(ASK + " || (sleep 2; " + ASK + ")").stdout.split()[-1] == "1"
    try:
        sbx.exec(PATTERN + "one all", check=True, timeout=120)
        point = sbx.checkpoint()
        sbx.exec(PATTERN + "two all", check=True, timeout=120)
        assert sbx.exec(ASK).stdout.strip() == "2"
        sbx.restore(point.id)
        (journal,) = [p for p in pending.captured(home) if p.id == point.id]
        assert not Path(journal.done).exists(), "the point's image was filled before the restore"
        assert sbx._machine.record.ram_point != point.id  # it runs over the file its pages were written over
        assert sbx.exec("sha256sum /dev/shm/pattern", check=True).stdout.split()[0] == _expected("one")
        assert sbx.exec(ASK).stdout.strip() == "2"
        outcome = try_in_copy(sbx, f"sha256sum /dev/shm/pattern && {ASK}", verify="true")
        assert outcome.passed, outcome.reason
        assert outcome.log.split()[0] == _expected("one") and outcome.log.split()[-1] == "3"
    finally:
        go.set()
        for thread in fills:
            thread.join()
    assert sbx.exec(ASK).stdout.strip() == "4"  # the kept copy's server
    last = sbx.checkpoint(wait=True)
    assert open_store(home.store).check(read_data=True).ok
    sbx.delete()

    shutil.rmtree(home.runtime / "ram")  # every memory image on this host
    shutil.rmtree(home.root / "cache")
    for ref, count in ((point.id, "2"), (last.id, "5")):
        again = Sandbox.create(f"again-{count}", home=home, from_checkpoint=ref)
        assert again.exec("sha256sum /dev/shm/pattern", check=True).stdout.split()[0] == _expected("one")
        assert again.exec(ASK).stdout.strip() == count
        again.delete()


def test_a_point_is_usable_before_it_is_stored(home: Home, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """With no committer at all, a point restores in place, makes a new machine and is
    counted back from; the next reader stores it. A point whose captured files vanish
    (a host restart empties tmpfs) is reported lost once, and nothing else breaks."""
    monkeypatch.setattr(pending, "start_committer", lambda *_: None)
    sbx = Sandbox.create("early", home=home)
    sbx.files.write("/root/server.py", SERVER)
    sbx.exec("nohup python3 /root/server.py >/dev/null 2>&1 &")
    assert sbx.exec(ASK + " || (sleep 2; " + ASK + ")").stdout.split()[-1] == "1"
    sbx.files.write("/root/f", "one")
    one = sbx.checkpoint(name="one")
    sbx.files.write("/root/f", "two")
    two = sbx.checkpoint()
    assert sbx.exec(ASK).stdout.strip() == "2"
    sbx.exec("rm -f /root/f")

    journals = pending.journals(home)
    assert len(journals) == 2
    sbx.restore(two.id)
    assert sbx.files.read_text("/root/f") == "two"
    assert sbx.exec(ASK).stdout.strip() == "2"  # the server's memory is that of the point
    sbx.restore("~1")  # counted back through pending points
    assert sbx.files.read_text("/root/f") == "one"
    assert all(j.exists() for j in journals), "a restore waited for points to be stored"
    child = Sandbox.create("early-child", home=home, from_checkpoint="one")
    assert child.files.read_text("/root/f") == "one"
    assert child.exec(ASK).stdout.strip() == "2"
    assert child._machine.record.parent == one.id

    # The next reader stores them all; the restores' own points too.
    names = [c.name for c in sbx.history()]
    assert names[-1] == "one" and not pending.journals(home)
    assert open_store(home.store).check(read_data=True).ok

    # A capture whose files are gone before it is stored: lost, said once, the rest intact.
    sbx.files.write("/root/f", "three")
    three = sbx.checkpoint()
    assert pending.journals(home)  # still pending
    (home.runtime / "ram" / f"{three.id}.ram").unlink()
    with caplog.at_level(logging.WARNING, logger="rewind"):
        sbx.history()
        sbx.history()
    lost = [r.message for r in caplog.records if "was lost" in r.message]
    assert len(lost) == 1 and three.id[:12] in lost[0]
    assert not pending.journals(home)
    assert sbx.files.read_text("/root/f") == "three" and sbx.exec("true").ok
    sbx.restore("one")
    assert sbx.files.read_text("/root/f") == "one"


def test_a_restore_whose_point_cannot_run_leaves_the_machine_as_it_was(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore stops the guest and captures the state it leaves before it waits for a
    point not yet stored. If that point cannot run after all (its memory image is gone), the
    error is said and the machine runs on from the state it was in, that capture its parent."""
    monkeypatch.setattr(pending, "start_committer", lambda *_: None)
    sbx = Sandbox.create("survivor", home=home)
    sbx.files.write("/root/f", "one")
    one = sbx.checkpoint()
    sbx.files.write("/root/f", "two")
    sbx.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    # Once written out: an image taken while still being written is a lost capture instead.
    next(p for p in pending.captured(home) if p.id == one.id).wait_written()
    (home.runtime / "ram" / f"{one.id}.ram").unlink()
    with pytest.raises(NotFound, match=rf"from checkpoint {one.id[:12]}: its file .*\.ram is gone"):
        sbx.restore(one)
    assert sbx.files.read_text("/root/f") == "two"
    assert sbx.exec("pgrep -x sleep").exit_code == 0  # its processes too: the state it was in
    left = sbx._machine.record.parent
    assert left not in (None, one.id)
    assert sbx.history()[0].id == left  # `one` itself is reported lost: its image is gone
    assert not sbx._machine.stray_starts() and not unrecorded_processes(home)


def test_a_next_qemu_left_by_a_killed_restore_is_ended(home: Home) -> None:
    """A restore starts the next QEMU while it captures the state the machine leaves. Killed
    before it adopts that QEMU, it leaves it running in a folder of its own: the next command
    on the machine ends it, and the machine runs on."""
    sbx = Sandbox.create("orphan", home=home)
    point = sbx.checkpoint()
    machine = sbx._machine
    located = Engine(home).find_point(open_store(home.store), point.id)
    machine.next_qemu(located.state)  # never adopted: as a killed restore leaves it
    (folder,) = machine.stray_starts()
    pid = int((folder / PID_FILE).read_text())
    assert process_alive(pid, machine.record.uuid)
    assert sbx.exec("echo alive").stdout == "alive\n"
    assert not machine.stray_starts() and not process_alive(pid, machine.record.uuid)
    assert not unrecorded_processes(home)


def _image_mib(home: Home) -> float:
    return ramcache.usage(home.runtime / "ram").bytes / (1 << 20)


def test_memory_images_stay_within_their_budget(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """Images no machine runs on and whose point is stored are released past the budget and
    brought back from the store when needed; with no machine left, only the template stays."""
    # Room for one image beside the running one: images hold their non-zero pages, 0.1-0.2 GiB.
    monkeypatch.setenv(ramcache.BUDGET_ENV, "200")
    monkeypatch.setattr(ramcache, "GRACE_S", 0.0)
    sbx = Sandbox.create("budget", home=home)
    points = []
    for step in range(4):
        sbx.files.write("/root/step", str(step))
        points.append(sbx.checkpoint(wait=True).id)
        pending.trim_images(home)
        running = os.stat(sbx._machine.record.ram).st_ino
        others = sum(i.size for ino, i in ramcache._images(home.runtime / "ram").items() if ino != running)
        assert others <= 200 << 20, f"{others >> 20} MiB of images beyond the one in use"
    assert not (home.runtime / "ram" / f"{points[0]}.ram").exists(), "the oldest image was kept"
    sbx.restore(points[0])  # brought back from the store
    assert sbx.files.read_text("/root/step") == "0"
    # Images just used stay within the budget, not once the home's last machine is gone.
    monkeypatch.setattr(ramcache, "GRACE_S", 60.0)
    sbx.delete()
    Engine(home).settle()  # the restore's own point, then the committer releases it too
    templates = sum(p.stat().st_blocks * 512 for p in (home.runtime / "ram").glob("template-*.ram"))
    assert ramcache.usage(home.runtime / "ram").bytes == templates


def test_a_start_whose_image_is_released_meanwhile_brings_it_back(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image picked for a start can be released before the start holds it (a trim with
    no machine left in the home, in another process): the start picks it again, from the
    store."""
    sbx = Sandbox.create("picked", home=home)
    sbx.files.write("/root/step", "picked")
    point = sbx.checkpoint(wait=True)
    hold = ramcache.starting
    released = []

    def released_first(image: Path):  # as a release between the pick and the hold does
        if not released and image.parent == home.runtime / "ram":
            image.unlink()
            released.append(image)
        return hold(image)
    monkeypatch.setattr(ramcache, "starting", released_first)
    copy_ = Sandbox.create(from_checkpoint=point, name="again", home=home)
    assert released and released[0].exists(), "the image was not brought back"
    assert copy_.files.read_text("/root/step") == "picked"
    copy_.delete()
    sbx.delete()


@pytest.fixture
def small_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=420m", "tmpfs", str(mount)],
                      capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    monkeypatch.setenv("REWIND_RUNTIME", str(mount))
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_short_tmpfs_is_a_clear_error_before_any_work(small_tmpfs: Path, home: Home) -> None:
    sbx = Sandbox.create("short", home=Home(root=home.root, images=home.images))
    assert sbx._machine.home.runtime == small_tmpfs
    with pytest.raises(ramcache.NoRoom, match=r"needs up to \d+ MiB"):
        sbx.checkpoint()
    assert sbx.exec("echo alive").stdout == "alive\n", "the machine did not survive the refusal"
    assert not pending.journals(home)
    sbx.delete()


def _mapped_pages(pid: int, memory_mib: int) -> int:
    """How many pages of QEMU `pid`'s guest memory are in its page tables (pagemap bit 63)."""
    start = prefault.guest_ram_mapping(pid, memory_mib << 20)
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        pagemap.seek(start // prefault.PAGE * 8)
        entries = array("Q", pagemap.read((memory_mib << 20) // prefault.PAGE * 8))
    return sum(entry >> 63 for entry in entries)


def _populated_by(machine_dir: Path) -> str | None:
    marker = machine_dir / "populated"  # the PID of the QEMU whose memory was all mapped
    return marker.read_text() if marker.exists() else None


@pytest.mark.parametrize("how", ["by-pages", "unpopulated", "prefault", "through-qemu"])
def test_a_restored_machine_is_captured_without_reading_all_its_memory(
        home: Home, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A restored machine maps its point's memory file: its next checkpoint copies the pages
    it wrote (pagecapture.py) and maps nothing else. One that wrote more than WRITTEN_LIMIT
    is migrated by a background snapshot instead, once all its memory is mapped: by QEMU in
    the pause where that is quick (snapshot.populates_itself), else first from outside QEMU,
    or through QEMU where this process may not read QEMU's memory. The server's memory comes
    through either way."""
    if how != "by-pages":
        monkeypatch.setattr(timeline, "WRITTEN_LIMIT", 0)
    if how == "unpopulated" and not snapshot.populates_itself(qemu_build().version):
        pytest.skip(f"QEMU {qemu_build().version_text} needs memory mapped before its snapshot")
    if how in ("prefault", "through-qemu"):  # as on QEMU 7.2, or a kernel before 6.4
        monkeypatch.setattr(snapshot, "populates_itself", lambda _version: False)
    if how == "through-qemu":
        def refused(pid: int, _memory_mib: int) -> None:
            raise PermissionError(1, f"cannot read the memory of process {pid}")
        monkeypatch.setattr(prefault, "fault_in_guest_ram", refused)
    sbx = Sandbox.create("captured", home=home)
    sbx.files.write("/root/server.py", SERVER)
    sbx.exec("nohup python3 /root/server.py >/dev/null 2>&1 &")
    first = sbx.exec(f"for i in $(seq 100); do {ASK} && exit; sleep 0.1; done", check=True)  # once it listens
    assert first.stdout.split()[-1] == "1"
    sbx.restore(sbx.checkpoint().id)
    machine = sbx._machine
    pid, memory_mib = machine.record.pid, machine.record.memory_mib
    assert pid is not None
    again = sbx.checkpoint()
    all_pages = (memory_mib << 20) // prefault.PAGE
    if how == "by-pages":
        assert _populated_by(machine.disk_dir) is None and _mapped_pages(pid, memory_mib) < all_pages // 2
    elif how == "unpopulated":  # QEMU's own doing
        assert _populated_by(machine.disk_dir) is None and _mapped_pages(pid, memory_mib) == all_pages
    else:
        assert _populated_by(machine.disk_dir) == str(pid) and _mapped_pages(pid, memory_mib) == all_pages
    assert sbx.exec(ASK, check=True).stdout.strip() == "2"
    sbx.restore(again.id)
    assert sbx.exec(ASK, check=True).stdout.strip() == "2"
