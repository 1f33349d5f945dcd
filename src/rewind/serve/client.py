"""`Sandbox.connect(url, token)`: the SDK's verbs over HTTP, against `rewind serve`.

A RemoteSandbox has the same methods and returns the same types as a Sandbox, and a
server-side error is raised again as its own class (a NotFound stays a NotFound), so code
written for the local SDK runs unchanged against a daemon on another host.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal

import httpx2

from rewind.errors import InvalidArgument, RewindError
from rewind.folders import packed, unpacked
from rewind.guard.classify import Decision
from rewind.guest.protocol import CHUNK
from rewind.home import Home
from rewind.results import (
    DEFAULT_READ_MAX,
    LOCAL_HOST,
    TRY_TIMEOUT,
    Checkpoint,
    Command,
    Diff,
    ExecResult,
    GuardedResult,
    MachineInfo,
    Outcome,
    PortForward,
    TreeCopy,
    checked,
)
from rewind.serve import wire

DEFAULT_URL = "http://127.0.0.1:7070"
RAW_BODY = {"Content-Type": "application/octet-stream"}


def _home_token(url: str) -> str | None:
    """The token of a daemon serving this host's home, for a URL on loopback only: it is never
    sent to another host."""
    host = (httpx2.URL(url).host or "").strip("[]")
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        return None
    try:
        return Home.from_env().serve_token.read_text().strip() or None
    except OSError:
        return None


class Remote:
    """A connection to a rewind server. `url` defaults to $REWIND_URL, `token` to $REWIND_TOKEN."""

    def __init__(self, url: str | None = None, token: str | None = None,
                 timeout: float | None = None) -> None:
        self.url = (url or os.environ.get("REWIND_URL") or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get("REWIND_TOKEN") or _home_token(self.url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Reads wait as long as a guest command may run; only connecting is bounded.
        self._http = httpx2.Client(base_url=self.url, headers=headers,
                                   timeout=httpx2.Timeout(timeout, connect=10.0))

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ---- transport ----

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request; the JSON answer, or the server's error raised as its own class."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx2.TransportError as e:
            raise RewindError(f"cannot reach the rewind server at {self.url}: {e}") from e
        _raise_for_problem(response)
        if response.status_code == 204:
            return None
        kind = response.headers.get("content-type", "")
        if kind.startswith("application/octet-stream"):
            return response.content
        return response.text if kind.startswith("text/plain") else response.json()

    @contextlib.contextmanager
    def streamed(self, path: str, params: dict[str, Any]) -> Iterator[httpx2.Response]:
        """A download's response, its body to be read as it comes."""
        try:
            with self._http.stream("GET", path, params=params) as response:
                _raise_for_problem(response)
                yield response
        except httpx2.TransportError as e:
            raise RewindError(f"cannot reach the rewind server at {self.url}: {e}") from e

    def fetch(self, path: str, params: dict[str, Any], sink: BinaryIO) -> str | None:
        """Stream a download into `sink`; its X-Rewind-Mode header."""
        with self.streamed(path, params) as response:
            for chunk in response.iter_bytes():
                sink.write(chunk)
            return response.headers.get("X-Rewind-Mode")

    def events(self, path: str, body: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """(event, data) pairs of a server-sent event stream; an `error` event is raised."""
        try:
            with self._http.sse(path, method="POST", json=body) as source:
                _raise_for_problem(source.response)
                for sse in source:
                    data = sse.json()
                    if sse.event == "error":
                        raise wire.error_from(data, data.get("status", 500))
                    yield sse.event, data
        except httpx2.TransportError as e:
            raise RewindError(f"cannot reach the rewind server at {self.url}: {e}") from e

    def reported(self, path: str, body: dict[str, Any], progress: Callable[[str], None]) -> Any:
        """A long operation's result, its steps given to `progress` as the server reports them."""
        result = None
        for event, data in self.events(path, body):
            if event == "progress":
                progress(data)
            else:
                result = data
        return result

    # ---- machines ----

    def create(self, name: str | None = None, *, memory: int | None = None, cpus: int | None = None,
               disk: int = 0, labels: dict[str, str] | None = None, image: str | None = None,
               from_checkpoint: str | Checkpoint | None = None, at: str | None = None,
               network: dict | None = None, host_trust: bool | None = None,
               ttl: float | None = None, on_expiry: str = "stop",
               progress: Callable[[str], None] | None = None,
               idempotency_key: str | None = None) -> RemoteSandbox:
        """As Sandbox.create (`host_trust` is the server host's). `progress` gets each step as the
        server reports it."""
        if isinstance(from_checkpoint, Checkpoint):
            from_checkpoint = from_checkpoint.id
        body = {"name": name, "memory": memory, "cpus": cpus, "disk": disk, "labels": labels, "image": image,
                "from_checkpoint": from_checkpoint, "at": at, "network": network, "host_trust": host_trust,
                "ttl": ttl, "on_expiry": on_expiry if ttl is not None else None}
        if progress is not None and idempotency_key is None:
            info = self.reported("/machines", body, progress)
        else:
            headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
            info = self.call("POST", "/machines", json=body, headers=headers)
        return RemoteSandbox(self, info["name"])

    def get(self, name: str) -> RemoteSandbox:
        return RemoteSandbox(self, self.call("GET", f"/machines/{name}")["name"])

    def list(self, labels: dict[str, str] | None = None) -> list[RemoteSandbox]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return [RemoteSandbox(self, m["name"]) for m in self.call("GET", "/machines", params=params)]

    def classify(self, command: str, cwd: str | None = None) -> Decision:
        return wire.decision_from(self.call("POST", "/classify", json={"command": command, "cwd": cwd}))

    def checkpoints(self) -> list[Checkpoint]:
        return [wire.checkpoint_from(c) for c in self.call("GET", "/checkpoints")]


def _raise_for_problem(response: httpx2.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    raise wire.error_from(body if isinstance(body, dict) else {}, response.status_code)


class RemoteSandbox:
    """A machine on a rewind server, with the methods of Sandbox (rewind/handle.py)."""

    # Where it is not Sandbox's surface, on purpose (tests/test_faces.py).
    DIFFERS: ClassVar[dict[str, str]] = {
        "checkpoint": "no `history` (the daemon keeps its default); `idempotency_key` lets a retry "
                      "over the network return the point the first try took",
        "guarded": "no `rules`: rules files are read on the daemon's host",
        "restore": "no `allow_unsigned`: the daemon decides by its own environment",
        "try_in_copy": "the transport of rewind.try_in_copy(sbx, ...), the way to call it",
    }

    def __init__(self, remote: Remote, name: str) -> None:
        self._remote = remote
        self._name = name
        self.files = RemoteFiles(self)
        self.network = RemoteNetwork(self)
        self.ports = RemotePorts(self)

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.name!r}, url={self._remote.url!r})"

    def _call(self, method: str, verb: str = "", **kwargs: Any) -> Any:
        return self._remote.call(method, f"/machines/{self._name}{verb}", **kwargs)

    @property
    def name(self) -> str:
        return self._name

    @property
    def labels(self) -> dict[str, str]:
        return self.info().labels

    def set_labels(self, changes: dict[str, str | None]) -> dict[str, str]:
        return self._call("PATCH", "/labels", json=changes)

    def set_ttl(self, seconds: float | None, on_expiry: str | None = None) -> MachineInfo:
        return wire.info_from(self._call("PUT", "/ttl", json={"ttl": seconds, "on_expiry": on_expiry}))

    @property
    def status(self) -> str:
        return self.info().status

    def info(self) -> MachineInfo:
        return wire.info_from(self._call("GET"))

    def exec(self, cmd: Command, *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stdin: str | bytes | None = None, check: bool = False,
             on_stdout: Callable[[str], None] | None = None,
             on_stderr: Callable[[str], None] | None = None,
             max_output: int | None = None) -> ExecResult:
        """As Sandbox.exec; with a callback, output streams as server-sent events."""
        body = {"cmd": cmd, "cwd": cwd, "env": env, "timeout": timeout, "max_output": max_output}
        if isinstance(stdin, bytes):
            body["stdin_base64"] = base64.b64encode(stdin).decode()
        else:
            body["stdin"] = stdin
        if on_stdout is None and on_stderr is None:
            data = self._call("POST", "/exec", json=body)
        else:
            sinks = {"stdout": on_stdout or (lambda _: None), "stderr": on_stderr or (lambda _: None)}
            for event, data in self._remote.events(f"/machines/{self._name}/exec", body):
                if event in sinks:
                    sinks[event](data)
        return checked(wire.exec_from(data), cmd, check)

    def guarded(self, cmd: str, *, verify: str | None = None, allow_external: bool = False,
                cwd: str | None = None, timeout: float | None = None, offline: bool = False) -> GuardedResult:
        body = {"cmd": cmd, "verify": verify, "allow_external": allow_external, "cwd": cwd,
                "timeout": timeout, "offline": offline}
        return wire.guarded_from(self._call("POST", "/guarded", json=body))

    def try_in_copy(self, step: str, verify: str | None = None, *, offline: bool = True,
                    cwd: str | None = None, timeout: float = TRY_TIMEOUT, diff: bool = True) -> Outcome:
        body = {"step": step, "verify": verify, "offline": offline, "cwd": cwd, "timeout": timeout,
                "diff": diff}
        return wire.outcome_from(self._call("POST", "/try", json=body))

    def diff(self, a: str | Checkpoint = "~0", b: str | Checkpoint | None = None, *, noise: bool = False,
             paths: list[str] | None = None) -> Diff:
        params: dict[str, Any] = {"before": _ref(a), "all": noise, "paths": paths or []}
        if b is not None:
            params["after"] = _ref(b)
        return Diff.from_json(self._call("GET", "/diff", params=params))

    def diff_content(self, path: str, a: str | Checkpoint = "~0", b: str | Checkpoint | None = None) -> str:
        params = {"path": path, "before": _ref(a), **({"after": _ref(b)} if b is not None else {})}
        return self._call("GET", "/diff/content", params=params)

    def checkpoint(self, name: str | None = None, labels: dict[str, str] | None = None,
                   wait: bool | Literal["local"] = False, context: str | None = None,
                   idempotency_key: str | None = None) -> Checkpoint:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"name": name, "labels": labels, "wait": wait, "context": context}
        return wire.checkpoint_from(self._call("POST", "/checkpoints", json=body, headers=headers))

    def history(self) -> list[Checkpoint]:
        return [wire.checkpoint_from(c) for c in self._call("GET", "/checkpoints")]

    def restore(self, ref: str | Checkpoint) -> Checkpoint:
        ref = ref.id if isinstance(ref, Checkpoint) else ref
        return wire.checkpoint_from(self._call("POST", "/restore", json={"ref": ref}))

    def fork(self, name: str | None = None, labels: dict[str, str] | None = None,
             network: dict | None = None) -> RemoteSandbox:
        [child] = self.fork_many(names=[name] if name else None, labels=labels, network=network)
        return child

    def fork_many(self, count: int = 1, *, names: list[str | None] | None = None,
                  labels: dict[str, str] | None = None, network: dict | None = None) -> list[RemoteSandbox]:
        body = {"count": count, "names": names, "labels": labels, "network": network}
        children = self._call("POST", "/fork", json=body)
        return [RemoteSandbox(self._remote, child["name"]) for child in children]

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        if progress is None:
            self._call("POST", "/start")
        else:
            self._remote.reported(f"/machines/{self._name}/start", {}, progress)

    def stop(self) -> None:
        self._call("POST", "/stop")

    def delete(self) -> None:
        self._call("DELETE")


