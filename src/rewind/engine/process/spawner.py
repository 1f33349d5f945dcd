"""rewind's background processes, forked from one warm process per home instead of started
afresh.

Every checkpoint starts a committer and a memory splitter or assembler, every machine start a
network filter: each a new Python that imported rewind, dpkt, asyncio, BLAKE3 and zstandard
first, 0.1-0.3 s of CPU each here (0.15 s a committer, 0.2-0.3 s a filter). An agent's loop
starts about ten of them a round, on two cores shared with the guests. So one process per
home (this module's main) imports all of that once, listens on `spawner.sock` in the home's
private runtime folder and forks a child per request, which costs milliseconds. Each child
is a process of its own, as before: one failing takes nothing else with it.

Requests name a fixed target (TARGETS), never code. The child sends {"pid": ...} at once
and, when asked to `wait`, {"exit": CODE} when the target returns. The spawner ends itself
once it has been idle for IDLE_EXIT_S or its socket file is gone (the runtime folder was
removed), so nothing outlives a test's home. Callers fall back to a fresh process whenever
the spawner cannot be reached.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from rewind import crashpoints
from rewind.engine.process.unixsock import connect_unix
from rewind.store.locks import acquire

SOCKET = "spawner.sock"
LOCK = "spawner.lock"
IDLE_EXIT_S = 600.0
START_TIMEOUT_S = 3.0  # its imports took 0.4-0.8 s here
PROTOCOL = 1

# name: (module, function, comm shown by ps)
TARGETS = {
    "commit": ("rewind.engine.pending", "main", "rewind-commit"),
    "filter": ("rewind.engine.network.packetfilter", "main", "rewind-filter"),
    "split": ("rewind.engine.memory.migstream", "run", "rewind-split"),
    "assemble": ("rewind.engine.memory.pagecapture", "run", "rewind-assemble"),
}
MAX_FDS = 8
MAX_REQUEST = 1 << 16


# Where an encrypted store's password comes from (store/crypto.py's password_from_env); not
# imported from there, which would load the cipher library into every spawner.
PASSWORD_ENV = ("REWIND_PASSWORD_FILE", "REWIND_PASSWORD")


@dataclass(frozen=True)
class Request:
    """One child to start: TARGETS[target] run with sys.argv = [target, *args]. File
    descriptors sent along with the request are the child's; "{fd0}", "{fd1}"... in `args`
    stand for their numbers there."""

    target: str
    args: list[str]
    cwd: str = "/"
    nice: int = 0
    wait: bool = False
    code: str = ""  # the caller's code_version(): a spawner running other code must not serve it
    # The caller's crashpoints.environment(): the child is armed as a fresh process would be.
    crash: dict[str, str] = field(default_factory=dict)
    # The caller's store password variables: a committer opens an encrypted store with the
    # password of the process that asked for it, not of whichever one started the spawner.
    password: dict[str, str] = field(default_factory=dict)
    version: int = PROTOCOL

    @classmethod
    def from_json(cls, data: object) -> Request:
        if not isinstance(data, dict):
            raise ValueError("a request is a JSON object")
        if data.get("version") != PROTOCOL or data.get("target") not in TARGETS:
            raise ValueError(f"bad request: {data!r}")
        if data.get("code") != code_version():
            raise StaleSpawner
        args = data.get("args")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("bad request arguments")
        cwd, nice, crash = data.get("cwd", "/"), data.get("nice", 0), data.get("crash", {})
        password = data.get("password", {})
        if not isinstance(cwd, str) or not isinstance(nice, int):
            raise ValueError("bad request cwd or nice")
        if not isinstance(crash, dict) or set(crash) - set(crashpoints.environment()) or \
                not all(isinstance(v, str) for v in crash.values()):
            raise ValueError("bad request crash settings")
        if not isinstance(password, dict) or set(password) - set(PASSWORD_ENV) or \
                not all(isinstance(v, str) for v in password.values()):
            raise ValueError("bad request password settings")
        return cls(target=data["target"], args=args, cwd=cwd, nice=nice, wait=data.get("wait") is True,
                   code=data["code"], crash=crash, password=password)


class StaleSpawner(Exception):
    """The spawner runs other code than its caller (rewind was upgraded since it started)."""


@functools.cache
def code_version() -> str:
    """Which rewind code this process runs: where it is and when its modules last changed."""
    package = Path(__file__).resolve().parent.parent
    latest = max(p.stat().st_mtime_ns for p in package.rglob("*.py"))
    return f"{package}:{latest}"


class Spawned:
    """A child started through the spawner: its pid, and its exit code if it was asked to
    report one (the same calls as subprocess.Popen's that rewind uses)."""

    def __init__(self, conn: socket.socket, reader: BinaryIO, pid: int) -> None:
        self._conn = conn
        self._reader = reader  # the one that read the pid: it may hold the exit line already
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = self._reader.readline()
            except TimeoutError as e:
                raise subprocess.TimeoutExpired("spawned " + str(self.pid), timeout or 0) from e
            finally:
                self._conn.close()
            try:
                self.returncode = int(json.loads(line)["exit"])
            except (ValueError, KeyError, TypeError):
                self.returncode = -1  # it died before reporting
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.returncode is None:
            self.returncode = -signal.SIGKILL
            self._conn.close()


def spawn(runtime: Path, request: Request, fds: tuple[int, ...] = ()) -> Spawned | None:
    """Start `request` through the home's spawner (started if need be), passing it `fds`;
    None if that cannot be done now, for the caller to start a fresh process instead."""
    path = runtime / SOCKET
    try:
        conn = _connect(path)
    except OSError:
        starting = _start(runtime)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                conn = _connect(path)
                break
            except OSError:
                # One that exited at once lost the start to another (which binds soon) or
                # failed: waited for up to the deadline either way, then done without.
                if time.monotonic() > deadline or (starting.poll() not in (None, 0)):
                    return None
                time.sleep(0.02)
    request = replace(request, code=code_version(), crash=crashpoints.environment(),
                      password={name: os.environ.get(name, "") for name in PASSWORD_ENV})
    try:
        conn.settimeout(10)
        socket.send_fds(conn, [json.dumps(asdict(request)).encode() + b"\n"], list(fds))
        reader = conn.makefile("rb")
        pid = int(json.loads(reader.readline())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
        return None
    spawned = Spawned(conn, reader, pid)
    if not request.wait:
        conn.close()
    return spawned


def _connect(path: Path) -> socket.socket:
    return connect_unix(path, timeout=2)


def _start(runtime: Path) -> subprocess.Popen:
    """The spawner, in a session of its own: it outlives its caller."""
    return subprocess.Popen([sys.executable, "-m", "rewind.engine.process.spawner", str(runtime)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


# ---- the spawner process ----

def main() -> None:
    runtime = Path(sys.argv[1])
    code_version()  # of the code it loads now, whatever changes later
    lock = acquire(runtime / LOCK, exclusive=True, timeout=0)  # held until this process ends
    if lock is None:
        return  # another one serves this home
    for module, _, _ in TARGETS.values():
        importlib.import_module(module)  # the point of this process: imported once
    path = runtime / SOCKET
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.chdir(runtime)
    server.bind(SOCKET)  # by its short name: the full path may exceed the 107 bytes allowed
    os.chdir("/")
    server.listen(16)
    server.settimeout(1.0)
    inode = path.stat().st_ino
    idle_since = time.monotonic()
    while _still_ours(path, inode) and time.monotonic() - idle_since < IDLE_EXIT_S:
        _reap()
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        idle_since = time.monotonic()
        with conn:
            try:
                _serve(conn, spawner_fds=(server.fileno(), lock))
            except StaleSpawner:
                break  # its caller starts a fresh process now, and the next spawn a new spawner
    server.close()
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_ino == inode:
            path.unlink()


def _still_ours(path: Path, inode: int) -> bool:
    try:
        return path.stat().st_ino == inode
    except OSError:
        return False


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _serve(conn: socket.socket, spawner_fds: tuple[int, ...]) -> None:
    conn.settimeout(5)
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, MAX_FDS)
        while message and not message.endswith(b"\n") and len(message) < MAX_REQUEST:
            more = conn.recv(MAX_REQUEST)
            if not more:
                break
            message += more
        request = Request.from_json(json.loads(message))
        numbers = {f"{{fd{i}}}": str(fd) for i, fd in enumerate(fds)}  # whole arguments only
        request = replace(request, args=[numbers.get(arg, arg) for arg in request.args])
        if os.fork() == 0:
            # The child keeps neither the listening socket nor the lock: a filter that
            # outlives the spawner would otherwise keep the next one from starting.
            for fd in spawner_fds:
                os.close(fd)
            _run_child(conn, request)
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return
    finally:
        for fd in fds:  # the child's alone: a pipe end left here would keep its peer waiting
            os.close(fd)


def _run_child(conn: socket.socket, request: Request) -> None:
    """In the forked child: become the target, report, and never return to the spawner."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request.cwd)
        if request.nice:
            os.nice(request.nice)
        module, function, comm = TARGETS[request.target]
        _set_comm(comm)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        if not request.wait:
            conn.close()
        sys.argv = [request.target, *request.args]
        os.environ.update(request.crash)
        os.environ.update(request.password)
        # What the target forks (a filter's daemon half) must not hold this connection: the
        # caller reads it until this process reports.
        os.register_at_fork(after_in_child=conn.close)
        try:
            getattr(importlib.import_module(module), function)()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if request.wait:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    except BaseException:  # a child must never unwind into the spawner's loop
        code = 1
    finally:
        os._exit(code)


def _set_comm(name: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


if __name__ == "__main__":
    main()
