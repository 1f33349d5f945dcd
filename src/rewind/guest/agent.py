"""The rewind guest agent: runs inside the machine, serves the host over a virtio-serial port.

One host client per port at a time (the host locks the port). Every client
starts with a `hello` carrying a nonce; the agent answers it, which tells the
client where the fresh stream begins. When a hello with a new nonce arrives
mid-request, or output finds no client connected for HOST_GONE_AFTER seconds,
the request is abandoned: a running command's process group is killed and a
half-written file is removed.

Standard library only, except the git tier (gittier.py, which uses Debian's
python3-dulwich); the image builder puts these files, with a copy of the Python
they run on, on the guest's read-only runtime disk (see image/build.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tree  # noqa: E402
from protocol import CHUNK, Decoder, encode  # noqa: E402

try:  # loaded now, once, so that no request pays for it (images without dulwich lack the git tier)
    import gittier  # noqa: E402
except ImportError:
    gittier = None

PORT_PREFIX = "rewind.agent."
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "USER": "root",
}
DEFAULT_OUTPUT_CAP = 16 << 20
TIMEOUT_EXIT_CODE = 124  # as GNU timeout reports it
HOST_GONE_AFTER = 2.0  # seconds without a host before output is abandoned
# What a request's reader takes in ahead of what it has handled (two whole frames at least):
# reading all that was there held 400 MB of a folder upload, and the OOM killer took the agent.
READ_AHEAD = 4 << 20


class Reset(Exception):
    """The client went away, or a new client said hello mid-request."""

    def __init__(self, nonce: str | None = None) -> None:
        super().__init__(nonce)
        self.nonce = nonce


class RequestError(Exception):
    """A request that cannot be served; reported to the client as an error frame."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def find_ports() -> list[str]:
    """The agent's virtio-serial ports, one per concurrent host session."""
    base = "/sys/class/virtio-ports"
    while True:
        found = []
        for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            try:
                with open(os.path.join(base, dev, "name")) as f:
                    if f.read().strip().startswith(PORT_PREFIX):
                        found.append("/dev/" + dev)
            except OSError:
                continue
        if found:
            return found
        time.sleep(0.1)


class Port:
    """The virtio-serial port, non-blocking, with frame decoding.

    Sessions are told apart by the nonce of their hello, not by the port's
    connect and disconnect events: the guest may see a client's disconnect
    only after the next client's first bytes (the events and the data travel
    on different queues), so EOF never discards data or ends a request.
    """

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.decoder = Decoder()
        # Edge-triggered: while no host is connected the port reports IN|HUP
        # continuously; an edge wakes us only when that changes.
        self.edges = select.epoll()
        self.edges.register(self.fd, select.EPOLLIN | select.EPOLLET)
        # Level-triggered: it must report HUP at once if the host is gone.
        self.write_wait = select.poll()
        self.write_wait.register(self.fd, select.POLLOUT)
        self.host_gone = False
        self.session: str | None = None  # the nonce of the client being served

    def pump(self, limit: int | None = None) -> bool:
        """Read what is available into the decoder, while it holds less than `limit` bytes if
        given; True if it stopped there (more may be waiting)."""
        while True:
            if limit is not None and self.decoder.buffered() >= limit:
                return True
            try:
                data = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return False
            if not data:
                self.host_gone = True  # for now: wait for an edge before reading again
                return False
            self.decoder.feed(data)

    def take(self, in_request: bool) -> tuple[dict, bytes] | None:
        while (frame := self.decoder.next()) is not None and frame[0].get("t") == "hello":
            nonce = frame[0].get("nonce")
            if nonce != self.session:
                if in_request:
                    raise Reset(nonce)  # a new client: whatever the old one asked is abandoned
                self.session = nonce
            # The current client resends its hello until answered; answer each, abandon nothing.
            self.send({"t": "hello", "nonce": nonce})
        return frame

    def recv(self, in_request: bool = True) -> tuple[dict, bytes]:
        """The next frame."""
        while True:
            frame = self.take(in_request)
            if frame:
                return frame
            if self.host_gone:
                self.edges.poll(5.0)  # bounded, in case an edge is missed
                self.host_gone = False
            more = self.pump(READ_AHEAD)
            frame = self.take(in_request)
            if frame:
                return frame
            if not self.host_gone and not more:
                self.edges.poll(1.0)

    def heed(self) -> None:
        """Between the frames of a long answer: a new client's hello abandons it (Reset), and
        heartbeats are answered. Without it, a client that gave up on a big folder's stream
        left the next one waiting, unanswered, for the rest of that stream."""
        self.pump()
        while (frame := self.take(in_request=True)) is not None:
            if frame[0].get("t") == "ping":
                self.send(pong(frame[0], busy=True))

    def send(self, header: dict, payload: bytes = b"") -> None:
        """Write a frame. If no host is connected for HOST_GONE_AFTER seconds, the client
        is taken to be gone: Reset."""
        view = memoryview(encode(header, payload))
        gone_since = None
        while view:
            try:
                view = view[os.write(self.fd, view) :]
                gone_since = None
            except BlockingIOError:
                events = self.write_wait.poll(1000)
                if any(ev & select.POLLHUP for _, ev in events):
                    now = time.monotonic()
                    gone_since = gone_since or now
                    if now - gone_since > HOST_GONE_AFTER:
                        raise Reset() from None
                    time.sleep(0.01)


