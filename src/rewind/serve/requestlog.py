"""Request ids and structured logs of `rewind serve`.

Every answer carries `X-Request-Id`: the caller's own when it sent a sane one, else a new
one. The daemon logs one JSON line per request (id, method, path, status, milliseconds) and
every other log line it writes while serving that request carries the same id, threads
included (the id is a context variable, which Starlette's threadpool copies).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import sys
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("rewind_request_id", default=None)
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
log = logging.getLogger("rewind.serve.requests")


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _SANE.fullmatch(given) else secrets.token_hex(8)
        REQUEST_ID.set(request_id)
        started, status = time.monotonic(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round((time.monotonic() - started) * 1000, 1)})


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the request id, and extras."""

    FIELDS = ("method", "path", "status", "ms")

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage(), "request_id": REQUEST_ID.get()}
        line.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_as_json_lines() -> None:
    """The daemon's logs (rewind's and the server's) as JSON lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    for name in ("rewind", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
