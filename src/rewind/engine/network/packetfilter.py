"""The packet filter of one machine, a host process of its own: its network rules,
enforced outside the guest.

QEMU hands every frame the guest sends to this process (a `filter-redirector` on the
user-mode netdev, queue=rx, writes them to a socket) and takes back the frames it lets
through (the same filter's indev), so nothing leaves the guest unseen and, when this
process is gone, nothing leaves at all. A second redirector (queue=tx, indev only)
lets it answer the guest directly:

- a TCP segment to a blocked address gets a reset (the guest sees "connection refused"
  at once); other blocked packets get ICMP "administratively prohibited";
- DNS questions to 10.0.2.3 are answered here, from the host's resolver, so the filter
  knows which names each address was looked up under, and names the rules could never
  reach are refused (REFUSED) at once.

It also keeps the machine's console.log: QEMU sends the guest's serial console here, and
keep_console bounds what is kept of it.

Frames cross the sockets as QEMU's net stream: a 4-byte big-endian length, then the
frame. Started by the engine (netfilter.spawn) with the machine's tag and rules as arguments, in the
machine's directory; it detaches once it is connected and exits when QEMU does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import struct
import sys
import time
from collections import defaultdict
from pathlib import Path

import dpkt

from rewind.engine.network.netfilter import CONNECT_TIMEOUT, CONTROL, LOG_FILE, write_pid_file
from rewind.engine.network.netrules import DNS_SERVER, NetworkRules
from rewind.engine.process.qemu import CONSOLE_LOG, CONSOLE_SOCKET
from rewind.engine.process.qemu import NET_FROM_GUEST as FROM_GUEST
from rewind.engine.process.qemu import NET_TO_GUEST as TO_GUEST
from rewind.engine.process.qemu import NET_TO_NET as TO_NET

DNS_TTL = 60
HOST_CHECK_TTL = 10.0  # the host's own addresses can change (DHCP, new interfaces)
MAX_NAMED_ADDRESSES = 4096  # the name map a guest's DNS questions fill is bounded
MAX_DNS_IN_FLIGHT = 64  # questions past this are dropped, as a busy resolver would
MAX_ATTEMPTS = 256  # distinct refused destinations remembered (see Filter.attempts)
CONSOLE_LOG_MAX = 1 << 20  # console.log moves to console.log.1 at this size: 2 MiB at most of both
_PROTOCOLS = {dpkt.ip.IP_PROTO_TCP: "tcp", dpkt.ip.IP_PROTO_UDP: "udp", dpkt.ip.IP_PROTO_ICMP: "icmp"}
_LENGTH = struct.Struct(">I")


class HostAddresses:
    """Which destinations are this host's own addresses, found out by trying to bind one:
    the kernel allows that exactly for local addresses. A guest reaching one of them
    reaches the host's services, so they count as the host (see NetworkRules.permits)."""

    def __init__(self) -> None:
        self._known: dict[ipaddress.IPv4Address, tuple[bool, float]] = {}

    def __contains__(self, address: ipaddress.IPv4Address) -> bool:
        now = time.monotonic()
        hit = self._known.get(address)
        if hit is None or now - hit[1] > HOST_CHECK_TTL:
            if len(self._known) >= MAX_NAMED_ADDRESSES:
                self._known.clear()
            hit = (self._bindable(address), now)
            self._known[address] = hit
        return hit[0]

    @staticmethod
    def _bindable(address: ipaddress.IPv4Address) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((str(address), 0))
            except OSError:
                return False
        return True