def error_frame(kind: str, message: str) -> dict:
    return {"t": "error", "kind": kind, "message": message}


# ---- exec -----------------------------------------------------------------


def handle_exec(port: Port, req: dict, _payload: bytes) -> None:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise RequestError("bad_request", "argv must be a non-empty list of strings")
    cwd = req.get("cwd") or ("/root" if os.path.isdir("/root") else "/")
    if not os.path.isdir(cwd):
        raise RequestError("bad_request", f"working directory does not exist: {cwd}")
    env = dict(DEFAULT_ENV)
    user = find_user(req.get("user"))
    if user is not None:
        env.update(HOME=user.home, USER=user.name)
    env.update(req.get("env") or {})
    timeout = req.get("timeout")
    cap = int(req.get("max_output", DEFAULT_OUTPUT_CAP))
    if argv[0] == "bash" and len(argv) == 3 and argv[1] == "-c" and not on_path("bash", env):
        argv = ["sh", *argv[1:]]  # an image without bash (busybox, alpine): its sh runs the line
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if req.get("stdin") else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **({} if user is None else {"user": user.uid, "group": user.gid, "extra_groups": user.groups}),
        )
    except FileNotFoundError:
        port.send({"t": "out", "fd": 2}, f"rewind: {argv[0]}: command not found\n".encode())
        port.send({"t": "exit", "code": 127, "timed_out": False, "truncated": [False, False]})
        return
    except PermissionError:
        port.send({"t": "out", "fd": 2}, f"rewind: {argv[0]}: permission denied\n".encode())
        port.send({"t": "exit", "code": 126, "timed_out": False, "truncated": [False, False]})
        return
    try:
        code, timed_out, truncated = run_process(port, proc, timeout, cap)
    except BaseException:
        kill_group(proc)
        raise
    port.send({"t": "exit", "code": code, "timed_out": timed_out, "truncated": truncated})


def on_path(program: str, env: dict) -> bool:
    return any(os.access(os.path.join(d, program), os.X_OK) for d in env.get("PATH", "").split(":") if d)


class User:
    """Whom a command runs as: from an image's `User` (name or uid, then :group or :gid)."""

    def __init__(self, name: str, uid: int, gid: int, home: str, groups: list) -> None:
        self.name, self.uid, self.gid, self.home, self.groups = name, uid, gid, home, groups


def table(path: str) -> list:
    """The colon-separated rows of /etc/passwd or /etc/group (read directly: the agent's own
    libc would look for NSS modules among the image's libraries)."""
    return [line.split(":") for line in read_text(path).splitlines() if line and not line.startswith("#")]


