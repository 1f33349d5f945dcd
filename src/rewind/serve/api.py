"""`rewind serve`: the HTTP API (FastAPI) over the SDK, with the MCP server at /mcp.

Endpoints are plain `def`s, so FastAPI runs them in its threadpool and a long guest command
never blocks the event loop; the engine's per-machine locks keep concurrent requests safe.
Streaming answers (exec output, create progress) are server-sent events fed from a thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse
from starlette.types import ASGIApp

from rewind.errors import InvalidArgument, OverBudget, RewindError
from rewind.home import Home
from rewind.results import command_argv
from rewind.serve import wire
from rewind.serve.access import (
    OCTETS,
    AccessPolicy,
    BearerAuth,
    RequestGuard,
    default_token,
    is_loopback,
    read_token_file,
)
from rewind.serve.expiry import Reaper
from rewind.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from rewind.serve.requestlog import RequestIds, log_as_json_lines
from rewind.serve.service import MAX_FORKS, Service

SSE = "text/event-stream"
BINARY_BODY = {"requestBody": {"required": True,
                               "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}}
T = TypeVar("T")
logger = logging.getLogger(__name__)
KEPT_ANSWERS = 10_000  # Idempotency-Key answers kept, oldest forgotten first
MaxBytes = Annotated[int | None, Query(gt=0, description="Refuse a download larger than this "
                                                         "(default: the machine's disk size)")]


# ---- request bodies ----

class CreateBody(BaseModel):
    name: str | None = None
    memory: int | None = Field(None, description="MiB (default: the engine's)")
    cpus: int | None = None
    disk: int = Field(0, description="MiB; 0: the image's size")
    labels: dict[str, str] | None = None
    image: str | None = None
    from_checkpoint: str | None = Field(None, description="Start from this checkpoint instead of booting")
    at: str | None = Field(None, description="Count back from from_checkpoint, such as ~2")
    network: dict | None = Field(None, description='First rules: {"internet": false, "allow": ["pypi.org"]}')
    host_trust: bool | None = Field(None, description="Take the server host's CA certificates and proxy "
                                                      "settings (default: its REWIND_HOST_TRUST)")
    ttl: float | None = Field(None, gt=0, description="Seconds it may live (default: the daemon's)")
    on_expiry: str | None = Field(None, description="stop, checkpoint or delete, once its time is up")


class ExecBody(BaseModel):
    cmd: str | list[str] = Field(description="A string runs under bash -c; a list runs the program directly")
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout: float | None = None
    stdin: str | None = None
    stdin_base64: str | None = Field(None, description="Binary stdin, base64-encoded (instead of stdin)")
    max_output: int | None = None

    def args(self) -> dict[str, Any]:
        """Keyword arguments for Service.exec."""
        args = self.model_dump(exclude={"stdin_base64"})
        if self.stdin_base64 is not None:
            if self.stdin is not None:
                raise InvalidArgument("give stdin or stdin_base64, not both")
            try:
                args["stdin"] = base64.b64decode(self.stdin_base64, validate=True)
            except binascii.Error as e:
                raise InvalidArgument(f"stdin_base64 is not base64: {e}") from e
        return args


class GuardedBody(BaseModel):
    cmd: str
    verify: str | None = None
    allow_external: bool = False
    cwd: str | None = None
    timeout: float | None = None
    offline: bool = False


class TryBody(BaseModel):
    step: str
    verify: str | None = None
    offline: bool = True
    cwd: str | None = None
    timeout: float = 600.0
    diff: bool = True  # the outcome's `diff`: what the step changed in the copy


class CheckpointBody(BaseModel):
    name: str | None = None
    labels: dict[str, str] | None = None
    wait: bool | Literal["local"] = Field(
        False, description="Answer once the point is in the store, not once captured (a store in a bucket: "
                           "once uploaded there; \"local\": once stored on this host, uploading)")
    context: str | None = Field(None, description="Your own state at this point (up to 64 KiB of text); "
                                                  "history and restore give it back")


class RestoreBody(BaseModel):
    ref: str = Field(description="~N, an id prefix or a name")


class ForkBody(BaseModel):
    count: int = Field(1, ge=1, le=MAX_FORKS)
    names: list[str] | None = Field(None, description="One copy per name (overrides count)")
    labels: dict[str, str] | None = None
    network: dict | None = None


class NetworkBody(BaseModel):
    internet: bool = True
    allow: list[str] | None = None
    deny: list[str] | None = None


class PortBody(BaseModel):
    guest_port: int = Field(ge=1, le=65535)
    host_port: int | None = Field(None, ge=1, le=65535, description="Default: a free port")
    host: str = Field("127.0.0.1", description="The host address to listen on; another than "
                                               "loopback makes the guest's service reachable from outside")


class TtlBody(BaseModel):
    ttl: float | None = Field(description="Seconds from now; null: no time to live")
    on_expiry: str | None = Field(None, description="stop, checkpoint or delete (default: as before)")


class ConfigBody(BaseModel):
    max_machines: int | None = None
    max_memory_mib: int | None = None
    default_ttl: float | None = None
    on_expiry: str | None = None


class ClassifyBody(BaseModel):
    command: str
    cwd: str | None = None


# ---- auth, idempotency, errors ----

class Idempotency:
    """Answers kept by Idempotency-Key: a repeated request (same key and route) gets the first
    answer again, marked `Idempotent-Replayed: true`, and does nothing; one that arrives while
    the first is still running waits for it; the same key with another body is refused. Kept
    in memory (the last KEPT_ANSWERS) for the daemon's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: OrderedDict[tuple[str, str], tuple[threading.Lock, str]] = OrderedDict()
        self._answers: dict[tuple[str, str], tuple[int, Any]] = {}

    def run(self, key: str | None, route: str, request: BaseModel, status: int,
            work: Callable[[], Any]) -> JSONResponse:
        if key is None:
            return JSONResponse(work(), status)
        slot, fingerprint = (key, route), request.model_dump_json()
        with self._lock:
            lock, first = self._slots.setdefault(slot, (threading.Lock(), fingerprint))
            while len(self._slots) > KEPT_ANSWERS:
                self._answers.pop(self._slots.popitem(last=False)[0], None)
        if first != fingerprint:
            raise InvalidArgument(f"Idempotency-Key {key!r} was used for another request to {route}")
        with lock:
            replayed = slot in self._answers
            if not replayed:
                self._answers[slot] = (status, work())  # an error is not kept: a retry runs again
            status, body = self._answers[slot]
        return JSONResponse(body, status, headers={"Idempotent-Replayed": str(replayed).lower()})


