"""Network rules enforced on the host: what root in a real guest can and cannot reach."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rewind import Home, InvalidArgument, Sandbox
from rewind.engine.netrules import NetworkRules


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


@pytest.fixture
def outside() -> Iterator[tuple[str, Listener]]:
    address = host_address()
    listener = Listener(address)
    yield address, listener
    listener.close()


def connect(sbx: Sandbox, address: str, port: int) -> tuple[bool, str, float]:
    """Connect from the guest (as root, with bash's /dev/tcp); (reached, error text, seconds)."""
    started = time.monotonic()
    r = sbx.exec(f"exec 3<>/dev/tcp/{address}/{port} && head -1 <&3", timeout=30)
    reached = r.exit_code == 0 and "hello from the host" in r.stdout
    return reached, r.stderr.strip(), time.monotonic() - started


def test_rules_enforced_on_the_host(home: Home, loopback: Listener, outside: tuple[str, Listener]) -> None:
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
    sbx = Sandbox.create("dns", home=home)
    found = sbx.exec(f"getent hosts {name}", timeout=30)
    assert found.exit_code == 0 and name in found.stdout
    sbx.network.set(internet=True, deny=[name])
    assert sbx.exec(f"getent hosts {name}", timeout=30).exit_code != 0
    sbx.network.set(internet=False, allow=[name])
    assert sbx.exec(f"getent hosts {name}", timeout=30).exit_code == 0
    assert sbx.exec("getent hosts other.invalid", timeout=30).exit_code != 0


def test_rules_survive_checkpoint_restore_and_fork(home: Home, outside: tuple[str, Listener]) -> None:
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
    assert rules.permits_name("api.example.com") and not rules.permits_name("bad.example.com")
    assert not NetworkRules.parse(internet=True).permits(ip("127.0.0.1"))
    assert NetworkRules.parse(internet=True).permits(ip("8.8.8.8"))
