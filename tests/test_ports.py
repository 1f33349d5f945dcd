"""Guest services from the host (`rewind port`, `sbx.ports`): a real web server in a real
guest, reached through a forward that belongs to the machine, not to one QEMU."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request

import pytest
from conftest import rewind_cli
from invariants import wait_until
from serving import home_env

from rewind import AlreadyExists, Home, InvalidArgument, NotFound, Sandbox, try_in_copy
from rewind.errors import PortError

WEB_PORT = 8000


def serve_web(sbx: Sandbox, text: str) -> None:
    """A web server on every guest address (as a forward needs), serving `text` at /."""
    sbx.exec(f"mkdir -p /srv && printf '{text}' > /srv/index.html", check=True)
    sbx.exec(f"setsid python3 -m http.server {WEB_PORT} --bind 0.0.0.0 --directory /srv "
             ">/tmp/web.log 2>&1 < /dev/null &", check=True)


def fetch(url: str) -> str | None:
    """The page at `url`, or None if nothing answers there (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def wait_for_page(url: str, text: str) -> None:
    wait_until(lambda: fetch(url) == text, f"{url} serving {text!r}", timeout=60)


def listening_on(port: int) -> list[str]:
    """The local addresses of sockets listening on `port` on this host (IPv4, /proc/net/tcp)."""
    found = []
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.fixture
def web(home: Home) -> Sandbox:
    sbx = Sandbox.create("web", home=home)
    serve_web(sbx, "first")
    return sbx


def test_a_forward_reaches_the_guest_server_and_outlives_its_qemu(web: Sandbox) -> None:
    forward = web.ports.forward(WEB_PORT)
    assert forward.host == "127.0.0.1" and forward.guest_port == WEB_PORT
    wait_for_page(forward.url, "first")
    assert listening_on(forward.port) == ["127.0.0.1"]  # not reachable from outside this host

    point = web.checkpoint()
    serve_web(web, "changed")  # the running server serves the new file
    wait_for_page(forward.url, "changed")
    web.restore(point.id)  # a new QEMU: the forward is set up in it again
    assert fetch(forward.url) == "first"
    assert web.ports.list() == [forward]

    # A try that is kept: the copy takes over the machine, and its forward.
    outcome = try_in_copy(web, "printf kept > /srv/index.html")
    assert outcome.kept, outcome
    assert fetch(forward.url) == "kept"

    web.stop()
    assert fetch(forward.url) is None
    web.start()  # a cold boot: the server must be started again, the forward is there
    serve_web(web, "booted")
    wait_for_page(forward.url, "booted")

    assert web.ports.remove(WEB_PORT) == forward
    assert fetch(forward.url) is None and web.ports.list() == []


def test_a_forward_opens_nothing_else(web: Sandbox) -> None:
    # A host service on loopback, and a machine cut off from everything: the forward's answers
    # go out, but a connection from the forwarded port to the host is still refused.
    with socket.socket() as host_service:
        host_service.bind(("127.0.0.1", 0))
        host_service.listen()
        service_port = host_service.getsockname()[1]
        web.network.off()
        forward = web.ports.forward(WEB_PORT)
        wait_for_page(forward.url, "first")
        probe = ("import socket; s = socket.socket(); "
                 "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                 f"s.bind(('0.0.0.0', {WEB_PORT + 1})); s.settimeout(5); "
                 f"print(s.connect_ex(('10.0.2.2', {service_port})))")
        web.ports.forward(WEB_PORT + 1)
        r = web.exec(["python3", "-c", probe], timeout=30)
        assert r.ok and r.stdout.strip() != "0", r  # refused: the filter answers a bare SYN with a reset
        host_service.settimeout(0.5)
        with pytest.raises(TimeoutError):
            host_service.accept()


def test_bad_forwards_are_clear_errors_and_the_machine_runs_on(web: Sandbox) -> None:
    forward = web.ports.forward(WEB_PORT)
    with pytest.raises(AlreadyExists, match="forwarded already"):
        web.ports.forward(WEB_PORT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortError, match="in use"):
            web.ports.forward(WEB_PORT + 1, taken.getsockname()[1])
    for bad in (0, 70000, "80"):
        with pytest.raises(InvalidArgument):
            web.ports.forward(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="IPv4 address"):
        web.ports.forward(WEB_PORT + 2, host="not-an-address")
    with pytest.raises(NotFound, match="not forwarded"):
        web.ports.remove(WEB_PORT + 3)
    assert web.ports.list() == [forward]
    wait_for_page(forward.url, "first")


def test_the_cli_forwards_lists_and_removes(web: Sandbox, home: Home) -> None:
    env = home_env(home)
    r = rewind_cli("port", "web", str(WEB_PORT), "--json", env=env)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert set(shown) == {"host", "port", "guest_port"} and shown["guest_port"] == WEB_PORT
    wait_for_page(f"http://127.0.0.1:{shown['port']}", "first")
    listed = rewind_cli("port", "web", "--json", env=env)
    assert json.loads(listed.stdout) == [shown]
    plain = rewind_cli("port", "web", env=env)
    assert plain.stdout.decode().strip() == f"127.0.0.1:{shown['port']} -> web:{WEB_PORT}"
    again = rewind_cli("port", "web", str(WEB_PORT), env=env)
    err = again.stderr.decode()
    assert again.returncode == 1 and "forwarded already" in err and len(err.strip().splitlines()) == 1
    assert rewind_cli("port", "web", str(WEB_PORT), "--remove", env=env).returncode == 0
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", shown["port"]), timeout=2):
        pytest.fail("the removed forward still answers")