def find_user(spec: str | None) -> User | None:
    if not spec or spec in ("root", "0", "0:0"):
        return None
    who, _, group = spec.partition(":")
    row = next((r for r in table("/etc/passwd") if len(r) >= 6 and who in (r[0], r[2])), None)
    if row is None and not who.isdigit():
        raise RequestError("bad_request", f"no user {who!r} in the machine's /etc/passwd")
    name, uid = (row[0], int(row[2])) if row else (who, int(who))
    gid = int(row[3]) if row else uid
    if group:
        found = next((r for r in table("/etc/group") if len(r) >= 3 and group in (r[0], r[2])), None)
        if found is None and not group.isdigit():
            raise RequestError("bad_request", f"no group {group!r} in the machine's /etc/group")
        gid = int(found[2]) if found else int(group)
    groups = [int(r[2]) for r in table("/etc/group") if len(r) >= 4 and name in r[3].split(",")]
    return User(name, uid, gid, row[5] if row else "/", groups)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group and wait until it is gone: its leader reaped by
    us, the rest (reparented to init) reaped by init, so nothing of it outlives the call."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def run_process(port: Port, proc: subprocess.Popen, timeout: float | None, cap: int):
    deadline = time.monotonic() + timeout if timeout else None
    outs = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
    sent = {1: 0, 2: 0}
    truncated = {1: False, 2: False}
    for fd in outs:
        os.set_blocking(fd, False)
    stdin_fd = proc.stdin.fileno() if proc.stdin else None
    if stdin_fd is not None:
        os.set_blocking(stdin_fd, False)
    stdin_buf = bytearray()
    stdin_closing = False
    pidfd = os.pidfd_open(proc.pid)
    poller = select.epoll()
    poller.register(port.fd, select.EPOLLIN | select.EPOLLET)
    poller.register(pidfd, select.EPOLLIN)
    for fd in outs:
        poller.register(fd, select.EPOLLIN)

    def forward(fd: int) -> bool:
        """Send what fd has; False once it reaches EOF."""
        stream = outs[fd]
        while True:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return True
            if not data:
                return False
            room = cap - sent[stream]
            if len(data) > room:
                truncated[stream] = True
                data = data[: max(room, 0)]
            if data:
                sent[stream] += len(data)
                port.send({"t": "out", "fd": stream}, data)

    timed_out = False
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = poller.poll(wait if wait is not None else -1)
            if deadline is not None and time.monotonic() >= deadline and proc.poll() is None:
                timed_out = True
                kill_group(proc)
                break
            for fd, _ in events:
                if fd in outs:
                    if not forward(fd):
                        poller.unregister(fd)
                        del outs[fd]
                elif fd == port.fd:
                    port.pump()
                    while (frame := port.take(in_request=True)) is not None:
                        header, payload = frame
                        if header.get("t") == "stdin" and stdin_fd is not None:
                            stdin_buf += payload
                        elif header.get("t") == "stdin_end":
                            stdin_closing = True
                        elif header.get("t") == "ping":
                            port.send(pong(header, busy=True))
                        elif header.get("t") == "signal":
                            os.killpg(proc.pid, int(header.get("signal", signal.SIGTERM)))
                elif fd == stdin_fd:
                    pass  # writable again; handled below
                elif fd == pidfd:
                    proc.wait()
            if stdin_fd is not None:
                stdin_fd = feed_stdin(poller, proc, stdin_fd, stdin_buf, stdin_closing)
            if proc.returncode is not None:
                break
    finally:
        poller.close()
        os.close(pidfd)
    # The command has exited: send what its pipes already hold, but do not wait
    # for background children that keep them open.
    for fd in list(outs):
        forward(fd)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f:
            with contextlib.suppress(OSError):
                f.close()
    code = TIMEOUT_EXIT_CODE if timed_out else proc.returncode
    if code < 0:
        code = 128 - code  # killed by a signal: report it as a shell does
    return code, timed_out, [truncated[1], truncated[2]]


