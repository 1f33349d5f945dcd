"""QMP, over QEMU's own client library; this module only adds rewind's errors and waits.

The library (and the asyncio it runs on) is imported by the first session that connects:
commands that never talk to QEMU's monitor, such as `rewind exec`, start 35 ms sooner.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewind.engine.process.unixsock import connect_unix
from rewind.errors import RewindError

if TYPE_CHECKING:
    from qemu.qmp.legacy import QEMUMonitorProtocol


INCOMING_FD = "rewind-incoming"  # the stream load_incoming reads, as QEMU knows it (getfd)


class MonitorError(RewindError):
    """QEMU refused a QMP command or its monitor is unreachable."""


class Monitor:
    """A QMP session with one QEMU. Use as a context manager."""

    def __init__(self, socket_path: Path, timeout: float = 30.0) -> None:
        self._path = socket_path
        self._timeout = timeout
        self._qmp: QEMUMonitorProtocol | None = None
        self.version: tuple[int, int, int] = (0, 0, 0)  # the QEMU's, from its greeting

    def __enter__(self) -> Monitor:
        from qemu.qmp import QMPError
        from qemu.qmp.legacy import QEMUMonitorProtocol

        try:
            sock = connect_unix(self._path, timeout=self._timeout)
        except OSError as e:
            raise MonitorError(f"cannot reach QEMU's monitor at {self._path}: {e.strerror}") from e
        sock.settimeout(None)
        self._qmp = QEMUMonitorProtocol(sock)
        try:
            greeting = self._qmp.connect(negotiate=True) or {}
        except (QMPError, OSError, EOFError) as e:
            self.close()
            raise MonitorError(f"QEMU's monitor did not answer: {e}") from e
        with contextlib.suppress(KeyError, TypeError):
            v = greeting["QMP"]["version"]["qemu"]
            self.version = (int(v["major"]), int(v["minor"]), int(v["micro"]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._qmp is not None:
            # The peer may already be gone (after `quit`); closing must not fail then.
            with contextlib.suppress(Exception):
                self._qmp.close()
            self._qmp = None

    def cmd(self, name: str, **args: Any) -> Any:
        from qemu.qmp import QMPError  # loaded by __enter__

        assert self._qmp is not None, "Monitor used outside its context"
        try:
            reply = self._qmp.cmd_raw(name, args or None)
        except (QMPError, OSError, EOFError) as e:
            raise MonitorError(f"QMP {name} failed: {e or type(e).__name__}") from e
        if "error" in reply:
            raise MonitorError(f"QMP {name}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    def send_fd(self, fd: int, name: str) -> None:
        """Hand QEMU a file descriptor (SCM_RIGHTS), known to it as `name` from then on."""
        from qemu.qmp import QMPError  # loaded by __enter__

        assert self._qmp is not None, "Monitor used outside its context"
        try:
            self._qmp.send_fd_scm(fd)
        except (QMPError, OSError) as e:
            raise MonitorError(f"cannot pass a file descriptor to QEMU: {e}") from e
        self.cmd("getfd", fdname=name)  # replaces one of that name an interrupted capture left

    def quit(self) -> None:
        """Ask QEMU to exit; the monitor closing under us is the expected answer."""
        with contextlib.suppress(MonitorError):
            self.cmd("quit")
        self.close()

    def load_incoming(self, stream: int, what: str, timeout: float = 120.0) -> None:
        """Load the migration stream that file descriptor `stream` reads (`what` names it in
        errors) into this QEMU (started with -incoming defer) and have it run the guest. It
        goes as a descriptor (QEMU forked a shell and `cat` for `exec:`), and the end of the
        load is QEMU's MIGRATION event: polling `query-migrate` overshot by up to 30 ms."""
        self.cmd("migrate-set-capabilities", capabilities=[
            {"capability": "x-ignore-shared", "state": True}, {"capability": "events", "state": True}])
        self.send_fd(stream, INCOMING_FD)
        self.cmd("migrate-incoming", uri=f"fd:{INCOMING_FD}")
        assert self._qmp is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._qmp.pull_event(wait=0.05)
                status = event.get("data", {}).get("status") if event.get("event") == "MIGRATION" else None
            except TimeoutError:  # no news for a while: a load that failed may have ended QEMU
                status = self.cmd("query-migrate").get("status")  # MonitorError if it did
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise MonitorError(f"QEMU could not load {what} (see its qemu.log)")
            if time.monotonic() > deadline:
                raise MonitorError(f"loading {what} did not finish in {timeout:.0f} s")
        self.cmd("cont")  # unless it runs already: it does when the state was saved running

    def wait_event(self, name: str, timeout: float) -> dict:
        """The next event called `name` (earlier ones of other names are dropped)."""
        assert self._qmp is not None, "Monitor used outside its context"
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                event = self._qmp.pull_event(wait=max(left, 0.001))
            except TimeoutError as e:
                raise MonitorError(f"QEMU sent no {name} event within {timeout:.0f} s") from e
            if event and event.get("event") == name:
                return event

    def wait_migration(self, timeout: float = 120.0) -> dict:
        """Poll until the current (outgoing or incoming) migration ends; its final status."""
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            info = self.cmd("query-migrate")
            status = info.get("status")
            if status == "completed":
                return info
            if status in ("failed", "cancelled"):
                raise MonitorError(f"migration {status}: {info.get('error-desc', 'no reason given')}")
            if time.monotonic() > deadline:
                raise MonitorError(f"migration did not finish in {timeout:.0f} s (status {status})")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
