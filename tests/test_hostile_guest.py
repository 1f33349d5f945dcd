"""A hostile guest: root in it floods the network filter with DNS questions, and replaces
rewind's own guest agent with one that answers the host's hello and then sends garbage,
bogus frames and endless output. The host stays within its bounds (memory of the filter and
of the rewind process, time of a call), says what went wrong, and `restore` takes the machine
back. Raw packets at every host address are tests/test_network.py's."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from invariants import wait_until

from rewind import AgentGone, Home, RewindError, Sandbox
from rewind.engine import agent
from rewind.engine.network import netfilter
from rewind.engine.network.packetfilter import MAX_ATTEMPTS
from rewind.engine.process.qemu import AGENT_CHARDEV
from rewind.guest.agent import PORT_PREFIX

DNS_QUESTIONS = 20_000
FILTER_GROWTH_LIMIT_MIB = 16
DEADLINE_GRACE_S = 3.0  # (30 s in use: a TCG guest on a busy host can be that slow to end a command)
# An exec keeps at most 16 MiB of each stream, and its text: up to 4 bytes a character (a
# hostile agent's bytes decode to the widest), so about 160 MiB at worst for one call.
HOST_GROWTH_LIMIT_MIB = 192

# Runs on rewind's own Python in the guest, in the agent's place: it speaks just enough of the
# protocol (guest/protocol.py) to be connected to, then floods the host.
EVIL_AGENT = r'''
import json, os, random, select, struct, time
MAGIC = b"RWD\x01"
def frame(header, payload=b""):
    head = json.dumps(header).encode()
    return struct.pack(">4sII", MAGIC, len(head), len(payload)) + head + payload
ports = []
for dev in sorted(os.listdir("/sys/class/virtio-ports")):
    with open(f"/sys/class/virtio-ports/{dev}/name") as f:
        if f.read().strip().startswith("PREFIX"):
            ports.append(os.open("/dev/" + dev, os.O_RDWR | os.O_NONBLOCK))
bufs = {fd: b"" for fd in ports}
flooding = set()
junk = [os.urandom(1 << 16), struct.pack(">4sII", MAGIC, 1 << 30, 1 << 30),
        frame({"t": "out", "fd": 1}, b"x" * (1 << 20)), frame({"t": "out", "fd": 2}, b"y" * (1 << 20)),
        struct.pack(">4sII", MAGIC, 200000, 0) + b"[" * 200000, frame({"t": "pong", "id": "nope"})]
while True:
    select.select(ports, [], [], 0.01)
    for fd in ports:
        try:
            bufs[fd] += os.read(fd, 1 << 16)
        except OSError:
            pass
        while len(bufs[fd]) >= 12:
            at = bufs[fd].find(MAGIC)
            if at < 0:
                bufs[fd] = b""
                break
            _, hlen, plen = struct.unpack_from(">4sII", bufs[fd], at)
            if len(bufs[fd]) < at + 12 + hlen + plen:
                break
            header = json.loads(bufs[fd][at + 12 : at + 12 + hlen])
            bufs[fd] = bufs[fd][at + 12 + hlen + plen :]
            reply = {"hello": {"t": "hello", "nonce": header.get("nonce")},
                     "ping": {"t": "pong", "id": header.get("id")}}.get(header.get("t"))
            if reply is None:
                flooding.add(fd)
            else:
                try:
                    os.write(fd, frame(reply))
                except OSError:
                    pass
        if fd in flooding:
            try:
                os.write(fd, random.choice(junk))
            except OSError:
                pass
'''.replace("PREFIX", PORT_PREFIX)


# In the agent's place: holds every agent port open and never reads nor answers.
MUTE_AGENT = r'''
import os, time
held = [os.open("/dev/" + dev, os.O_RDWR) for dev in sorted(os.listdir("/sys/class/virtio-ports"))
        if open(f"/sys/class/virtio-ports/{dev}/name").read().strip().startswith("PREFIX")]
while True:
    time.sleep(60)
'''.replace("PREFIX", PORT_PREFIX)


def _swap_agent(sbx: Sandbox, source: str) -> None:
    """Bind `source` over the agent on its read-only disk, then end the agent (and this exec
    with it): init starts the new one in its place."""
    sbx.files.write("/root/swapped.py", source)
    with contextlib.suppress(RewindError):
        sbx.exec("mount --bind /root/swapped.py /usr/lib/rewind/agent.py && pkill -f 'agent[.]py'", timeout=5)


def _agent_ports_open(sbx: Sandbox) -> bool:
    with sbx._machine.monitor() as mon:
        return any(c.get("frontend-open") for c in mon.cmd("query-chardev")
                   if c.get("label", "").startswith(AGENT_CHARDEV))


def _rss_kib(pid: int | str, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _filter_pid(sbx: Sandbox) -> int:
    return int((sbx._machine.path / netfilter.PID_FILE).read_text().split()[0])


def test_a_dns_flood_keeps_the_filter_within_its_bounds(home: Home) -> None:
    sbx = Sandbox.create("dnsflood", home=home)
    sbx.network.set(internet=False, allow=["192.0.2.0/24"])  # every name refused, and remembered
    pid = _filter_pid(sbx)
    before = _rss_kib(pid)
    flood = (
        "import random, socket, struct\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for i in range({DNS_QUESTIONS}):\n"
        "    name = b''.join(bytes([len(p)]) + p for p in (b'n%d' % i, b'flood', b'test')) + b'\\0'\n"
        "    s.sendto(struct.pack('>HHHHHH', i & 0xffff, 0x100, 1, 0, 0, 0) + name + b'\\0\\1\\0\\1',"
        " ('10.0.2.3', 53))\n")
    sbx.files.write("/root/flood.py", flood)
    assert sbx.exec("python3 /root/flood.py", timeout=300).exit_code == 0
    assert sbx.exec("getent hosts n1.flood.test", timeout=30).exit_code != 0  # still answering, refused
    grew = (_rss_kib(pid) - before) / 1024
    assert grew < FILTER_GROWTH_LIMIT_MIB, f"the filter grew by {grew:.1f} MiB"
    assert len(sbx._machine.network_attempts()) <= MAX_ATTEMPTS
    assert _filter_pid(sbx) == pid and sbx.exec("true").exit_code == 0


def _capped_by_the_host(sbx: Sandbox) -> bool:
    """One command against the hostile agent, which the host's own deadline ends: whether both
    streams were cut at their cap. False too if it did not answer the host's hello in time (its
    answer can be lost in its own flood). The output is dropped here: the caller's peak memory
    is measured."""
    try:
        result = sbx.exec("true", timeout=1)
    except AgentGone:
        return False
    assert result.timed_out
    return result.stdout_truncated and result.stderr_truncated


def test_a_hostile_agent_cannot_hurt_the_host_and_restore_takes_it_back(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """It never ends a command and answers every ping: the host's own deadline ends the call,
    with each stream cut at its cap; the same deadline covers reaching the agent."""
    monkeypatch.setattr(agent, "EXEC_DEADLINE_GRACE", DEADLINE_GRACE_S)
    sbx = Sandbox.create("hostile", home=home)
    sbx.files.write("/root/f", "before")
    before = sbx.checkpoint()
    _swap_agent(sbx, EVIL_AGENT)
    host_peak = _rss_kib("self", "VmHWM")
    # The first calls also wait for init to start the hostile agent (Python on TCG: 11 s on a
    # busy CI host); they end at the same deadline, unanswered, until it runs.
    # Each stream is cut at its cap once the flood reaches it (16 MiB each: under TCG a slow
    # moment can leave a call short of it before its deadline, so the cap is waited for).
    give_up = time.monotonic() + 120
    while not _capped_by_the_host(sbx):
        assert time.monotonic() < give_up, "the hostile agent's flood was never cut at its cap"
    for _ in range(2):
        started = time.monotonic()
        _capped_by_the_host(sbx)
        took = time.monotonic() - started
        assert took < 1 + DEADLINE_GRACE_S + 5, f"an exec took {took:.0f} s"
    grew = (_rss_kib("self", "VmHWM") - host_peak) / 1024
    print(f"hostile agent: the caller's peak memory grew by {grew:.0f} MiB")
    assert grew < HOST_GROWTH_LIMIT_MIB, f"the rewind process grew by {grew:.1f} MiB"
    sbx.restore(before)  # the machine runs as it was before the swap
    assert sbx.files.read_text("/root/f") == "before"
    assert sbx.exec("true").exit_code == 0


@pytest.mark.slow  # over 30 s here
def test_an_agent_that_never_answers_holds_no_call_past_its_deadline(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ports open, the host's hellos unanswered: a command with a timeout ends at the same
    deadline as one the guest never ends (reaching the agent once had 30 s of its own)."""
    monkeypatch.setattr(agent, "EXEC_DEADLINE_GRACE", DEADLINE_GRACE_S)
    sbx = Sandbox.create("mute", home=home)
    before = sbx.checkpoint()
    _swap_agent(sbx, MUTE_AGENT)
    wait_until(lambda: _agent_ports_open(sbx), "the mute agent to open its ports", timeout=120)
    started = time.monotonic()
    with pytest.raises(AgentGone, match="did not answer"):
        sbx.exec("true", timeout=1)
    took = time.monotonic() - started
    assert took < 1 + DEADLINE_GRACE_S + 5, f"the call took {took:.0f} s"
    sbx.restore(before)
    assert sbx.exec("true").exit_code == 0
