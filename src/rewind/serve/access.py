"""Who may reach `rewind serve`: the checks every request passes before it is routed.

A web page in the user's browser can send requests to a server on loopback: a form POST or
a `fetch` with no preflight (a "simple" request), or, through DNS rebinding, any request with
a foreign name in `Host`. Neither carries our token, but `--no-auth` has none to carry, and a
browser may still make work happen that it cannot read. So, in this order, before auth:

1. `Host` must name the bound address (for a loopback address, any loopback name), or a name
   the operator allowed (`--allow-host`). A rebinding page's `Host` is its own domain.
2. An `Origin`, when a browser sends one, must be the server's own (`http://` + its `Host`)
   or one the operator allowed (`--allow-origin`, which also turns on CORS for it); a
   cross-site fetch the browser marks with `Sec-Fetch-Site` but no `Origin` is refused too.
3. A state-changing request may carry only its route's declared content type: JSON, or raw
   bytes for uploads. The form types a page can send without a preflight are always refused.

Refusals are problem+json documents, like every error of the API.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from rewind.errors import InvalidArgument
from rewind.serve import wire
from rewind.store.durable import fsync_dir, write_tmp

# Readiness probes and the API's description need no token (a browser on /docs cannot send one).
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs"})
JSON = "application/json"
OCTETS = "application/octet-stream"
# What a page may send cross-site without a CORS preflight.
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
CHANGES_STATE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class AccessPolicy:
    """The names a request's `Host` may give and the origins allowed besides the server's own."""

    hosts: frozenset[str]
    origins: frozenset[str] = frozenset()
    any_address: bool = False  # bound to every interface: any IP literal names this host

    @classmethod
    def for_bind(cls, host: str, allow_hosts: tuple[str, ...] = (),
                 allow_origins: tuple[str, ...] = ()) -> AccessPolicy:
        names = {_bare(host), *(_bare(h) for h in allow_hosts)}
        if is_loopback(host):
            names |= LOOPBACK_NAMES
        wildcard = host in ("0.0.0.0", "::", "")
        if wildcard:
            names |= LOOPBACK_NAMES | {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(hosts=frozenset(names), origins=frozenset(o.rstrip("/") for o in allow_origins),
                   any_address=wildcard)

    def host_allowed(self, host_header: str) -> bool:
        name = _host_name(host_header)
        if name in self.hosts:
            return True
        return self.any_address and _is_ip(name)


def _bare(host: str) -> str:
    return host.strip().strip("[]").lower()


def _host_name(host_header: str) -> str:
    """'127.0.0.1:7070' -> '127.0.0.1'; '[::1]:7070' -> '::1'; names lowercased."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    host = _bare(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BearerAuth:
    """Every request but PUBLIC_PATHS needs `Authorization: Bearer <token>` (compared in
    constant time); refused requests get a problem+json 401."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        body = {"type": "/errors/Unauthorized", "title": "Unauthorized", "status": 401,
                "detail": "this server needs the header Authorization: Bearer <token>"}
        response = JSONResponse(body, 401, media_type=wire.PROBLEM_TYPE,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


@dataclass
class _Refusal:
    status: int
    title: str
    detail: str
    headers: dict[str, str] = field(default_factory=dict)

    async def send(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {"type": f"/errors/{self.title}", "title": self.title, "status": self.status,
                "detail": self.detail}
        await JSONResponse(body, self.status, media_type=wire.PROBLEM_TYPE, headers=self.headers)(
            scope, receive, send)


class RequestGuard:
    """The checks above, as ASGI middleware around the routed app (`routes` tell each route's
    declared body type). With allowed origins, their CORS answers come from Starlette's
    CORSMiddleware, which sits inside this guard."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy, routes: list[BaseRoute],
                 binary_paths: frozenset[str]) -> None:
        self.policy = policy
        self.routes = routes
        self.binary_paths = binary_paths
        self.app = app if not policy.origins else CORSMiddleware(
            app, allow_origins=sorted(policy.origins), allow_methods=["*"], allow_headers=["*"],
            expose_headers=["Idempotent-Replayed", "X-Rewind-Mode", "Retry-After"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self.refusal(scope)) is not None:
            return await refusal.send(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> _Refusal | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            return _Refusal(421, "MisdirectedRequest",
                            f"this server does not answer to the host name {host!r} "
                            "(rewind serve --allow-host NAME adds one)")
        origin = headers.get("origin")
        if origin is not None and origin != f"http://{host}" and origin not in self.policy.origins:
            return _Refusal(403, "Forbidden", f"requests from the web origin {origin!r} are refused "
                                              "(rewind serve --allow-origin ORIGIN allows one)")
        if origin is None and headers.get("sec-fetch-site") in ("cross-site", "same-site") \
                and not (scope["method"] == "GET" and scope["path"] in PUBLIC_PATHS):
            return _Refusal(403, "Forbidden", "cross-site requests from a browser are refused")
        if scope["method"] in CHANGES_STATE:
            return self._content_type_refusal(scope, headers.get("content-type"))
        return None

    def _content_type_refusal(self, scope: Scope, content_type: str | None) -> _Refusal | None:
        if content_type is None:
            return None  # not a browser's form: a body, if any, is checked by its route
        given = content_type.partition(";")[0].strip().lower()
        declared = OCTETS if self._route_path(scope) in self.binary_paths else JSON
        if given in FORM_TYPES or not _media_fits(given, declared):
            return _Refusal(415, "UnsupportedMediaType",
                            f"{scope['method']} {scope['path']} takes {declared}, not {given}")
        return None

    def _route_path(self, scope: Scope) -> str | None:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", None)
        return None


def _media_fits(given: str, declared: str) -> bool:
    if declared == JSON:
        return given == JSON or (given.startswith("application/") and given.endswith("+json"))
    return given == declared


def default_token(path: Path) -> str:
    """The token in the daemon's default token file, made (0600, a new token) if missing.
    Made whole or not at all, so two daemons starting at once share one."""
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = write_tmp(root, (secrets.token_urlsafe(32) + "\n").encode())
        try:
            os.link(tmp, path)  # never replaces a token clients already hold
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        fsync_dir(root)
    return read_token_file(path)


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise InvalidArgument(f"cannot read the token file {path}: {e.strerror}") from e
    if not token:
        raise InvalidArgument(f"the token file {path} is empty")
    return token
