"""A machine's network filter, from the engine's side: start it beside QEMU, give it new
rules, stop it. The filter itself is a process of its own (packetfilter.py): its packet
and DNS code is not imported by commands that only talk to a running machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rewind.engine.network.netrules import NetworkRules
from rewind.engine.process import spawner
from rewind.engine.process.qemu import NET_FROM_GUEST as FROM_GUEST
from rewind.engine.process.qemu import NET_TO_GUEST as TO_GUEST
from rewind.engine.process.qemu import NET_TO_NET as TO_NET
from rewind.engine.process.qemu import start_ticks
from rewind.engine.process.unixsock import connect_unix
from rewind.errors import RewindError

CONTROL = "net-ctl.sock"  # rule changes: one JSON line in, one JSON line out
PID_FILE = "net.pid"
LOG_FILE = "net.log"
CONNECT_TIMEOUT = 60.0


def spawn(runtime: Path, run_dir: Path, tag: str, rules: NetworkRules,
          forwarded: list[int]) -> subprocess.Popen | spawner.Spawned:
    """Start the filter of the QEMU about to be launched in `run_dir` (forked by the home's
    spawner where it answers: a fresh Python took 0.2-0.3 s of CPU beside a starting QEMU),
    letting through the answers of the guest ports in `forwarded`; see wait_ready."""
    for name in (FROM_GUEST, TO_NET, TO_GUEST, CONTROL, PID_FILE):
        (run_dir / name).unlink(missing_ok=True)
    args = [tag, json.dumps(rules.to_json()), json.dumps(sorted(set(forwarded)))]
    forked = spawner.spawn(runtime, spawner.Request("filter", args, cwd=str(run_dir), wait=True))
    if forked is not None:
        return forked
    argv = [sys.executable, "-c", "from rewind.engine.network.packetfilter import main; main()", *args]
    return subprocess.Popen(argv, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def wait_ready(proc: subprocess.Popen | spawner.Spawned, run_dir: Path) -> None:
    try:
        code = proc.wait(timeout=CONNECT_TIMEOUT + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = -1
    if code != 0:
        raise RewindError(f"the network filter did not start (see {run_dir / LOG_FILE})")


def update(run_dir: Path, rules: NetworkRules) -> None:
    """Give the running filter new rules; they apply to the next packet."""
    _ask(run_dir, {"rules": rules.to_json()})


def forward(run_dir: Path, guest_ports: list[int]) -> None:
    """Tell the running filter which guest ports the host forwards to (see ports.py)."""
    _ask(run_dir, {"forwarded": sorted(set(guest_ports))})


def attempts(run_dir: Path) -> list[str]:
    """What the machine tried to reach and its rules refused, since its QEMU started: "tcp
    ADDRESS:PORT (a name it was looked up by)", "udp ...", "icmp ADDRESS", "dns NAME"."""
    found = _ask(run_dir, {"attempts": True}).get("attempts")
    if not isinstance(found, list) or not all(isinstance(a, str) for a in found):
        raise RewindError(f"the network filter of {run_dir.name!r} answered nonsense about attempts")
    return found


def _ask(run_dir: Path, request: dict) -> dict:
    """One request to the running filter over its control socket; its answer."""
    try:
        with connect_unix(run_dir / CONTROL, timeout=10) as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline() or b"{}")
    except (OSError, ValueError) as e:
        raise RewindError(f"the network filter of {run_dir.name!r} is not answering ({e}); "
                          f"its machine has no network until it is restarted") from e
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error", "no reason given") if isinstance(reply, dict) else "no reason given"
        raise RewindError(f"the network filter refused the request: {error}")
    return reply


def write_pid_file() -> None:
    """For the filter itself, in its folder: its PID and start time, which stop() checks
    before it signals (PIDs get reused, and a forked filter's command line is the spawner's)."""
    pid = os.getpid()
    Path(PID_FILE).write_text(f"{pid} {start_ticks(pid)}\n")


def _running(run_dir: Path) -> int | None:
    """The PID of the filter of `run_dir`, if that very process still runs."""
    try:
        pid, ticks = (int(field) for field in (run_dir / PID_FILE).read_text().split())
    except (OSError, ValueError):
        return None
    return pid if start_ticks(pid) == ticks else None


def stop(run_dir: Path) -> None:
    """End the filter by its PID (it also exits by itself when its QEMU does)."""
    pid = _running(run_dir)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 2
            while _running(run_dir) == pid and time.monotonic() < deadline:
                time.sleep(0.005)
            if _running(run_dir) == pid:
                os.kill(pid, signal.SIGKILL)
    for name in (FROM_GUEST, TO_NET, TO_GUEST, CONTROL, PID_FILE):
        (run_dir / name).unlink(missing_ok=True)
