"""Guest services from the host: a port on the host that leads to a port in the guest.

A forward belongs to the machine, not to one QEMU: it is kept in the machine's record and
set up again in every QEMU the machine runs in (start, restore, a kept try), through the
user-mode network's `hostfwd_add`. QEMU listens on the host's address and port and opens a
connection to the guest's address (10.0.2.15) for each one it accepts, so a guest service
must listen on that address or on every address (0.0.0.0), not only on 127.0.0.1.

The guest's answers go out through the machine's network filter like every packet it
sends; the filter lets through what comes from a forwarded guest port and is not a new
connection (a TCP segment that is not a bare SYN), so a forward opens nothing else: QEMU
answers any other segment of a connection it does not know with a reset.
"""

from __future__ import annotations

import socket

from rewind.engine.network.netrules import GUEST_ADDRESS
from rewind.engine.process.qmp import Monitor, MonitorError
from rewind.errors import InvalidArgument, PortError
from rewind.results import PortForward

NETDEV = "net0"


def check_port(value: int | None, what: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise InvalidArgument(f"{what} must be a port number from 1 to 65535 (got {value!r})")
    return value


def check_host(host: str) -> str:
    try:
        socket.inet_pton(socket.AF_INET, host)
    except (OSError, TypeError) as e:
        raise InvalidArgument(f"a forward listens on an IPv4 address of this host, not {host!r}") from e
    return host


def free_port(host: str) -> int:
    """A port nothing on `host` listens on now (QEMU binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def add(monitor: Monitor, forward: PortForward) -> None:
    """Set `forward` up in the QEMU behind `monitor`."""
    said = _hmp(monitor, f"hostfwd_add {NETDEV} {_rule(forward)}", forward)
    if said:  # HMP answers failures as text, not as a QMP error; success says nothing
        raise PortError(f"cannot forward {forward.host}:{forward.port} to guest port "
                        f"{forward.guest_port}: {said.splitlines()[0]} (is the host port in use?)")


def remove(monitor: Monitor, forward: PortForward) -> None:
    said = _hmp(monitor, f"hostfwd_remove {NETDEV} tcp:{forward.host}:{forward.port}", forward)
    if "removed" not in said:
        raise PortError(f"cannot end the forward of {forward.host}:{forward.port}: {said or 'no answer'}")


def _hmp(monitor: Monitor, command: str, forward: PortForward) -> str:
    try:
        return (monitor.cmd("human-monitor-command", **{"command-line": command}) or "").strip()
    except MonitorError as e:
        raise PortError(f"cannot change the forward of {forward.host}:{forward.port}: {e}") from e


def _rule(forward: PortForward) -> str:
    """The forward as QEMU's user network writes it (hostfwd_add)."""
    return f"tcp:{forward.host}:{forward.port}-{GUEST_ADDRESS}:{forward.guest_port}"
