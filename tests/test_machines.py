"""Machine lifecycle: identity, settings, listing, stop/start, deletion, death, locks."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until

from rewind import (
    AgentError,
    AgentGone,
    Busy,
    Home,
    ImageError,
    InvalidArgument,
    MachineDied,
    MachineNotRunning,
    NotFound,
    RewindError,
    Sandbox,
)
from rewind.engine import machine as machine_module
from rewind.engine.engine import Engine
from rewind.engine.memory.memfiles import private_runtime
from rewind.engine.process.qemu import process_alive
from rewind.image import find_image, import_image


def _identity(sbx: Sandbox) -> list[str]:
    out = sbx.exec("hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address").stdout
    return out.split()


def _vmgenid(sbx: Sandbox) -> str:
    with sbx._machine.monitor() as mon:
        return mon.cmd("query-vm-generation-id")["guid"]


def test_two_machines_get_their_own_identity(home: Home) -> None:
    a = Sandbox.create("alpha", home=home)
    b = Sandbox.create("beta", home=home)
    ida, idb = _identity(a), _identity(b)
    assert ida[0] == "alpha" and idb[0] == "beta"
    assert ida[1] != idb[1], "machine-id is shared"
    assert ida[2] != idb[2], "MAC address is shared"
    assert a.exec("cat /etc/hostname").stdout.strip() == "alpha"
    assert _vmgenid(a) != _vmgenid(b)
    # Both started from the same saved state, yet their random generators differ.
    assert a.exec("head -c 16 /dev/urandom | od -An -tx1").stdout != \
        b.exec("head -c 16 /dev/urandom | od -An -tx1").stdout


def test_clock_is_the_present(home: Home) -> None:
    sbx = Sandbox.create(home=home)
    guest = float(sbx.exec("date +%s.%N").stdout)
    assert abs(guest - time.time()) < 5


def test_labels_and_list(home: Home) -> None:
    Sandbox.create("one", labels={"team": "a"}, home=home)
    Sandbox.create("two", labels={"team": "b"}, home=home)
    assert [s.name for s in Sandbox.list(home=home)] == ["one", "two"]
    assert [s.name for s in Sandbox.list({"team": "b"}, home=home)] == ["two"]
    assert Sandbox.get("one", home=home).labels == {"team": "a"}


def test_labels_are_added_changed_and_removed(sbx: Sandbox) -> None:
    """Also run through the daemon (test_connect)."""
    before = sbx.labels
    assert sbx.set_labels({"stage": "draft", "owner": "me"}) == {**before, "stage": "draft", "owner": "me"}
    assert sbx.set_labels({"stage": "final", "owner": None}) == {**before, "stage": "final"}
    assert sbx.labels == {**before, "stage": "final"}
    with pytest.raises(InvalidArgument, match="label key"):
        sbx.set_labels({"bad key": "x"})
    assert sbx.set_labels({"stage": None}) == before


def test_memory_cpus_and_disk_are_settable(home: Home) -> None:
    sbx = Sandbox.create("sized", memory=384, cpus=1, disk=10240, home=home)
    assert sbx.exec("nproc").stdout.strip() == "1"
    mem_kib = int(sbx.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    assert 300 * 1024 < mem_kib <= 384 * 1024
    size_kib = int(sbx.exec("df -k --output=size / | tail -1").stdout)
    assert size_kib > 9 * 1024 * 1024, "the root file system did not grow to the disk's size"


def test_context_manager_deletes_the_machine(home: Home) -> None:
    with Sandbox.create("temp", home=home) as sbx:
        pid = sbx.info().pid
        assert sbx.exec("true").ok
    assert not (home.machines / "temp").exists()
    assert pid is not None and not process_alive(pid, sbx._machine.record.uuid)


def test_stop_keeps_files_and_start_boots_again(home: Home) -> None:
    sbx = Sandbox.create("sleeper", home=home)
    sbx.files.write("/root/keep.txt", "still here\n")
    pid = sbx.info().pid
    sbx.stop()
    assert sbx.status == "stopped"
    assert not process_alive(pid, sbx._machine.record.uuid)
    assert not list((home.machines / "sleeper").glob("*.sock")), "stale sockets after stop"
    with pytest.raises(MachineNotRunning, match="stopped"):
        sbx.exec("true")
    sbx.start()
    assert sbx.status == "running"
    assert sbx.files.read_text("/root/keep.txt") == "still here\n"
    assert _identity(sbx)[0] == "sleeper"


def test_delete_leaves_no_process_or_file(home: Home) -> None:
    sbx = Sandbox.create("gone", home=home)
    pid, tag = sbx.info().pid, sbx._machine.record.uuid
    sbx.delete()
    assert not process_alive(pid, tag)
    assert not (home.machines / "gone").exists()
    with pytest.raises(NotFound):
        Sandbox.get("gone", home=home)


def test_killed_qemu_is_reported_dead(home: Home) -> None:
    sbx = Sandbox.create("victim", home=home)
    os.kill(sbx.info().pid, signal.SIGKILL)
    wait_until(lambda: sbx.status == "dead", "the machine reported dead", timeout=10)
    assert [i.status for i in (s.info() for s in Sandbox.list(home=home))] == ["dead"]
    with pytest.raises(MachineDied, match="dead"):
        sbx.exec("true")
    sbx.delete()
    assert not (home.machines / "victim").exists()


def test_guest_power_off_is_noticed(home: Home) -> None:
    sbx = Sandbox.create("poweroff", home=home)
    with pytest.raises(MachineDied):
        sbx.exec("sync; busybox poweroff -f")
    assert sbx.status == "dead"


def test_killed_agent_is_a_clean_error_and_comes_back(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    from rewind.engine import agent as agent_module

    monkeypatch.setattr(agent_module, "HEARTBEAT_GRACE", 3.0)
    sbx = Sandbox.create("agentless", home=home)
    with pytest.raises(AgentGone):
        sbx.exec("kill -9 $(pgrep -f rewind/agent.py)")
    assert sbx.status == "running"
    # busybox init restarts the agent; the machine is usable again.
    assert sbx.exec("echo back").stdout == "back\n"


def test_concurrent_commands_on_one_machine(home: Home) -> None:
    sbx = Sandbox.create("busy", home=home)
    results: list[str] = []

    def run(i: int) -> None:
        results.append(sbx.exec(f"sleep 1; echo {i}").stdout.strip())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["0", "1", "2"]
    assert time.monotonic() - started < 2.9, "commands were serialised instead of run side by side"


def test_stop_waits_for_a_running_command_or_fails_clearly(home: Home,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sbx = Sandbox.create("locked", home=home)
    outcome: dict[str, object] = {}
    t = threading.Thread(target=lambda: outcome.update(r=sbx.exec("sleep 3; echo done")))
    t.start()
    time.sleep(1.0)
    monkeypatch.setattr(machine_module, "LOCK_TIMEOUT", 0.5)
    with pytest.raises(Busy, match="busy"):
        sbx.stop()
    assert sbx.status == "running"
    monkeypatch.setattr(machine_module, "LOCK_TIMEOUT", 30.0)
    sbx.stop()  # waits for the command to finish, then stops
    t.join()
    assert outcome["r"].stdout == "done\n"
    assert sbx.status == "stopped"


def test_an_imported_image_runs(home: Home, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own image (here, the default one's files given back as if they were the user's)."""
    base = find_image(home.images)
    mine = import_image(tmp_path / "images", "mine", base.kernel, base.initrd, base.disk, base.runtime_disk)
    assert mine.disk_size_mib == base.disk_size_mib
    monkeypatch.setenv("REWIND_ACCEL", Engine(home).accel().accel)  # no default image there to probe with
    own_home = Home(root=home.root, images=tmp_path / "images")
    sbx = Sandbox.create("custom", image="mine", home=own_home)
    assert sbx.exec("cat /etc/hostname").stdout == "custom\n"
    assert sbx._machine.record.image_id == "mine"
    with pytest.raises(ImageError, match="no image named 'other'"):
        Sandbox.create("nope", image="other", home=own_home)


