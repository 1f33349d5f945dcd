"""Host side of the guest agent protocol (see rewind/guest/agent.py)."""

from __future__ import annotations

import codecs
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rewind.engine.process.unixsock import connect_unix
from rewind.errors import AgentError, AgentGone, AlreadyExists, GuestFileError, InvalidArgument
from rewind.guest.protocol import CHUNK, Decoder, encode
from rewind.results import ExecResult
from rewind.store.model import is_int

# Resend hello after 50 ms, doubling up to 1 s: rarely (about 3% of sessions here) the first
# one goes unanswered, and another wakes the agent.
HELLO_RETRY_FIRST = 0.05
HELLO_RETRY_MAX = 1.0
CONNECT_TIMEOUT = 30.0  # a session waits this long for the agent's hello (a guest still booting)
HEARTBEAT_AFTER = 2.0  # ping the agent after this much silence during a request
ALIVE_EVERY = 1.0  # while waiting out the grace, check on QEMU and the agent's ports this often
HEARTBEAT_GRACE = 30.0  # and declare it gone after this much more (TCG guests on a busy host are slow)
# What the host keeps of a guest's answers, whatever the guest says: a hostile or broken agent
# must not fill the host's memory or disk, nor hold a caller past the timeout it asked for.
DEFAULT_MAX_OUTPUT = 16 << 20  # per stream of one command
EXEC_DEADLINE_GRACE = 30.0  # after a command's timeout, the guest has this long to report its end


def exec_deadline(timeout: float | None) -> float | None:
    """When a command given `timeout` is given up on, whatever the guest does (monotonic; None
    without a timeout). It covers reaching the agent too: an agent that leaves the host's
    hellos unanswered holds the caller no longer than one that never ends the command."""
    return None if timeout is None else time.monotonic() + timeout + EXEC_DEADLINE_GRACE


@dataclass(frozen=True)
class ExecDefaults:
    """What a machine's image gives every command unless the call says otherwise (an OCI
    image's `Env`, `WorkingDir` and `User`): a call's own env entries and cwd win."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None

    @classmethod
    def from_json(cls, data: dict | None) -> ExecDefaults:
        data = data or {}
        return cls(env=dict(data.get("env") or {}), cwd=data.get("cwd") or None,
                   user=data.get("user") or None)

    def to_json(self) -> dict:
        return {"env": dict(self.env), "cwd": self.cwd, "user": self.user}


OutputCallback = Callable[[str], None]
TIMEOUT_EXIT_CODE = 124  # as GNU timeout, and the guest agent, report a command that timed out


class _PastDeadline(Exception):
    """A request outlived the deadline the host gave it."""


def _text(output: bytearray) -> str:
    """A stream's bytes as text (invalid UTF-8 replaced), its buffer freed as it goes."""
    text = output.decode("utf-8", "replace")
    output.clear()
    return text


# The error a guest's error frame is raised as, by its kind.
GUEST_ERRORS: dict[str, type[AgentError | InvalidArgument | AlreadyExists]] = {
    "bad_request": InvalidArgument,
    "exists": AlreadyExists,
    **dict.fromkeys(("not_found", "is_a_directory", "not_a_file", "not_a_folder", "permission", "os_error"),
                    GuestFileError),
}


def _guest_error(header: dict) -> AgentError | InvalidArgument | AlreadyExists:
    return GUEST_ERRORS.get(str(header.get("kind")), AgentError)(str(header.get("message", "unknown error")))