def feed_stdin(poller, proc, fd: int, buf: bytearray, closing: bool) -> int | None:
    """Write pending stdin; returns the fd, or None once it is closed."""
    try:
        while buf:
            n = os.write(fd, buf)
            del buf[:n]
    except BlockingIOError:
        try:
            poller.register(fd, select.EPOLLOUT | select.EPOLLONESHOT)
        except FileExistsError:
            poller.modify(fd, select.EPOLLOUT | select.EPOLLONESHOT)
        return fd
    except BrokenPipeError:
        buf.clear()
        closing = True
    if closing:
        with contextlib.suppress(FileNotFoundError, KeyError):
            poller.unregister(fd)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        return None
    return fd


# ---- files ----------------------------------------------------------------


def os_error(e: OSError, path: str) -> RequestError:
    kind = {errno.ENOENT: "not_found", errno.EISDIR: "is_a_directory", errno.EACCES: "permission"}
    return RequestError(kind.get(e.errno, "os_error"), f"{path}: {e.strerror}")


def handle_read(port: Port, req: dict, _payload: bytes) -> None:
    path = req.get("path", "")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise os_error(e, path) from None
    try:
        st = os.fstat(fd)
        if not os.path.stat.S_ISREG(st.st_mode):
            raise RequestError("not_a_file", f"{path}: not a regular file")
        port.send({"t": "file", "size": st.st_size, "mode": st.st_mode & 0o7777})
        while data := os.read(fd, CHUNK):
            port.heed()
            port.send({"t": "data"}, data)
        port.send({"t": "end"})
    finally:
        os.close(fd)


def received(port: Port) -> Iterator[bytes]:
    """The data the host sends for this request, up to its `end` (heartbeats are answered)."""
    while True:
        header, payload = port.recv()
        kind = header.get("t")
        if kind == "data":
            yield payload
        elif kind == "end":
            return
        elif kind == "ping":
            port.send(pong(header, busy=True))
        else:
            raise RequestError("bad_request", f"unexpected frame while receiving data: {kind}")


def abandon(port: Port, error: RequestError, data: Iterator[bytes]) -> None:
    """Report a request that failed while the host was sending its data (so it stops early),
    then take in and drop the rest of that data."""
    port.send(error_frame(error.kind, str(error)))
    for _ in data:
        pass


def handle_write(port: Port, req: dict, _payload: bytes) -> None:
    path = req.get("path", "")
    if not path.startswith("/"):
        raise RequestError("bad_request", f"path must be absolute: {path!r}")
    parent = os.path.dirname(path)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.rewind-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.makedirs(parent, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, req.get("mode", 0o644))
    except OSError as e:
        raise os_error(e, path) from None
    port.send({"t": "ready"})
    data = received(port)
    try:
        with open(fd, "wb") as f:  # closes fd however this ends
            for payload in data:
                f.write(payload)
            if "mode" in req:
                os.fchmod(fd, req["mode"])
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(e, OSError):
            raise
        abandon(port, os_error(e, path), data)
        return
    port.send({"t": "ok"})


# ---- folders (cp -r) ------------------------------------------------------


def tree_error(e: tree.TreeError) -> RequestError:
    return RequestError(e.kind, str(e))


def handle_tar(port: Port, req: dict, _payload: bytes) -> None:
    """A folder out as a tar stream (see tree.py): `tree`, data frames, `end`."""
    path = req.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise RequestError("bad_request", f"path must be absolute: {path!r}")
    try:
        root = tree.source(path)
        port.send({"t": "tree"})
        for block in tree.blocks(tree.pack(root, tree.Counts()), CHUNK):
            port.heed()
            port.send({"t": "data"}, block)
    except tree.TreeError as e:
        raise tree_error(e) from None
    except OSError as e:
        raise os_error(e, e.filename or path) from None
    port.send({"t": "end"})