class Filter:
    def __init__(self, rules: NetworkRules, to_net: asyncio.StreamWriter,
                 to_guest: asyncio.StreamWriter, forwarded: frozenset[int] = frozenset()) -> None:
        self.rules = rules
        self.forwarded = forwarded  # guest ports the host forwards to (ports.py)
        self.to_net = to_net
        self.to_guest = to_guest
        self.names: dict[ipaddress.IPv4Address, set[str]] = defaultdict(set)  # from our DNS answers
        self.host = HostAddresses()
        self.dns_in_flight = 0
        # What the guest tried to reach and the rules refused, in order ("tcp 192.0.2.7:443",
        # "dns example.com"): the guard asks a copy that ran an unknown program for it.
        self.attempts: dict[str, None] = {}

    def _attempted(self, what: str) -> None:
        if len(self.attempts) < MAX_ATTEMPTS:
            self.attempts[what] = None

    def _refused_packet(self, ip: dpkt.ip.IP, dst: ipaddress.IPv4Address) -> str:
        proto = _PROTOCOLS.get(ip.p, f"ip proto {ip.p}")
        port = getattr(ip.data, "dport", None) if proto in ("tcp", "udp") else None
        names = sorted(self.names.get(dst, ()))
        return f"{proto} {dst}{'' if port is None else f':{port}'}{f' ({names[0]})' if names else ''}"

    def permits(self, address: ipaddress.IPv4Address, names: set[str] | tuple[str, ...] = ()) -> bool:
        return self.rules.permits(address, names, host=address in self.host)

    @staticmethod
    def _send(writer: asyncio.StreamWriter, frame: bytes) -> None:
        writer.write(_LENGTH.pack(len(frame)) + frame)

    def _reply(self, eth: dpkt.ethernet.Ethernet, ip: dpkt.ip.IP, payload: dpkt.Packet, proto: int) -> None:
        """Send `payload` to the guest as if from the address it wrote to."""
        answer = dpkt.ip.IP(src=ip.dst, dst=ip.src, p=proto, ttl=64, data=payload)
        self._send(self.to_guest, bytes(dpkt.ethernet.Ethernet(
            src=eth.dst, dst=eth.src, type=dpkt.ethernet.ETH_TYPE_IP, data=answer)))

    def _refuse(self, eth: dpkt.ethernet.Ethernet, ip: dpkt.ip.IP) -> None:
        if isinstance(ip.data, dpkt.tcp.TCP):
            seg = ip.data
            if seg.flags & dpkt.tcp.TH_RST:
                return
            if seg.flags & dpkt.tcp.TH_ACK:
                rst = dpkt.tcp.TCP(sport=seg.dport, dport=seg.sport, seq=seg.ack, flags=dpkt.tcp.TH_RST)
            else:  # a SYN: acknowledge it so the guest takes the reset as a refusal
                span = len(seg.data) + (1 if seg.flags & dpkt.tcp.TH_SYN else 0) + \
                    (1 if seg.flags & dpkt.tcp.TH_FIN else 0)
                rst = dpkt.tcp.TCP(sport=seg.dport, dport=seg.sport, seq=0,
                                   ack=(seg.seq + span) & 0xFFFFFFFF,
                                   flags=dpkt.tcp.TH_RST | dpkt.tcp.TH_ACK)
            self._reply(eth, ip, rst, dpkt.ip.IP_PROTO_TCP)
        elif not (isinstance(ip.data, dpkt.icmp.ICMP) and ip.data.type == dpkt.icmp.ICMP_UNREACH):
            # ICMP quotes the offending header and 8 bytes of what follows.
            quoted = ip.pack_hdr() + bytes(ip.opts) + bytes(ip.data)[:8]
            unreach = dpkt.icmp.ICMP(type=dpkt.icmp.ICMP_UNREACH, code=dpkt.icmp.ICMP_UNREACH_FILTER_PROHIB,
                                     data=dpkt.icmp.ICMP.Unreach(data=quoted))
            self._reply(eth, ip, unreach, dpkt.ip.IP_PROTO_ICMP)

    def handle(self, frame: bytes) -> None:
        eth = dpkt.ethernet.Ethernet(frame)
        if eth.type == dpkt.ethernet.ETH_TYPE_ARP:
            self._send(self.to_net, frame)  # QEMU answers for its virtual hosts
            return
        if eth.type != dpkt.ethernet.ETH_TYPE_IP or not isinstance(eth.data, dpkt.ip.IP):
            return  # IPv6 and the rest have nowhere to go: dropped, whatever the address
        ip = eth.data
        dst = ipaddress.IPv4Address(ip.dst)
        if dst == DNS_SERVER and isinstance(ip.data, dpkt.udp.UDP) and ip.data.dport == 53:
            if self.dns_in_flight < MAX_DNS_IN_FLIGHT:
                self.dns_in_flight += 1
                asyncio.get_running_loop().create_task(self._answer_dns(eth, ip))
        elif dst.is_multicast or dst == ipaddress.IPv4Address("255.255.255.255"):
            return
        elif self.permits(dst, self.names.get(dst, ())) or self._answers_forward(ip):
            self._send(self.to_net, frame)
        else:
            self._attempted(self._refused_packet(ip, dst))
            self._refuse(eth, ip)

    def _answers_forward(self, ip: dpkt.ip.IP) -> bool:
        """A segment of a connection the host opened to a forwarded guest port. A bare SYN
        would open a new one from that port: refused like any other."""
        seg = ip.data
        return isinstance(seg, dpkt.tcp.TCP) and seg.sport in self.forwarded and not (
            seg.flags & dpkt.tcp.TH_SYN and not seg.flags & dpkt.tcp.TH_ACK)

    async def _answer_dns(self, eth: dpkt.ethernet.Ethernet, ip: dpkt.ip.IP) -> None:
        try:
            await self._answer_dns_question(eth, ip)
        finally:
            self.dns_in_flight -= 1

    async def _answer_dns_question(self, eth: dpkt.ethernet.Ethernet, ip: dpkt.ip.IP) -> None:
        # dnspython takes a fifth of a second to import: not on the path of every machine's start.
        import dns.flags
        import dns.message
        import dns.rcode
        import dns.rdataclass
        import dns.rdatatype
        import dns.rrset

        udp = ip.data
        try:
            query = dns.message.from_wire(bytes(udp.data))
        except Exception:  # noqa: BLE001 - whatever the guest sent, a bad query gets no answer
            return
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
        else:
            question = query.question[0]
            name = question.name.to_text(omit_final_dot=True)
            if not self.rules.permits_name(name):
                self._attempted(f"dns {name}")
                response.set_rcode(dns.rcode.REFUSED)
            elif question.rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
                addresses = await self._resolve(name)
                reachable = [a for a in addresses or ()
                             if self.permits(ipaddress.IPv4Address(a), (name,))]
                if addresses is None:
                    response.set_rcode(dns.rcode.NXDOMAIN)
                elif addresses and not reachable:
                    self._attempted(f"dns {name}")
                    response.set_rcode(dns.rcode.REFUSED)  # nothing it resolves to may be reached
                elif reachable:
                    self._remember(name, reachable)
                    response.answer.append(dns.rrset.from_text_list(
                        question.name, DNS_TTL, dns.rdataclass.IN, dns.rdatatype.A, reachable))
            # Other types (AAAA included: the guest has no IPv6 route) get an empty answer.
        reply = dpkt.udp.UDP(sport=53, dport=udp.sport, data=response.to_wire())
        reply.ulen = len(reply)
        self._reply(eth, ip, reply, dpkt.ip.IP_PROTO_UDP)

    def _remember(self, name: str, addresses: list[str]) -> None:
        if len(self.names) >= MAX_NAMED_ADDRESSES:
            self.names.clear()  # a flood of questions cannot grow the filter without bound
        for address in addresses:
            known = self.names[ipaddress.IPv4Address(address)]
            if len(known) < 64:
                known.add(name)

    @staticmethod
    async def _resolve(name: str) -> list[str] | None:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return None
        return sorted({info[4][0] for info in infos})

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One JSON request: {"rules": ...} sets new rules, {"forwarded": [PORT, ...]} the
        forwarded guest ports; {"attempts": true} asks what was refused."""
        try:
            request = json.loads(await reader.readline())
            if "rules" in request:
                self.rules = NetworkRules.from_json(request["rules"])
            if "forwarded" in request:
                self.forwarded = _ports(request["forwarded"])
            reply = {"ok": True, **({"attempts": list(self.attempts)} if request.get("attempts") else {})}
        except Exception as e:  # noqa: BLE001 - the caller gets the reason; the filter runs on
            reply = {"ok": False, "error": str(e)}
        writer.write(json.dumps(reply).encode() + b"\n")
        await writer.drain()
        writer.close()


async def _connect(path: str, deadline: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to one of QEMU's sockets; we are started alongside QEMU, so wait for it."""
    while True:
        try:
            return await asyncio.open_unix_connection(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


async def keep_console(console: asyncio.StreamReader, limit: int = CONSOLE_LOG_MAX) -> None:
    """Append the guest's serial console to console.log until QEMU closes it; a log that
    would pass `limit` moves to console.log.1 first (replacing the one before)."""
    log = open(CONSOLE_LOG, "ab")  # noqa: SIM115 - it is replaced as it fills
    try:
        while data := await console.read(65536):
            if log.tell() + len(data) > limit:
                log.close()
                os.replace(CONSOLE_LOG, f"{CONSOLE_LOG}.1")
                log = open(CONSOLE_LOG, "ab")  # noqa: SIM115
            log.write(data)
            log.flush()
    finally:
        log.close()


def _ports(value: object) -> frozenset[int]:
    if not isinstance(value, list) or not all(isinstance(p, int) and 0 < p < 65536 for p in value):
        raise ValueError(f"forwarded ports must be a list of port numbers, not {value!r}")
    return frozenset(value)


async def _run(rules: NetworkRules, forwarded: frozenset[int], ready: int) -> None:
    deadline = time.monotonic() + CONNECT_TIMEOUT
    # Keep every writer, even the one we never write to: a dropped StreamWriter closes its socket.
    from_guest, from_guest_w = await _connect(FROM_GUEST, deadline)
    _, to_net = await _connect(TO_NET, deadline)
    _, to_guest = await _connect(TO_GUEST, deadline)
    console, console_w = await _connect(CONSOLE_SOCKET, deadline)
    console_kept = asyncio.create_task(keep_console(console))
    flt = Filter(rules, to_net, to_guest, forwarded)
    Path(CONTROL).unlink(missing_ok=True)
    server = await asyncio.start_unix_server(flt.control, path=CONTROL)
    os.write(ready, b"ok")
    os.close(ready)
    try:
        while True:
            header = await from_guest.readexactly(_LENGTH.size)
            frame = await from_guest.readexactly(_LENGTH.unpack(header)[0])
            try:
                flt.handle(frame)
            except (dpkt.UnpackError, ValueError, struct.error):
                continue  # a malformed frame goes nowhere
            await to_guest.drain()
            await to_net.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # QEMU has exited
    finally:
        server.close()
        console_kept.cancel()
        for writer in (from_guest_w, to_net, to_guest, console_w):
            writer.close()
        Path(CONTROL).unlink(missing_ok=True)


def main() -> None:
    """Connect to the machine's QEMU, then detach: the engine waits only until we are ready."""
    rules = NetworkRules.from_json(json.loads(sys.argv[2]))
    forwarded = _ports(json.loads(sys.argv[3]))
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        sys.exit(0 if os.read(ready_r, 2) == b"ok" else 1)
    os.close(ready_r)
    os.setsid()
    write_pid_file()  # so the engine can end us even before we connect
    with open(LOG_FILE, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 2)
    asyncio.run(_run(rules, forwarded, ready_w))


if __name__ == "__main__":
    main()