def test_a_runtime_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    """/dev/shm/rewind-<hash> is a predictable name: another local user could make it first."""
    ours = private_runtime(tmp_path / "ours")
    assert ours.stat().st_mode & 0o777 == 0o700
    os.chmod(ours, 0o755)
    assert private_runtime(ours).stat().st_mode & 0o777 == 0o700  # made private again
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(RewindError, match="not a folder of this user's"):
        private_runtime(theirs)
    (tmp_path / "link").symlink_to(ours)
    with pytest.raises(RewindError, match="not a folder of this user's"):
        private_runtime(tmp_path / "link")


def test_a_guest_agent_that_cannot_restart_is_reported_at_once(home: Home) -> None:
    """A step that hides the agent's runtime disk (root can unmount it) leaves the running
    agent answering; once its processes end, init cannot restart it. The next command says so
    within seconds (not after the 30 s connect timeout) and points to restore, which brings
    the machine back."""
    sbx = Sandbox.create("agentless", home=home)
    sbx.checkpoint()
    sbx.exec("umount -l /usr/lib/rewind && "
             "setsid sh -c 'sleep 0.3; pkill -KILL -f /usr/lib/rewind/agent.py' </dev/null >/dev/null 2>&1 &",
             check=True)
    deadline = time.monotonic() + 30
    with pytest.raises(AgentGone):  # the agent is killed a moment after that exec returned
        while time.monotonic() < deadline:
            started = time.monotonic()
            sbx.exec("true")
    assert time.monotonic() - started < 10  # even a request it was serving when it went
    started = time.monotonic()
    with pytest.raises(AgentGone, match=r"not running.*rewind restore agentless ~0"):
        sbx.exec("true")
    assert time.monotonic() - started < 10
    sbx.restore("~0")
    assert sbx.exec("test -f /usr/lib/rewind/agent.py && echo back").stdout == "back\n"


