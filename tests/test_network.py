"""Network rules enforced on the host: what root in a real guest can and cannot reach."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from invariants import wait_until

from rewind import Home, InvalidArgument, Sandbox
from rewind.engine.network.netrules import NetworkRules


class Listener:
    """A TCP server on this host that greets each client, for the guest to try to reach."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.sendall(b"hello from the host\n")

    def close(self) -> None:
        self.sock.close()


def host_address() -> str:
    """This host's address on its own network (not loopback), as the guest reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the outgoing address
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this host has no non-loopback address for the guest to reach")
    return address


@pytest.fixture
def loopback() -> Iterator[Listener]:
    listener = Listener("127.0.0.1")
    yield listener
    listener.close()


class OutsideListener:
    """A TCP server on another machine as far as the guest can tell: in a network namespace
    of its own behind a veth pair, so the host routes to it (the host's own addresses count
    as the host, which the guest may not reach by default)."""

    SERVER = ("import socket,sys\n"
              "s=socket.socket(); s.bind((sys.argv[1],0)); s.listen()\n"
              "print(s.getsockname()[1],flush=True)\n"
              "while True:\n"
              " c,_=s.accept(); open(sys.argv[2],'a').write('x\\n')\n"
              " c.sendall(b'hello from the host\\n'); c.close()\n")

    def __init__(self, tmp: Path) -> None:
        tag = f"rwt{os.getpid() % 100000}"
        self.netns, self.log = tag, tmp / "accepted"
        self.log.write_text("")
        octet = os.getpid() % 250 + 1
        self.address, host_side = f"198.18.{octet}.2", f"198.18.{octet}.1"
        for command in (f"ip netns add {tag}", f"ip link add {tag}h type veth peer name {tag}n netns {tag}",
                        f"ip addr add {host_side}/30 dev {tag}h", f"ip link set {tag}h up",
                        f"ip -n {tag} addr add {self.address}/30 dev {tag}n",
                        f"ip -n {tag} link set {tag}n up"):
            if subprocess.run(command.split(), capture_output=True, check=False).returncode:
                self.close()
                pytest.skip(f"cannot make a network namespace here ({command})")
        self.proc = subprocess.Popen(["ip", "netns", "exec", tag, sys.executable, "-c", self.SERVER,
                                      self.address, str(self.log)], stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    @property
    def accepted(self) -> int:
        return len(self.log.read_text().splitlines())

    def close(self) -> None:
        if getattr(self, "proc", None):
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[tuple[str, OutsideListener]]:
    listener = OutsideListener(tmp_path)
    yield listener.address, listener
    listener.close()


def connect(sbx: Sandbox, address: str, port: int) -> tuple[bool, str, float]:
    """Connect from the guest (as root, with bash's /dev/tcp); (reached, error text, seconds)."""
    started = time.monotonic()
    r = sbx.exec(f"exec 3<>/dev/tcp/{address}/{port} && head -1 <&3", timeout=30)
    reached = r.exit_code == 0 and "hello from the host" in r.stdout
    return reached, r.stderr.strip(), time.monotonic() - started


def test_rules_enforced_on_the_host(home: Home, loopback: Listener,
                                    outside: tuple[str, OutsideListener]) -> None:
    address, listener = outside
    sbx = Sandbox.create("net", home=home)
    assert sbx.network.get() == {"internet": True, "allow": [], "deny": []}

    # By default: the world yes, the host's loopback services no (10.0.2.2 is the host's 127.0.0.1).
    assert connect(sbx, address, listener.port)[0]
    reached, error, _ = connect(sbx, "10.0.2.2", loopback.port)
    assert not reached and "refused" in error.lower()
    assert loopback.accepted == 0

    # Off: refused at once, visibly; names do not resolve either.
    sbx.network.off()
    reached, error, seconds = connect(sbx, address, listener.port)
    assert not reached and "refused" in error.lower() and seconds < 5
    assert sbx.exec("getent hosts localhost.localdomain.example", timeout=30).exit_code != 0

    # Root in the guest cannot undo it: new addresses and routes change nothing.
    sbx.exec("ip addr add 10.0.2.99/24 dev eth0; ip route replace default via 10.0.2.2 src 10.0.2.99",
             check=True)
    assert not connect(sbx, address, listener.port)[0]

    # Narrowed: only what is allowed; the host's loopback only when 127.0.0.1 is.
    sbx.network.set(internet=False, allow=[f"{address}/32"])
    assert connect(sbx, address, listener.port)[0]
    assert not connect(sbx, "10.0.2.2", loopback.port)[0]
    sbx.network.set(internet=False, allow=["127.0.0.1"])
    assert connect(sbx, "10.0.2.2", loopback.port)[0]
    assert not connect(sbx, address, listener.port)[0]
    assert loopback.accepted == 1

    # Deny wins over the internet.
    sbx.network.set(internet=True, deny=[str(ipaddress.ip_network(f"{address}/24", strict=False))])
    assert not connect(sbx, address, listener.port)[0]


def test_dns_follows_the_rules(home: Home) -> None:
    name = socket.gethostname()  # resolvable on this host, not in the guest's own /etc/hosts
    try:
        socket.getaddrinfo(name, None, family=socket.AF_INET)
    except OSError:
        pytest.skip(f"this host cannot resolve its own name {name!r}")
    # The name leads to the host itself, so by default it does not resolve in the guest at all.
    sbx = Sandbox.create("dns", home=home)
    assert sbx.exec(f"getent hosts {name}", timeout=30).exit_code != 0
    sbx.network.set(internet=True, allow=["127.0.0.1"])
    found = sbx.exec(f"getent hosts {name}", timeout=30)
    assert found.exit_code == 0 and name in found.stdout
    sbx.network.set(internet=True, allow=["127.0.0.1"], deny=[name])
    assert sbx.exec(f"getent hosts {name}", timeout=30).exit_code != 0
    sbx.network.set(internet=False, allow=[name, "127.0.0.1"])
    assert sbx.exec(f"getent hosts {name}", timeout=30).exit_code == 0
    assert sbx.exec("getent hosts other.invalid", timeout=30).exit_code != 0


def test_rules_survive_checkpoint_restore_and_fork(home: Home, outside: tuple[str, OutsideListener]) -> None:
    address, listener = outside
    sbx = Sandbox.create("keep", home=home, network={"internet": False, "allow": ["*.example.com"]})
    assert not connect(sbx, address, listener.port)[0]
    sbx.checkpoint()
    sbx.restore("~0")
    assert sbx.network.get() == {"internet": False, "allow": ["*.example.com"], "deny": []}
    assert not connect(sbx, address, listener.port)[0]
    child = sbx.fork("keep-child")
    assert child.network.get() == sbx.network.get()
    assert not connect(child, address, listener.port)[0]
    child.network.set(internet=True)
    assert connect(child, address, listener.port)[0]
    assert not connect(sbx, address, listener.port)[0]  # a child's rules are its own
    sbx.stop()
    sbx.start()
    assert not connect(sbx, address, listener.port)[0]


@pytest.mark.parametrize("rule", ["not a host", "http://example.com", "-bad.com", "a..b", "*", "10.0.0.0/33",
                                  "", "exa mple.com", "x" * 300])
def test_bad_rules_are_refused(rule: str) -> None:
    with pytest.raises(InvalidArgument, match="not a host name"):
        NetworkRules.parse(internet=False, allow=[rule])


def test_rule_matching() -> None:
    rules = NetworkRules.parse(internet=False, allow=["*.example.com", "10.1.0.0/16", "1password.com"],
                               deny=["bad.example.com"])
    ip = ipaddress.ip_address
    assert rules.permits(ip("10.1.2.3"))
    assert not rules.permits(ip("10.2.0.1"))
    assert rules.permits(ip("93.184.216.34"), ["www.example.com"])
    assert not rules.permits(ip("93.184.216.34"), ["bad.example.com"])
    assert not rules.permits(ip("93.184.216.34"), ["example.org"])
    assert rules.permits(ip("93.184.216.35"), ["1password.com"])
    assert not rules.permits(ip("10.0.2.2"))  # the host's loopback needs 127.0.0.1 allowed
    broad, host_only = NetworkRules.parse(allow=["0.0.0.0/0"]), NetworkRules.parse(False, ["127.0.0.1"])
    host_denied = NetworkRules.parse(False, allow=["127.0.0.1"], deny=["127.0.0.0/8"])
    for host in ("0.0.0.0", "0.9.9.9", "127.0.0.1", "127.8.0.1", "10.0.2.2"):
        assert not broad.permits(ip(host)) and not host_denied.permits(ip(host))
        assert host_only.permits(ip(host))
    assert not NetworkRules.parse(internet=True).permits(ip("93.184.216.34"), host=True)
    assert not NetworkRules.parse(internet=True).permits(ip("::1"))
    assert rules.permits_name("api.example.com") and not rules.permits_name("bad.example.com")
    assert not NetworkRules.parse(internet=True).permits(ip("127.0.0.1"))
    assert NetworkRules.parse(internet=True).permits(ip("8.8.8.8"))


# Sent by root in the guest: hand-made frames straight onto eth0 (AF_PACKET), so neither the
# guest's routing nor its TCP stack stands in the way. For each destination: a TCP SYN, a UDP
# datagram whole and one in two fragments, and a ping; then it reports the TCP answer each
# destination gave ("rst", "synack", none).
ICMP_MARK = b"rewind-raw-probe"
RAW_PROBE = r"""
import json, os, socket, struct, sys, time
MARK = b"rewind-raw-probe"
port, uport, targets = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def csum(data):
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data)//2}H", data))
    while total >> 16: total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
me = socket.inet_aton("10.0.2.15")
mac = bytes.fromhex(open("/sys/class/net/eth0/address").read().strip().replace(":", ""))
gw = b"\x52\x55\x0a\x00\x02\x02"  # QEMU's user-mode network answers for every virtual host with this
for line in open("/proc/net/arp").read().splitlines()[1:]:
    f = line.split()
    if f[0] == "10.0.2.2" and f[3] != "00:00:00:00:00:00": gw = bytes.fromhex(f[3].replace(":", ""))
def ipv4(dst, proto, payload, to=None, frag=0):
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, frag, 64, proto, 0, me, dst)
    head = head[:10] + struct.pack("!H", csum(head)) + head[12:]
    return (to or gw) + mac + b"\x08\x00" + head + payload
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.bind(("eth0", 0))
sports = {}
for i, t in enumerate(targets):
    dst, sport = socket.inet_aton(t), 40000 + i
    sports[sport] = t
    tcp = struct.pack("!HHIIBBHHH", sport, port, 1000, 0, 5 << 4, 0x02, 64240, 0, 0)
    tcp = tcp[:16] + struct.pack("!H", csum(me + dst + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)) + tcp[18:]
    s.send(ipv4(dst, 6, tcp))
    udp = struct.pack("!HHHH", sport, uport, 8 + 4, 0) + b"ping"
    s.send(ipv4(dst, 17, udp))
    udp = struct.pack("!HHHH", sport, uport, 8 + 16, 0) + b"fragmented-ping!"  # in two fragments
    s.send(ipv4(dst, 17, udp[:16], frag=0x2000))  # more fragments follow
    s.send(ipv4(dst, 17, udp[16:], frag=16 // 8))  # the rest, 16 bytes in
    echo = struct.pack("!BBHHH", 8, 0, 0, sport, 1) + MARK
    s.send(ipv4(dst, 1, echo[:2] + struct.pack("!H", csum(echo)) + echo[4:]))
for dst in ("255.255.255.255", "10.0.2.255"):  # broadcasts, to every address on the link
    udp = struct.pack("!HHHH", 40999, uport, 8 + 4, 0) + b"ping"
    s.send(ipv4(socket.inet_aton(dst), 17, udp, b"\xff" * 6))
answers, end = {}, time.time() + 3
s.settimeout(0.2)
while time.time() < end:
    try: frame = s.recv(65535)
    except socket.timeout: continue
    if frame[12:14] != b"\x08\x00" or frame[23] != 6: continue
    ihl = (frame[14] & 15) * 4
    sport, dport = struct.unpack("!HH", frame[14 + ihl:18 + ihl])
    flags = frame[14 + ihl + 13]
    if dport in sports and sport == port:
        answers[sports[dport]] = "rst" if flags & 4 else "synack" if flags & 0x12 == 0x12 else hex(flags)
print(json.dumps(answers))
"""


class UdpListener:
    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.sock.settimeout(0)
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []

    def received(self) -> int:
        return len(self.payloads())

    def payloads(self) -> list[bytes]:
        """Every datagram it has received so far."""
        while True:
            try:
                self.seen.append(self.sock.recv(100))
            except BlockingIOError:
                return self.seen


def raw_probe(sbx: Sandbox, tcp: Listener, udp: UdpListener, *targets: str) -> dict[str, str]:
    r = sbx.exec(["python3", "-c", RAW_PROBE, str(tcp.port), str(udp.port), *targets], timeout=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_raw_packets_cannot_reach_the_host(home: Home) -> None:
    """Root in the guest, default rules (internet on): every address that leads to the host gets a reset,
    and no service on the host, on loopback or on its own address, sees a connection, a datagram
    (broadcasts included) or a ping."""
    own = host_address()
    tcp, udp = Listener("0.0.0.0"), UdpListener("0.0.0.0")  # every host address at once
    icmp = IcmpWatcher()
    try:
        sbx = Sandbox.create("raw", home=home)
        sbx.exec(f"exec 3<>/dev/tcp/10.0.2.2/{tcp.port}", timeout=30)  # fills the ARP table
        targets = ["0.0.0.0", "0.1.2.3", "127.0.0.1", "127.9.9.9", "10.0.2.2", own]
        answers = raw_probe(sbx, tcp, udp, *targets)
        assert answers == dict.fromkeys(targets, "rst"), answers
        # IPv6 goes nowhere either, the host's v6 alias and loopback included.
        sbx.exec("ip -6 addr add fec0::15/64 dev eth0 nodad; ip -6 route add default via fec0::2", timeout=30)
        for v6 in ("fec0::2", "::1"):
            reach = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{v6}/{tcp.port}'"
            assert sbx.exec(reach, timeout=30).exit_code != 0
        assert tcp.accepted == 0 and udp.received() == 0
        assert icmp.seen() == 0, "a guest's ping reached the host"

        # Only an explicit allow of the host's loopback opens the host; a broad range does not.
        sbx.network.set(internet=True, allow=["0.0.0.0/0"])
        assert raw_probe(sbx, tcp, udp, "0.0.0.0") == {"0.0.0.0": "rst"}
        assert tcp.accepted == 0 and udp.received() == 0
        sbx.network.set(internet=False, allow=["127.0.0.1"])
        assert raw_probe(sbx, tcp, udp, "0.0.0.0") == {"0.0.0.0": "synack"}
        # ... and then both datagrams arrive, the fragmented one reassembled: what the probe
        # sends does get through where it is let through, so the zero counts above mean something.
        wait_until(lambda: {b"ping", b"fragmented-ping!"} <= set(udp.payloads()), "the allowed datagrams", 10)
    finally:
        tcp.close()
        udp.sock.close()
        icmp.sock.close()


class IcmpWatcher:
    """Every ICMP packet that reaches this host, loopback included (a raw socket gets a copy
    of each): counts the probe's pings among them."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        self.sock.setblocking(False)

    def seen(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                count += ICMP_MARK in self.sock.recv(65535)
        return count


class Captured:
    """Stands in for the socket back to the guest: keeps what the filter sends."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data[4:])


def dns_answer(rules: NetworkRules, name: str, resolves_to: list[str],
               attempts: list[str] | None = None) -> tuple[str, list[str]]:
    """Ask the host's packet filter code for `name` as the guest would; (rcode, addresses).
    What the filter counts as refused attempts is added to `attempts`."""
    import asyncio

    import dns.message
    import dns.rcode
    import dpkt

    from rewind.engine.network.packetfilter import Filter

    async def resolve(_name: str) -> list[str]:
        return resolves_to

    to_guest = Captured()
    flt = Filter(rules, Captured(), to_guest)
    flt._resolve = resolve
    query = dpkt.udp.UDP(sport=5353, dport=53, data=dns.message.make_query(name, "A").to_wire())
    ip = dpkt.ip.IP(src=bytes([10, 0, 2, 15]), dst=bytes([10, 0, 2, 3]), p=17, data=query)
    eth = dpkt.ethernet.Ethernet(src=b"\x52\x54" + bytes(4), dst=b"\x52\x55" + bytes(4), data=ip)

    async def ask() -> None:
        flt.handle(bytes(eth))
        while flt.dns_in_flight:
            await asyncio.sleep(0.01)

    asyncio.run(ask())
    reply = dns.message.from_wire(dpkt.ethernet.Ethernet(to_guest.frames[0]).data.data.data)
    if attempts is not None:
        attempts += flt.attempts
    return dns.rcode.to_text(reply.rcode()), sorted(r.address for rrset in reply.answer for r in rrset)


def test_dns_answers_only_reachable_addresses() -> None:
    """Without the internet, an allowed range does not make every name resolvable: a name resolves
    only to the addresses the rules let through; and no name leads to the host unless allowed."""
    ranged = NetworkRules.parse(internet=False, allow=["10.9.0.0/16"])
    assert dns_answer(ranged, "a.example", ["93.184.216.34", "10.9.1.1"]) == ("NOERROR", ["10.9.1.1"])
    assert dns_answer(ranged, "b.example", ["93.184.216.34"]) == ("REFUSED", [])
    world = NetworkRules.parse(internet=True)
    assert dns_answer(world, "rebind.example", ["127.0.0.1"]) == ("REFUSED", [])
    assert dns_answer(world, "b.example", ["93.184.216.34"]) == ("NOERROR", ["93.184.216.34"])


def test_the_filter_remembers_what_it_refused() -> None:
    """What an offline machine tried to reach is kept for the guard to ask (netfilter.attempts):
    each refused destination once, by protocol, address and port, and refused name lookups."""
    import dpkt

    from rewind.engine.network.packetfilter import Filter

    flt = Filter(NetworkRules.parse(internet=False), Captured(), Captured())

    def send(proto: int, dst: bytes, data: dpkt.Packet) -> None:
        ip = dpkt.ip.IP(src=bytes([10, 0, 2, 15]), dst=dst, p=proto, data=data)
        eth = dpkt.ethernet.Ethernet(src=b"\x52\x54" + bytes(4), dst=b"\x52\x55" + bytes(4), data=ip)
        flt.handle(bytes(eth))

    syn = dpkt.tcp.TCP(sport=40000, dport=443, flags=dpkt.tcp.TH_SYN)
    send(dpkt.ip.IP_PROTO_TCP, bytes([192, 0, 2, 7]), syn)
    send(dpkt.ip.IP_PROTO_TCP, bytes([192, 0, 2, 7]), syn)  # a retry is the same attempt
    send(dpkt.ip.IP_PROTO_UDP, bytes([198, 51, 100, 1]), dpkt.udp.UDP(sport=5000, dport=123))
    send(dpkt.ip.IP_PROTO_UDP, bytes([255, 255, 255, 255]), dpkt.udp.UDP(sport=68, dport=67))  # broadcast
    assert list(flt.attempts) == ["tcp 192.0.2.7:443", "udp 198.51.100.1:123"]
    looked_up: list[str] = []
    assert dns_answer(NetworkRules.parse(internet=False), "example.com", ["93.184.216.34"], looked_up) == \
        ("REFUSED", [])
    assert looked_up == ["dns example.com"]