class AgentClient:
    """One session with the agent on one virtio-serial port. Use as a context manager.

    `alive` is asked whenever the agent is silent, so a dead QEMU is reported
    as such instead of waited on.
    """

    def __init__(self, socket_path: Path, alive: Callable[[], None] = lambda: None,
                 connect_timeout: float = CONNECT_TIMEOUT, defaults: ExecDefaults | None = None) -> None:
        self._path = socket_path
        self._defaults = defaults or ExecDefaults()
        self._alive = alive
        self._connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._decoder = Decoder()
        # Heartbeats of the request being served. An idle pong answering one of these means the
        # agent restarted; other pongs are late answers to earlier requests' heartbeats.
        self._heartbeats: set[str] = set()

    # ---- session ----

    def __enter__(self) -> AgentClient:
        try:
            self._sock = connect_unix(self._path, timeout=5.0)
        except OSError as e:
            self._alive()
            raise AgentGone(f"cannot reach the guest agent: {e.strerror}") from e
        nonce = uuid.uuid4().hex
        deadline = time.monotonic() + self._connect_timeout
        retry = HELLO_RETRY_FIRST
        while True:
            self._send({"t": "hello", "nonce": nonce})
            resend = time.monotonic() + retry
            retry = min(retry * 2, HELLO_RETRY_MAX)
            while time.monotonic() < resend:
                header, _ = self._recv(until=resend)
                if header is not None and header.get("t") == "hello" and header.get("nonce") == nonce:
                    return self
            self._alive()
            if time.monotonic() > deadline:
                self.close()
                raise AgentGone(f"the guest agent did not answer within {self._connect_timeout:.0f} s")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, header: dict, payload: bytes = b"") -> None:
        assert self._sock is not None
        try:
            # A receive leaves its own short timeout on the socket; a send waits as long as a
            # busy guest is given to answer (with the receive's, a 100 MB write failed under load).
            self._sock.settimeout(HEARTBEAT_AFTER + HEARTBEAT_GRACE)
            self._sock.sendall(encode(header, payload))
        except OSError as e:
            self._alive()
            raise AgentGone(f"lost the connection to the guest agent: {e.strerror or e}") from e

    def _request(self, header: dict) -> None:
        """Send the first frame of a new request."""
        self._heartbeats.clear()
        self._send(header)

    def _heartbeat(self) -> str:
        beat = uuid.uuid4().hex[:12]
        self._send({"t": "ping", "id": beat})
        return beat

    def _recv(self, until: float | None = None) -> tuple[dict | None, bytes]:
        """Next frame; (None, b"") if `until` passes first."""
        assert self._sock is not None
        while True:
            frame = self._decoder.next()
            if frame is not None:
                return frame
            wait = None if until is None else until - time.monotonic()
            if wait is not None and wait <= 0:
                return None, b""
            self._sock.settimeout(wait)
            try:
                data = self._sock.recv(1 << 20)
            except TimeoutError:
                return None, b""
            except OSError as e:
                self._alive()
                raise AgentGone(f"lost the connection to the guest agent: {e.strerror or e}") from e
            if not data:
                # Only an exiting QEMU closes the channel: give it a moment to be seen as dead.
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    self._alive()
                    time.sleep(0.05)
                raise AgentGone("the guest agent's channel closed (QEMU exited?)")
            self._decoder.feed(data)

    def _reply(self, deadline: float | None = None) -> tuple[dict, bytes]:
        """Next frame of the current request, checking on the agent when it is silent;
        _PastDeadline once `deadline` (monotonic) passes, however lively the agent is."""
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise _PastDeadline
            until = time.monotonic() + HEARTBEAT_AFTER
            header, payload = self._recv(until=until if deadline is None else min(until, deadline))
            if header is None and deadline is not None and time.monotonic() >= deadline:
                raise _PastDeadline
            if header is None:
                self._alive()
                self._heartbeats.add(self._heartbeat())
                header, payload = self._awaited_pong()
            if header.get("t") == "pong" and not header.get("busy") and header.get("id") in self._heartbeats:
                # An idle agent answered: the one serving this request is gone (killed and restarted).
                raise AgentGone("the guest agent restarted while serving this request (was it killed?); "
                                "the request's outcome is unknown")
            if header.get("t") in ("pong", "hello"):
                continue  # heartbeats, and answers to hellos resent while the agent was starting
            if header.get("t") == "error":
                raise _guest_error(header)
            return header, payload

    def _awaited_pong(self) -> tuple[dict, bytes]:
        """The next frame after a heartbeat, asking `alive` every ALIVE_EVERY seconds meanwhile:
        a guest whose agent is gone for good is then reported in seconds, not after the grace."""
        deadline = time.monotonic() + HEARTBEAT_GRACE
        while True:
            header, payload = self._recv(until=min(deadline, time.monotonic() + ALIVE_EVERY))
            if header is not None:
                return header, payload
            self._alive()
            if time.monotonic() >= deadline:
                raise AgentGone("the guest agent stopped answering (killed, or the guest hung)")

    # ---- requests ----

    def ping(self) -> float:
        """The guest's uptime in seconds."""
        beat = self._heartbeat()
        deadline = time.monotonic() + HEARTBEAT_GRACE
        while True:
            header, _ = self._recv(until=deadline)
            if header is None:
                self._alive()
                raise AgentGone("the guest agent did not answer a ping")
            if header.get("t") == "pong" and header.get("id") == beat:
                uptime = header.get("uptime", 0.0)
                if not isinstance(uptime, int | float) or isinstance(uptime, bool):
                    raise AgentError("the guest agent sent a malformed uptime")
                return float(uptime)

    def _reply_of(self, kind: str) -> tuple[dict, bytes]:
        header, payload = self._reply()
        if header.get("t") != kind:
            raise AgentError(f"the guest agent answered {header.get('t')!r}, expected {kind!r}")
        return header, payload

    def exec(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stdin: bytes | None = None, max_output: int | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None, deadline: float | None = None) -> ExecResult:
        """Run `argv` to its end. Past `deadline` (monotonic; by default `timeout` plus
        EXEC_DEADLINE_GRACE from now) the call returns timed out, whatever the guest does."""
        cap = DEFAULT_MAX_OUTPUT if max_output is None else max_output
        given = self._defaults
        request: dict = {"t": "exec", "argv": argv, "cwd": cwd or given.cwd,
                         "env": {**given.env, **(env or {})}, "timeout": timeout,
                         "stdin": stdin is not None, "max_output": cap}
        if given.user is not None:
            request["user"] = given.user
        if deadline is None:
            deadline = exec_deadline(timeout)
        self._request(request)
        if stdin is not None:
            for at in range(0, len(stdin), CHUNK):
                self._send({"t": "stdin"}, stdin[at : at + CHUNK])
            self._send({"t": "stdin_end"})
        # Kept as bytes, decoded once at the end: text of a stream cut at `cap` bytes can take
        # four bytes a character, and pieces joined at the end doubled that (a hostile agent's
        # flood raised the caller's peak memory by 382 MiB at the default cap).
        kept = {1: bytearray(), 2: bytearray()}
        decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in (1, 2)}
        callbacks = {1: on_stdout, 2: on_stderr}
        cut = {1: False, 2: False}
        while True:
            try:
                header, payload = self._reply(deadline)
            except _PastDeadline:
                # The guest did not end the command at its timeout: the session is dropped, which
                # makes an agent that still listens kill the command's process group.
                self.close()
                return ExecResult(exit_code=TIMEOUT_EXIT_CODE, stdout=_text(kept[1]), stderr=_text(kept[2]),
                                  timed_out=True, stdout_truncated=cut[1], stderr_truncated=cut[2])
            kind = header.get("t")
            if kind == "out":
                fd = 1 if header.get("fd") == 1 else 2
                if len(payload) > cap - len(kept[fd]):
                    cut[fd], payload = True, payload[: cap - len(kept[fd])]
                kept[fd] += payload
                if callbacks[fd] and (text := decoders[fd].decode(payload)):
                    callbacks[fd](text)
            elif kind == "exit":
                for fd in (1, 2):
                    if callbacks[fd] and (tail := decoders[fd].decode(b"", final=True)):
                        callbacks[fd](tail)
                code, truncated = header.get("code"), header.get("truncated", [False, False])
                if not is_int(code) or not (isinstance(truncated, list) and len(truncated) == 2):
                    raise AgentError(f"the guest agent sent a malformed exit: code {str(code)[:40]!r}")
                return ExecResult(exit_code=code, stdout=_text(kept[1]), stderr=_text(kept[2]),
                                  timed_out=bool(header.get("timed_out")),
                                  stdout_truncated=bool(truncated[0]) or cut[1],
                                  stderr_truncated=bool(truncated[1]) or cut[2])
            else:
                raise AgentError(f"unexpected frame from the guest agent: {kind!r}")

    def read_file(self, path: str, sink: BinaryIO, max_bytes: int) -> int:
        """Copy a guest file into `sink`; returns its mode bits. GuestFileError (and the
        session closed, which ends the guest's read) once it passes `max_bytes`."""
        self._request({"t": "read", "path": path})
        header, _ = self._reply_of("file")
        mode = header.get("mode", 0o644)
        if not is_int(mode) or not 0 <= mode <= 0o7777:
            raise AgentError(f"the guest agent sent a malformed file mode {str(mode)[:40]!r}")
        for data in self._data(path, max_bytes):
            sink.write(data)
        return mode

    def write_file(self, path: str, source: BinaryIO, mode: int | None = None) -> None:
        """Write `source` to a guest file, atomically (it appears whole or not at all)."""
        request: dict = {"t": "write", "path": path}
        if mode is not None:
            request["mode"] = mode
        self._request(request)
        self._reply_of("ready")
        self._stream(iter(lambda: source.read(CHUNK), b""))
        self._reply_of("ok")

    def tar(self, path: str, max_bytes: int) -> Iterator[bytes]:
        """A guest folder as a tar stream (see guest/tree.py), in pieces; the request is sent
        when the first is asked for. GuestFileError past `max_bytes`, as read_file."""
        self._request({"t": "tar", "path": path})
        self._reply_of("tree")
        yield from self._data(f"{path} as a tar stream", max_bytes)

    def untar(self, path: str, name: str | None, blocks: Iterable[bytes]) -> dict[str, int]:
        """Unpack the tar stream `blocks` into a new guest folder: `path`, or `path/name` if
        `path` is a folder (see guest/tree.py target). What the guest wrote: files, folders,
        links, bytes."""
        self._request({"t": "untar", "path": path, "name": name})
        self._reply_of("ready")
        self._stream(blocks)
        header, _ = self._reply_of("ok")
        counts = {key: header.get(key) for key in ("files", "folders", "links", "bytes")}
        if not all(is_int(n) and n >= 0 for n in counts.values()):
            raise AgentError("the guest agent sent malformed counts for an untar")
        return counts

    def _data(self, what: str, max_bytes: int) -> Iterator[bytes]:
        """The data frames of this request's answer, up to its `end`. Past `max_bytes` the
        session is closed (which ends the guest's sending) and GuestFileError raised."""
        size = 0
        while True:
            header, payload = self._reply()
            if header.get("t") == "end":
                return
            if header.get("t") != "data":
                raise AgentError(f"unexpected frame during a read: {header.get('t')!r}")
            size += len(payload)
            if size > max_bytes:
                self.close()
                raise GuestFileError(f"{what} is larger than {max_bytes} bytes, the most this read takes "
                                     "(see max_bytes)")
            yield payload

    def _stream(self, blocks: Iterable[bytes]) -> None:
        """Send `blocks` as data frames, then `end`. If the guest answers first (it failed part
        way: a full disk), the rest is not sent and its error is raised; if `blocks` fails (a
        host file unreadable), the guest is told the data ended before that is raised."""
        source = iter(blocks)
        while True:
            try:
                block = next(source, None)
            except Exception:
                self._cut_short()
                raise
            if block is None:
                break
            if (early := self._early_answer()) is not None:
                self._cut_short()
                if early.get("t") == "error":
                    raise _guest_error(early)
                raise AgentError(f"the guest agent answered {early.get('t')!r} before the data's end")
            self._send({"t": "data"}, block)
        self._send({"t": "end"})

    def _cut_short(self) -> None:
        """End the data of a request given up on, and wait until the guest has read all of it
        (a ping's answer comes after): QEMU drops what the guest has not read when the host
        hangs up, and a frame cut in two there left that port's agent deaf to the next
        client's hello (seen after a full disk stopped a folder upload)."""
        self._send({"t": "end"})
        self.ping()

    def _early_answer(self) -> dict | None:
        """A frame the agent has sent, if any, while the host sends it data (late answers to
        hellos and heartbeats aside)."""
        assert self._sock is not None
        while (frame := self._decoder.next()) is not None or select.select([self._sock], [], [], 0)[0]:
            header, _ = frame or self._recv(until=time.monotonic() + HEARTBEAT_AFTER)
            if header is not None and header.get("t") not in ("hello", "pong"):
                return header
        return None

    def git(self, action: str, folder: str) -> dict:
        """The git tier in the guest: `save` or `restore` a project folder (see guest/gittier.py)."""
        self._request({"t": "git", "action": action, "folder": folder})
        header, _ = self._reply_of("ok")
        return {k: v for k, v in header.items() if k != "t"}

    def sync(self, timeout: float) -> dict:
        """Have the guest write its cached writes to its disk; returns what it says runs and
        listens (see guest/agent.py handle_sync). AgentGone if that takes over `timeout` s."""
        self._request({"t": "sync"})
        header, _ = self._recv(until=time.monotonic() + timeout)
        while header is not None and header.get("t") in ("pong", "hello"):
            header, _ = self._recv(until=time.monotonic() + timeout)
        if header is None:
            raise AgentGone(f"the guest did not write its disk out within {timeout:.0f} s")
        if header.get("t") != "synced":
            raise AgentError(f"the guest agent answered {header.get('t')!r} to a sync")
        return {k: v for k, v in header.items() if k != "t"}

    def set_identity(self, **fields: object) -> None:
        """Hostname, machine id, MAC, entropy seed and clock, applied in the guest."""
        self._request({"t": "identity", **fields})
        self._reply_of("ok")