def _problem_response(exc: RewindError) -> JSONResponse:
    body = wire.problem(exc)
    return JSONResponse(body, body["status"], media_type=wire.PROBLEM_TYPE)


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def _events(work: Callable[[Callable[[str, Any], None]], tuple[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events from `work`, run in a thread: what it emits as it goes, then the
    event it returns (or `error` with a problem document)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

    def emit(event: str, data: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (event, data))

    def run() -> None:
        try:
            emit(*work(emit))
        except RewindError as e:
            emit("error", wire.problem(e))
        except Exception as e:  # the stream has begun: the failure can only be told as an event
            logger.exception("a streamed request failed")
            emit("error", wire.internal_problem(e))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task = loop.run_in_executor(None, run)
    while (item := await queue.get()) is not None:
        yield _sse(*item)
    await task


def _progress_stream(work: Callable[[Callable[[str], None]], Any]) -> StreamingResponse:
    """`progress` events for each step `work` reports, then `result` with what it returns."""
    return StreamingResponse(_events(lambda emit: ("result", work(lambda step: emit("progress", step)))),
                             media_type=SSE)


def _wants_events(request: Request) -> bool:
    return SSE in request.headers.get("accept", "")


def _labels(pairs: list[str]) -> dict[str, str] | None:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"a label filter looks like KEY=VALUE, not {pair!r}")
        out[key] = value
    return out or None


# ---- the app ----

def create_app(service: Service, token: str | None, policy: AccessPolicy) -> ASGIApp:
    """The API over `service`, behind `policy`'s checks; with `token`, every request but
    PUBLIC_PATHS must carry it."""
    from rewind.serve.mcpserver import build_server  # the MCP face shares the service

    mcp = build_server(service)
    mcp_http = mcp.streamable_http_app(streamable_http_path="/mcp", transport_security=_mcp_security(policy))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaper = Reaper(service.home, None if service.store_path is None else str(service.store_path))
        reaper.start()
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            await asyncio.to_thread(reaper.stop)

    app = FastAPI(title="rewind", version="0.1.0", lifespan=lifespan,
                  description="An undo button for AI agents: machines you can checkpoint, restore in place, "
                              "fork, and try a risky step in a copy of. Errors are application/problem+json "
                              "whose title names the error class. Create, fork and checkpoint accept an "
                              "Idempotency-Key header. Ask for text/event-stream on exec (stdout, stderr, "
                              "exit events) or create (progress, result events) to stream.")
    app.router.routes.extend(mcp_http.routes)
    kept = Idempotency()

    @app.exception_handler(RewindError)
    async def rewind_error(_: Request, exc: RewindError) -> JSONResponse:
        response = _problem_response(exc)
        if isinstance(exc, OverBudget):
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Still a problem document; the server logs the traceback.
        return JSONResponse(wire.internal_problem(exc), 500, media_type=wire.PROBLEM_TYPE)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        body = {**wire.problem(InvalidArgument(where)), "status": 422}
        return JSONResponse(body, 422, media_type=wire.PROBLEM_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        title = "NotFound" if exc.status_code == 404 else "HTTPError"
        body = {"type": f"/errors/{title}", "title": title, "status": exc.status_code,
                "detail": str(exc.detail)}
        return JSONResponse(body, exc.status_code, media_type=wire.PROBLEM_TYPE)

    @app.get("/health", tags=["server"])
    async def health() -> dict:
        # On the event loop, not in the threadpool: a pool busy with guest commands and
        # checkpoints must not make the daemon look dead.
        return {"ok": True, "policy": service.config.policy.to_json()}

    @app.get("/metrics", tags=["server"], response_class=Response,
             responses={200: {"content": {METRICS_TYPE: {}}}})
    def metrics() -> Response:
        """Prometheus metrics: operations by kind and outcome with their latency, machines by
        state, the store's bytes, uploads queued, memory files on tmpfs."""
        return Response(service.metrics.render(), media_type=METRICS_TYPE)

    # ---- machines ----

    @app.get("/machines", tags=["machines"])
    def list_machines(label: Annotated[list[str] | None, Query(description="KEY=VALUE; repeatable")] = None
                      ) -> list[dict]:
        return service.list(_labels(label or []))

    @app.post("/machines", tags=["machines"], status_code=201)
    def create(request: Request, body: CreateBody,
               idempotency_key: str | None = Header(None)) -> Response:
        """Start a machine (from the image, or from a checkpoint). With Accept: text/event-stream,
        `progress` events, then `result` (the machine) or `error`."""
        args = body.model_dump(exclude={"ttl", "on_expiry"})
        if body.ttl is not None:
            args |= {"ttl": body.ttl, "on_expiry": body.on_expiry}
        if _wants_events(request) and idempotency_key is None:
            return _progress_stream(lambda progress: service.create(**args, progress=progress))
        return kept.run(idempotency_key, "create", body, 201, lambda: service.create(**args))

    @app.put("/machines/{name}/ttl", tags=["machines"])
    def set_ttl(name: str, body: TtlBody) -> dict:
        """Set or extend its time to live (from now), or clear it; the machine as it is now."""
        return service.set_ttl(name, body.ttl, body.on_expiry)

    @app.get("/config", tags=["server"])
    def config() -> dict:
        """The daemon's budget (machines, guest memory) and default time to live."""
        return service.config.to_json()

    @app.patch("/config", tags=["server"])
    def change_config(body: ConfigBody) -> dict:
        """Change the budget or the default time to live (for machines made from now on)."""
        service.config.change(**body.model_dump())
        return service.config.to_json()

    @app.get("/images", tags=["machines"])
    def images() -> list[dict]:
        """The images machines can be made of (`image` in POST /machines): id, default, size,
        source and its digest. Built with `rewind image build` on the server's host."""
        return service.images()

    @app.get("/machines/{name}", tags=["machines"])
    def get_machine(name: str) -> dict:
        return service.info(name)

    @app.delete("/machines/{name}", tags=["machines"], status_code=204)
    def delete_machine(name: str) -> Response:
        service.delete(name)
        return Response(status_code=204)

    @app.patch("/machines/{name}/labels", tags=["machines"])
    def set_labels(name: str, changes: dict[str, str | None]) -> dict[str, str]:
        """Add or change labels; a null value removes one (a JSON merge patch). The labels now."""
        return service.set_labels(name, changes)

    @app.post("/machines/{name}/stop", tags=["machines"])
    def stop(name: str) -> dict:
        return service.stop(name)

    @app.post("/machines/{name}/start", tags=["machines"])
    def start(request: Request, name: str) -> Any:
        """Boot a stopped machine. With Accept: text/event-stream, `progress` events, then `result`."""
        if _wants_events(request):
            return _progress_stream(lambda progress: service.start(name, progress))
        return service.start(name)

    # ---- commands ----

    @app.post("/machines/{name}/exec", tags=["commands"])
    def exec_(request: Request, name: str, body: ExecBody) -> Any:
        """Run a command and answer with its result (exit_code, stdout, stderr, verdict). With
        Accept: text/event-stream: `stdout` and `stderr` events as output comes, then `exit`."""
        args = body.args()
        if not _wants_events(request):
            return service.exec(name, **args)
        command_argv(body.cmd)  # bad input is a 400 before the stream starts
        service.sandbox(name)

        def run(emit: Callable[[str, Any], None]) -> tuple[str, Any]:
            return "exit", service.exec(name, **args, on_stdout=lambda s: emit("stdout", s),
                                        on_stderr=lambda s: emit("stderr", s))
        return StreamingResponse(_events(run), media_type=SSE)

    @app.post("/machines/{name}/guarded", tags=["commands"])
    def guarded(name: str, body: GuardedBody) -> dict:
        """Run a command with the cheapest undo that covers it (see /classify)."""
        return service.guarded(name, **body.model_dump())

    @app.post("/machines/{name}/try", tags=["commands"])
    def try_(name: str, body: TryBody) -> dict:
        """Run a step (and a check) in a copy; the copy replaces the machine only if both pass."""
        return service.try_in_copy(name, **body.model_dump())

    @app.get("/machines/{name}/diff", tags=["checkpoints"])
    def diff(name: str, before: str = "~0", after: str | None = None, all: bool = False,
             paths: Annotated[list[str] | None, Query()] = None) -> dict:
        """What changed from point `before` (default ~0, its last) to point `after` or, without
        it, the machine now: files, packages, processes, listening sockets, rules, labels.
        `all`: also the noise list's paths; `paths`: globs, repeatable."""
        return service.diff(name, before, after, all=all, paths=paths)

    @app.get("/machines/{name}/diff/content", tags=["checkpoints"], response_class=PlainTextResponse)
    def diff_content(name: str, path: str, before: str = "~0", after: str | None = None) -> str:
        """A unified diff of one text file from point `before` to point `after` or, without it,
        the machine now."""
        return service.diff_content(name, path, before, after)

    @app.post("/classify", tags=["commands"])
    def classify(body: ClassifyBody) -> dict:
        """What undo a shell command needs: none, git, fork or external, and why."""
        return service.classify(body.command, body.cwd)

    # ---- files and network ----

    @app.get("/machines/{name}/files", tags=["files"], response_class=FileResponse,
             responses={200: {"content": {OCTETS: {}}}})
    def download(name: str, path: str, max_bytes: MaxBytes = None) -> FileResponse:
        """A guest file, streamed from a copy on the host; X-Rewind-Mode: its permission bits (octal)."""
        out, _ = _produced(service, lambda out: service.download(name, path, out, max_bytes))
        return _sent(out, headers={"X-Rewind-Mode": f"{out.stat().st_mode & 0o7777:o}"})

    @app.put("/machines/{name}/files", tags=["files"], status_code=204, openapi_extra=BINARY_BODY)
    async def upload(request: Request, name: str, path: str,
                     mode: Annotated[int, Query(description="Permission bits, such as 493 (0o755)")] = 0o644
                     ) -> Response:
        """Write a whole guest file from the body (streamed to the host first); it appears whole
        or not at all."""
        async with _received(request, service) as src:
            os.chmod(src, mode & 0o7777)
            await asyncio.to_thread(service.upload, name, src, path)
        return Response(status_code=204)

    @app.get("/machines/{name}/tree", tags=["files"], response_class=FileResponse,
             responses={200: {"content": {OCTETS: {}}}})
    def download_tree(name: str, path: str, max_bytes: MaxBytes = None) -> FileResponse:
        """A guest folder as a tar stream (files, folders, links; modes and mtimes), from a copy on
        the host. Unpack it as `cp -r` would, or with `tar x`."""
        out, _ = _produced(service, lambda out: service.download_tar(name, path, out, max_bytes))
        return _sent(out)

    @app.put("/machines/{name}/tree", tags=["files"], openapi_extra=BINARY_BODY)
    async def upload_tree(request: Request, name: str, path: str,
                          folder: Annotated[str | None, Query(description="The copied folder's name")] = None
                          ) -> dict:
        """Unpack the body, a tar stream (streamed to the host first), into a new guest folder: `path`
        if nothing is there, `path/folder` if `path` is a folder (cp -r's rule); a place taken is a
        409. Whole or not at all. What was written: files, folders, links, bytes, seconds."""
        async with _received(request, service) as src:
            return await asyncio.to_thread(service.upload_tar, name, src, path, folder)

    @app.get("/machines/{name}/network", tags=["network"])
    def network(name: str) -> dict:
        return service.network(name)

    @app.put("/machines/{name}/network", tags=["network"])
    def set_network(name: str, body: NetworkBody) -> dict:
        return service.set_network(name, **body.model_dump())

    @app.get("/machines/{name}/ports", tags=["network"])
    def ports(name: str) -> list[dict]:
        """The machine's forwards: `{"host", "port", "guest_port"}` each."""
        return service.ports(name)

    @app.post("/machines/{name}/ports", tags=["network"], status_code=201)
    def forward_port(name: str, body: PortBody) -> dict:
        """Forward a host port to a guest port; it answers again after restore, stop and start."""
        return service.forward_port(name, body.guest_port, body.host_port, body.host)

    @app.delete("/machines/{name}/ports/{guest_port}", tags=["network"])
    def remove_port(name: str, guest_port: int) -> dict:
        """End the forward to `guest_port`; the forward it was."""
        return service.remove_port(name, guest_port)

    # ---- checkpoints ----

    @app.post("/machines/{name}/checkpoints", tags=["checkpoints"], status_code=201)
    def checkpoint(name: str, body: CheckpointBody, idempotency_key: str | None = Header(None)) -> Response:
        """Save the whole machine as of now; it runs on."""
        return kept.run(idempotency_key, f"checkpoint {name}", body, 201,
                        lambda: service.checkpoint(name, body.name, body.labels, body.wait, body.context))

    @app.get("/machines/{name}/checkpoints", tags=["checkpoints"])
    def history(name: str) -> list[dict]:
        """The machine's points, newest first (~0, ~1, ...)."""
        return service.history(name)

    @app.post("/machines/{name}/restore", tags=["checkpoints"])
    def restore(name: str, body: RestoreBody) -> dict:
        """Put the machine back to a point in place: processes, memory and disk."""
        return service.restore(name, body.ref)

    @app.post("/machines/{name}/fork", tags=["checkpoints"], status_code=201)
    def fork(name: str, body: ForkBody, idempotency_key: str | None = Header(None)) -> Response:
        """Live copies from one capture: one machine per copy."""
        return kept.run(idempotency_key, f"fork {name}", body, 201,
                        lambda: service.fork(name, **body.model_dump()))

    @app.get("/checkpoints", tags=["checkpoints"])
    def checkpoints() -> list[dict]:
        """Every checkpoint in the store, oldest first."""
        return service.checkpoints()

    @app.get("/checkpoints/{ref}", tags=["checkpoints"])
    def lineage(ref: str) -> dict:
        """A checkpoint with its parent, its children and its history."""
        return service.lineage(ref)

    @app.get("/checkpoints/{ref}/export", tags=["checkpoints"], response_class=FileResponse,
             responses={200: {"content": {"application/octet-stream": {}}}})
    def export(ref: str) -> FileResponse:
        """The checkpoint with its history and data, as one file for POST /checkpoints/import."""
        out, made = _produced(service, lambda out: service.export(ref, out))
        return _sent(out, filename=f"{made['id'][:12]}.rewind")

    @app.post("/checkpoints/import", tags=["checkpoints"], status_code=201, openapi_extra=BINARY_BODY)
    async def import_(request: Request) -> dict:
        """Add an exported checkpoint (the request body), checksums verified first."""
        async with _received(request, service) as src:
            return await asyncio.to_thread(service.import_, src)

    _document_bearer(app, token is not None)
    binary = frozenset(r.path for r in app.routes if getattr(r, "openapi_extra", None) == BINARY_BODY)
    checked = RequestGuard(app if token is None else BearerAuth(app, token), policy, app.routes, binary)
    return RequestIds(checked)  # outermost: refusals carry an id too


def _mcp_security(policy: AccessPolicy) -> TransportSecuritySettings:
    """The MCP SDK's own Host and Origin checks, as ours (which run first). Bound to every
    address, any IP literal is a good Host, which its lists cannot say: ours alone check then."""
    if policy.any_address:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    names = [f"[{h}]" if ":" in h else h for h in sorted(policy.hosts)]
    return TransportSecuritySettings(
        allowed_hosts=[*names, *(f"{n}:*" for n in names)],
        allowed_origins=[*(f"http://{n}:*" for n in names), *(f"http://{n}" for n in names),
                         *sorted(policy.origins)])


def _scratch(service: Service) -> Path:
    """A temporary file beside the store (same file system, not a small /tmp)."""
    folder = service.home.root / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"serve-{secrets.token_hex(6)}"


def _produced(service: Service, make: Callable[[Path], T]) -> tuple[Path, T]:
    """A scratch file `make` fills, and what it returned; nothing is left if it fails."""
    out = _scratch(service)
    try:
        return out, make(out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _sent(out: Path, filename: str | None = None, headers: dict[str, str] | None = None) -> FileResponse:
    """`out` streamed as the answer, then removed."""
    return FileResponse(out, media_type=OCTETS, filename=filename, headers=headers,
                        background=BackgroundTask(out.unlink, missing_ok=True))


@contextlib.asynccontextmanager
async def _received(request: Request, service: Service) -> AsyncIterator[Path]:
    """The request body streamed into a scratch file (memory stays flat for big files)."""
    src = _scratch(service)
    try:
        with open(src, "wb") as f:
            async for chunk in request.stream():
                await asyncio.to_thread(f.write, chunk)
        yield src
    finally:
        src.unlink(missing_ok=True)


def _document_bearer(app: FastAPI, required: bool) -> None:
    """Say in the OpenAPI document that every operation takes a bearer token."""
    if not required:
        return
    make = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = make()
            scheme = {"type": "http", "scheme": "bearer"}
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": scheme}
            doc["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def read_token(token_file: str | None, no_auth: bool, host: str,
               home: Home) -> tuple[str | None, Path | None]:
    """The token the server will require (None when `no_auth` is allowed: loopback only) and,
    when it was made or taken from the home's default file, that file."""
    if no_auth:
        if token_file:
            raise InvalidArgument("give either --token-file or --no-auth, not both")
        if not is_loopback(host):
            raise InvalidArgument(f"--no-auth is only allowed on a loopback address, not {host}")
        return None, None
    if token_file:
        return read_token_file(Path(token_file)), None
    return default_token(home.serve_token), home.serve_token


# scripts/load, 12 and 24 clients on 2 cores, /health's time inside the daemon, p99: 75-84 ms
# as a normal thread; 24-65 ms at nice -10; 1.0-2.6 ms round-robin at real-time priority 1.
LOOP_PRIORITY = 1
LOOP_NICE = -10
SWITCH_INTERVAL_S = 0.001


def _favour_event_loop() -> None:
    """Let the thread that answers requests run first when it wakes: machines under TCG keep
    the cores busy, and /health waited in the run queue. It only ever runs briefly (engine work
    is on the threadpool), so a real-time round-robin priority costs the guests nothing; the
    kernel's real-time throttling bounds it all the same. Its threads and children (the
    threadpool, QEMUs, helpers) start as normal threads (SCHED_RESET_ON_FORK). Without the
    right (not root, no CAP_SYS_NICE) it tries nice -10, then stays as it was."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    reset = os.SCHED_RESET_ON_FORK
    with contextlib.suppress(PermissionError):
        os.sched_setscheduler(0, os.SCHED_RR | reset, os.sched_param(LOOP_PRIORITY))
        return
    with contextlib.suppress(PermissionError):
        os.sched_setscheduler(0, os.SCHED_OTHER | reset, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOOP_NICE)


def serve(service: Service, host: str, port: int, token: str | None, policy: AccessPolicy,
          token_path: Path | None = None) -> None:
    """Run the API until interrupted. The socket is bound first, so a port in use is one clear error."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol must be named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it every answer on a kept-alive connection waited 40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidArgument(f"cannot listen on {host}:{port}: {e.strerror}") from e
    bound = sock.getsockname()[1]  # --port 0 picks a free one: say which
    url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
    print(f"rewind: serving on {url} (MCP at /mcp; "
          f"{'no token' if token is None else 'bearer token required'})", file=sys.stderr, flush=True)
    if token_path is not None:
        print(f"rewind: the token is in {token_path}; clients on this host: "
              f"REWIND_URL={url} rewind ls (a daemon on loopback lends its token to this home's CLI), "
              f"elsewhere: REWIND_TOKEN=$(cat {token_path})", file=sys.stderr, flush=True)
    log_as_json_lines()
    _favour_event_loop()
    config = uvicorn.Config(create_app(service, token, policy), log_level="warning", lifespan="on",
                            log_config=None)
    uvicorn.Server(config).run(sockets=[sock])