def handle_untar(port: Port, req: dict, _payload: bytes) -> None:
    """A tar stream into a new folder, whole or not at all (see tree.py): `ready`, the host's
    data and `end`, then `ok` with what was written. `name` is the copied folder's, for a
    `path` that is a folder already (cp -r's rule)."""
    dest, name = req.get("path"), req.get("name")
    if not isinstance(dest, str) or not dest.startswith("/") or not isinstance(name, str | None):
        raise RequestError("bad_request", f"untar needs an absolute path and a name: {dest!r}, {name!r}")
    try:
        target = tree.target(dest, name)
    except tree.TreeError as e:
        raise tree_error(e) from None
    port.send({"t": "ready"})
    data = received(port)
    counts = tree.Counts()
    try:
        tree.receive(target, data, 0o7777, counts)  # in the guest, root keeps every mode bit
    except tree.TreeError as e:
        abandon(port, tree_error(e), data)
        return
    port.send({"t": "ok", **counts.as_dict()})


# ---- identity, clock, health -------------------------------------------------

SIOCSIFHWADDR = 0x8924
SIOCGIFADDR = 0x8915
RNDADDENTROPY = 0x40085203
ARPHRD_ETHER = 1
ETH_P_ARP, ETH_P_IP, ARP_REQUEST = 0x0806, 0x0800, 1


def set_mac(ifname: str, mac: str) -> None:
    raw = bytes.fromhex(mac.replace(":", ""))
    ifreq = struct.pack("16sH14s", ifname.encode(), ARPHRD_ETHER, raw)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCSIFHWADDR, ifreq)
    with contextlib.suppress(OSError):  # no address yet: nobody has learned the old MAC
        announce(ifname)


def announce(ifname: str) -> None:
    """Say the interface's new MAC to the network: an ARP request for its gateway, sent from
    it. QEMU's user network learns a guest's MAC from ARP only, and until then sent the guest's
    frames to the old one, which the NIC drops: a kept try's port forwards reached nothing."""
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP)) as raw, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as inet:
        raw.bind((ifname, 0))
        mac = raw.getsockname()[4]
        own = fcntl.ioctl(inet.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()))[20:24]
        arp = struct.pack("!HHBBH6s4s6s4s", ARPHRD_ETHER, ETH_P_IP, 6, 4, ARP_REQUEST, mac, own, bytes(6),
                          gateway(ifname) or own)
        raw.send(b"\xff" * 6 + mac + struct.pack("!H", ETH_P_ARP) + arp)


def gateway(ifname: str) -> bytes | None:
    """The IPv4 address of `ifname`'s default route, if it has one (/proc/net/route)."""
    for line in read_text("/proc/net/route").splitlines()[1:]:
        fields = line.split()
        if len(fields) > 2 and fields[0] == ifname and fields[1] == "00000000":
            return struct.pack("<I", int(fields[2], 16))
    return None


def handle_identity(port: Port, req: dict, _payload: bytes) -> None:
    if "time" in req:
        time.clock_settime(time.CLOCK_REALTIME, float(req["time"]))
    if seed := req.get("seed"):
        raw = bytes.fromhex(seed)
        with open("/dev/urandom", "wb") as f:
            fcntl.ioctl(f.fileno(), RNDADDENTROPY, struct.pack("ii", len(raw) * 8, len(raw)) + raw)
    # A restore in place brings back the same identity: only what differs is written
    # (a just-restored guest runs cold, each change costs it).
    if (hostname := req.get("hostname")) and socket.gethostname() != hostname:
        socket.sethostname(hostname)
    if hostname:
        write_text("/etc/hostname", hostname + "\n")
        write_text("/etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost\n")
    if machine_id := req.get("machine_id"):
        write_text("/etc/machine-id", machine_id + "\n")
    if (mac := req.get("mac")) and read_text("/sys/class/net/eth0/address").strip() != mac.lower():
        try:
            set_mac("eth0", mac)
        except OSError as e:
            raise RequestError("os_error", f"cannot set MAC address: {e.strerror}") from None
    port.send({"t": "ok"})


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def write_text(path: str, text: str) -> None:
    """Replace a file's text atomically, unless it holds that text already."""
    if read_text(path) == text:
        return
    tmp = path + ".rewind-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pong(ping: dict, busy: bool) -> dict:
    """The answer to a ping. It carries the ping's id, so the host can tell a late answer
    to an earlier request's heartbeat from one to the current request's."""
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    return {"t": "pong", "id": ping.get("id"), "busy": busy, "uptime": uptime}