class RemoteFiles:
    """Files inside a remote machine, as Sandbox.files."""

    def __init__(self, sbx: RemoteSandbox) -> None:
        self._sbx = sbx

    def read(self, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self._sbx._call("GET", "/files", params={"path": path, "max_bytes": max_bytes})

    def read_text(self, path: str, encoding: str = "utf-8", max_bytes: int = DEFAULT_READ_MAX) -> str:
        return self.read(path, max_bytes).decode(encoding)

    def write(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        raw = data.encode() if isinstance(data, str) else data
        params: dict[str, Any] = {"path": path} | ({"mode": mode} if mode is not None else {})
        self._sbx._call("PUT", "/files", params=params, content=raw, headers=RAW_BODY)

    def upload(self, local: str | os.PathLike[str], path: str) -> None:
        """As Files.upload; the file is streamed, not read into memory."""
        local = Path(local)
        if not local.is_file():
            raise InvalidArgument(f"not a file on this host: {local}")
        with open(local, "rb") as body:
            self._sbx._call("PUT", "/files", params={"path": path, "mode": local.stat().st_mode & 0o7777},
                            content=body, headers=RAW_BODY)

    def download(self, path: str, local: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        """As Files.download: streamed, and the host file appears only once complete."""
        local = Path(local)
        if local.is_dir():
            local = local / Path(path).name
        tmp = local.with_name(f".{local.name}.rewind-partial")
        try:
            with open(tmp, "wb") as sink:
                params = {"path": path} | ({"max_bytes": max_bytes} if max_bytes is not None else {})
                mode = self._sbx._remote.fetch(f"/machines/{self._sbx.name}/files", params, sink)
            os.chmod(tmp, int(mode or "644", 8) & 0o777)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def upload_dir(self, local: str | os.PathLike[str], path: str,
                   progress: Callable[[str], None] | None = None) -> TreeCopy:
        """As Files.upload_dir; the folder is streamed as a tar, packed as it is sent."""
        name, blocks = packed(local, progress)
        return self._put_tree(path, name, blocks)

    def download_dir(self, path: str, local: str | os.PathLike[str], max_bytes: int | None = None,
                     progress: Callable[[str], None] | None = None) -> TreeCopy:
        """As Files.download_dir; the tar stream is unpacked as it comes."""
        started = time.monotonic()
        return TreeCopy.of(unpacked(self._tar(path, max_bytes), path, local, progress), started)

    def upload_tar(self, source: BinaryIO, path: str, name: str | None = None) -> TreeCopy:
        """As Files.upload_tar."""
        return self._put_tree(path, name, iter(lambda: source.read(CHUNK), b""))

    def download_tar(self, path: str, sink: BinaryIO, max_bytes: int | None = None) -> None:
        """As Files.download_tar."""
        for chunk in self._tar(path, max_bytes):
            sink.write(chunk)

    def _put_tree(self, path: str, name: str | None, body: Iterator[bytes]) -> TreeCopy:
        started = time.monotonic()
        params = {"path": path} | ({"folder": name} if name else {})
        answer = self._sbx._call("PUT", "/tree", params=params, content=body, headers=RAW_BODY)
        return dataclasses.replace(TreeCopy(**answer), seconds=round(time.monotonic() - started, 3))

    def _tar(self, path: str, max_bytes: int | None) -> Iterator[bytes]:
        """The folder's tar stream as it comes; the request is sent when the first piece is asked for."""
        params = {"path": path} | ({"max_bytes": max_bytes} if max_bytes is not None else {})
        with self._sbx._remote.streamed(f"/machines/{self._sbx.name}/tree", params) as response:
            yield from response.iter_bytes()


class RemoteNetwork:
    """A remote machine's network rules, as Sandbox.network."""

    def __init__(self, sbx: RemoteSandbox) -> None:
        self._sbx = sbx

    def get(self) -> dict:
        return self._sbx._call("GET", "/network")

    def set(self, internet: bool = True, allow: list[str] | None = None,
            deny: list[str] | None = None) -> dict:
        return self._sbx._call("PUT", "/network", json={"internet": internet, "allow": allow, "deny": deny})

    def off(self) -> dict:
        return self.set(internet=False)


class RemotePorts:
    """A remote machine's forwards, as Sandbox.ports (the ports are on the server's host)."""

    def __init__(self, sbx: RemoteSandbox) -> None:
        self._sbx = sbx

    def forward(self, guest_port: int, host_port: int | None = None, host: str = LOCAL_HOST) -> PortForward:
        body = {"guest_port": guest_port, "host_port": host_port, "host": host}
        return PortForward.from_json(self._sbx._call("POST", "/ports", json=body))

    def list(self) -> list[PortForward]:
        return [PortForward.from_json(f) for f in self._sbx._call("GET", "/ports")]

    def remove(self, guest_port: int) -> PortForward:
        return PortForward.from_json(self._sbx._call("DELETE", f"/ports/{guest_port}"))


def _ref(point: str | Checkpoint) -> str:
    return point.id if isinstance(point, Checkpoint) else point
