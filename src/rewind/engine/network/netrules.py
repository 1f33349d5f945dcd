"""A machine's network rules and how they decide one destination.

The rules are enforced on the host by the machine's packet filter (packetfilter.py),
outside the guest, so root in the guest cannot change them."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from rewind.errors import InvalidArgument

# QEMU's user-mode network, as the guest sees it.
GUEST_NET = ipaddress.ip_network("10.0.2.0/24")
GUEST_ADDRESS = ipaddress.ip_address("10.0.2.15")  # set by the guest's init (guest/sysinit.sh)
HOST_ALIAS = ipaddress.ip_address("10.0.2.2")  # QEMU sends this address to the host's loopback
DNS_SERVER = ipaddress.ip_address("10.0.2.3")  # answered by our filter, not by QEMU
HOST_LOOPBACK = ipaddress.ip_address("127.0.0.1")
# Addresses that always mean the host itself to QEMU's user-mode network: a connection it
# makes on the guest's behalf to 0.0.0.0 or any 127.x lands on the host's loopback.
# (Seen here: a raw SYN to 0.0.0.0 reached a host service bound to 127.0.0.1.)
HOST_RANGES = (ipaddress.ip_network("0.0.0.0/8"), ipaddress.ip_network("127.0.0.0/8"))
LOOPBACK_RANGE = HOST_RANGES[1]

_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _parse_rule(rule: object, which: str) -> str:
    """A rule normalised: a CIDR range (a bare address is a /32), a host name, or
    `*.domain` (any name below domain)."""
    if not isinstance(rule, str) or not rule.strip():
        raise InvalidArgument(f"{which} rule {rule!r} is not a host name, *.wildcard or CIDR range")
    text = rule.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        pass
    name = text[2:] if text.startswith("*.") else text
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise InvalidArgument(f"{which} rule {rule!r} is not a host name, *.wildcard or CIDR range")
    return text


def is_range(rule: str) -> bool:
    """A normalised rule is a CIDR range (always written with its /prefix) or a name."""
    return "/" in rule


def name_matches(pattern: str, name: str) -> bool:
    name = name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


@dataclass(frozen=True)
class NetworkRules:
    """Which destinations a machine may reach.

    With `internet` on, everything except `deny` is reachable; with it off, only
    `allow`. `deny` wins over `allow`. The host itself (10.0.2.2 in the guest, 0.0.0.0/8,
    127.0.0.0/8 and the host's own addresses) is judged before everything else: it is
    reachable only when an allow rule inside 127.0.0.0/8 covers 127.0.0.1, so neither the
    internet nor a broad range such as 0.0.0.0/0 opens it."""

    internet: bool = True
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @classmethod
    def parse(cls, internet: bool = True, allow: Iterable[str] | None = None,
              deny: Iterable[str] | None = None) -> NetworkRules:
        if not isinstance(internet, bool):
            raise InvalidArgument(f"internet must be true or false (got {internet!r})")
        for which, rules in (("allow", allow), ("deny", deny)):
            if isinstance(rules, str | bytes):
                raise InvalidArgument(f"{which} must be a list of rules, not one string")
        return cls(internet=internet,
                   allow=tuple(dict.fromkeys(_parse_rule(r, "allow") for r in allow or ())),
                   deny=tuple(dict.fromkeys(_parse_rule(r, "deny") for r in deny or ())))

    @classmethod
    def from_json(cls, data: dict) -> NetworkRules:
        return cls.parse(data.get("internet", True), data.get("allow"), data.get("deny"))

    def to_json(self) -> dict:
        return {"internet": self.internet, "allow": list(self.allow), "deny": list(self.deny)}

    def _hits(self, rules: tuple[str, ...], address: IPAddress, names: Iterable[str]) -> bool:
        names = list(names)
        for rule in rules:
            if is_range(rule):
                if address in ipaddress.ip_network(rule):
                    return True
            elif any(name_matches(rule, n) for n in names):
                return True
        return False

    def permits_host(self) -> bool:
        """May the guest reach services on the host (what 10.0.2.2 leads to)?"""
        if self._hits(self.deny, HOST_LOOPBACK, ()):
            return False
        return any(is_range(rule) and HOST_LOOPBACK in (net := ipaddress.ip_network(rule))
                   and net.subnet_of(LOOPBACK_RANGE) for rule in self.allow)

    def permits(self, address: IPAddress, names: Iterable[str] = (), host: bool = False) -> bool:
        """May the guest reach `address`, known to it by `names` (from its DNS answers)?
        `host` says the address is one of the host's own (the filter finds those out)."""
        if host or is_host_address(address):
            return self.permits_host()
        if address.version != 4 or address in GUEST_NET:
            return False  # QEMU's other virtual hosts; IPv6 has no route out
        names = list(names)
        if self._hits(self.deny, address, names):
            return False
        if self._hits(self.allow, address, names):
            return True
        return self.internet

    def permits_name(self, name: str) -> bool:
        """May the guest ask for `name` at all? Names it could never reach are refused at
        once. A name that passes resolves only to the addresses `permits` lets through
        (the filter drops the others from the answer), so an allowed range does not make
        every name resolvable."""
        if any(name_matches(r, name) for r in self.deny if not is_range(r)):
            return False
        return self.internet or any(is_range(r) or name_matches(r, name) for r in self.allow)


def is_host_address(address: IPAddress) -> bool:
    """Does QEMU's user-mode network take `address` to the host itself, whatever the host's
    own addresses are? (Those are found out by the filter, which runs on the host.)"""
    if address.version == 6:
        return address.is_loopback or address.is_unspecified or (
            address.ipv4_mapped is not None and is_host_address(address.ipv4_mapped))
    return address == HOST_ALIAS or any(address in net for net in HOST_RANGES)