def handle_ping(port: Port, req: dict, _payload: bytes) -> None:
    port.send(pong(req, busy=False))


def handle_git(port: Port, req: dict, _payload: bytes) -> None:
    """The git tier: `save` or `restore` the project folder `folder`."""
    if gittier is None:
        raise RequestError("unsupported", "this guest image has no git tier (it needs python3-dulwich)")
    action, folder = req.get("action"), req.get("folder")
    if action not in ("save", "restore") or not isinstance(folder, str):
        raise RequestError("bad_request", "git needs action save|restore and a folder")
    try:
        result = gittier.save(folder) if action == "save" else gittier.restore(folder)
    except gittier.GitTierError as e:
        raise RequestError("git_error", str(e)) from None
    except OSError as e:
        raise os_error(e, e.filename or folder) from None
    port.send({"t": "ok", **result})


def handle_sync(port: Port, _req: dict, _payload: bytes) -> None:
    """Write the guest's cached writes to its disk (so a checkpoint's disk holds the files as
    the guest sees them, for a diff read on the host), and say what runs and listens."""
    started = time.monotonic()
    os.sync()
    synced = time.monotonic() - started
    port.send({"t": "synced", "sync_s": synced, "processes": processes(), "listening": listening()})


_NO_EXE: set[int] = set()  # pids seen without an executable: kernel threads, mostly


def processes() -> list[list]:
    """[pid, start time in clock ticks, command line] of every user-space process. Kernel
    threads, most of /proc, are told by their lack of an executable and remembered (by this
    agent process, between requests): reading each one's files cost about 0.1 s in all
    under emulation, and a readlink of each 25 ms."""
    found = []
    pids = {int(name) for name in os.listdir("/proc") if name.isdigit()}
    _NO_EXE.intersection_update(pids)  # a pid that went may come back as another process
    for pid in pids - _NO_EXE:
        try:
            os.readlink(f"/proc/{pid}/exe")
        except OSError:
            _NO_EXE.add(pid)
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        if argv[0]:
            line = " ".join(a.decode(errors="replace") for a in argv if a)
            found.append([pid, int(fields[19]), line[:300]])
    return sorted(found)


def listening() -> list[str]:
    """The sockets listening (TCP) or bound without a peer (UDP): "tcp 0.0.0.0:8000"."""
    found = set()
    for proto, state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            with open(f"/proc/net/{proto}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == state:
                address, port = cols[1].split(":")
                found.add(f"{proto[:3]} {hex_address(address)}:{int(port, 16)}")
    return sorted(found)


def hex_address(raw: str) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) order."""
    words = bytes.fromhex(raw)
    packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    text = socket.inet_ntop(family, packed)
    return text if family == socket.AF_INET else f"[{text}]"


HANDLERS = {
    "exec": handle_exec,
    "read": handle_read,
    "write": handle_write,
    "tar": handle_tar,
    "untar": handle_untar,
    "identity": handle_identity,
    "ping": handle_ping,
    "git": handle_git,
    "sync": handle_sync,
}


def serve(port: Port) -> None:
    while True:
        try:
            header, payload = port.recv(in_request=False)
            kind = header.get("t")
            handler = HANDLERS.get(kind)
            if handler is None:
                port.send(error_frame("bad_request", f"unknown request: {kind!r}"))
                continue
            try:
                handler(port, header, payload)
            except RequestError as e:
                port.send(error_frame(e.kind, str(e)))
        except Reset as r:
            if r.nonce is not None:
                port.session = r.nonce
                with contextlib.suppress(Reset):
                    port.send({"t": "hello", "nonce": r.nonce})


def main() -> None:
    """Serve every port in its own process; restart any that dies."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    children: dict[int, str] = {}

    def spawn(path: str) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                serve(Port(path))
            finally:
                os._exit(1)
        children[pid] = path

    for path in find_ports():
        spawn(path)
    while True:
        pid, _ = os.wait()
        if pid in children:
            time.sleep(0.2)
            spawn(children.pop(pid))


if __name__ == "__main__":
    main()