def test_the_agent_restarts_with_the_guests_python_and_libc_gone(home: Home) -> None:
    """Agents break the guest's Python and libraries all the time. The agent runs from its
    own read-only disk: a step cannot change it, and with the guest's python3 and libc removed
    and every agent process killed, init starts the agent again and it answers."""
    sbx = Sandbox.create("pythonless", home=home)
    sbx.checkpoint()
    touched = sbx.exec("touch /usr/lib/rewind/agent.py")
    assert touched.exit_code != 0 and "Read-only file system" in touched.stderr
    # agent[.]py: a pattern that does not match the shell's own command line, or pkill ends it first
    sbx.exec("rm -rf /usr/lib/python3* /usr/bin/python3* && setsid sh -c "
             "'sleep 0.3; pkill -KILL -f /usr/lib/rewind/agent[.]py; rm /usr/lib/x86_64-linux-gnu/libc.so.6' "
             "</dev/null >/dev/null 2>&1 &", check=True)

    def libc_gone() -> bool:  # it goes after the agent was killed: whoever answers, restarted
        with contextlib.suppress(AgentError):
            return sbx.exec("true").exit_code == 127  # the guest's own programs cannot load
        return False

    wait_until(libc_gone, "the agent coming back", every=0)
    assert sbx.files.read_text("/etc/hostname") == "pythonless\n"
    sbx.restore("~0")
    assert sbx.exec("python3 -c 'print(6 * 7)'").stdout == "42\n"


def test_what_a_guest_prints_on_its_console_is_kept_bounded(sbx: Sandbox) -> None:
    """Root in the guest writing to the serial console without end fills at most console.log
    and console.log.1, each under the bound; the newest output is in console.log."""
    from rewind.engine.network import packetfilter

    limit = packetfilter.CONSOLE_LOG_MAX
    sbx.exec(f"head -c {limit + limit // 2} /dev/zero | tr '\\0' x > /dev/ttyS0; echo the-end > /dev/ttyS0",
             check=True, timeout=300)
    log = sbx._machine.path / "console.log"
    wait_until(lambda: b"the-end" in log.read_bytes(), "the console's last line in console.log")
    assert log.stat().st_size <= limit and (log.parent / "console.log.1").stat().st_size <= limit


def _thread_cpu_s(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_machine_leaves_the_host_idle(sbx: Sandbox) -> None:
    """With the guest's HPET on, its kernel left HPET timer 0 periodic (interrupt off) after
    switching to one-shot ticks, and QEMU woke 250 times a second for it: 23 ms of CPU per
    second in QEMU's main thread of every idle machine (115 ms in this test's 5 s)."""
    sbx.exec("true")
    pid = sbx._machine.record.pid
    assert pid is not None
    before = _thread_cpu_s(pid, pid)
    time.sleep(5)  # the measure is what an idle machine costs over time
    assert _thread_cpu_s(pid, pid) - before < 0.05
    clock = sbx.exec("cat /sys/devices/system/clocksource/clocksource0/current_clocksource").stdout
    assert "hpet" not in clock


def test_a_guest_writes_its_files_out_as_it_goes(sbx: Sandbox) -> None:
    """A checkpoint first has the guest write its cached writes to its disk (gueststate.py):
    with the kernel's defaults the guest kept 30 MiB a step had written in memory for 30 s,
    and the checkpoint call right after that step waited 0.26-0.46 s for them."""
    sbx.exec("head -c 32M /dev/urandom > /root/written", check=True, timeout=120)

    def dirty_kib() -> int:
        line = sbx.exec("grep '^Dirty:' /proc/meminfo").stdout.split()
        return int(line[1])
    wait_until(lambda: dirty_kib() < 8 << 10, "the guest writing its cached writes out", timeout=4)
    sbx.exec("rm /root/written", check=True)
