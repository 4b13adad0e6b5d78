"""The gate in front of every HTTP service of the job (control plane, agents, Lighthouse wrapper).

An ASGI middleware that answers before any route or body parser runs:

- a ``Host`` header this service does not answer to gets 421: a web page that rebinds its own
  DNS name to 127.0.0.1 reaches the port, but its requests still carry its own name;
- a method a path does not take (TRACE, PATCH, OPTIONS, a DELETE where there is none) gets 405
  with an ``Allow`` header naming every method the path takes, before the token is asked for: the
  answer is the same with or without one;
- a request that may change something (any method but GET, HEAD and OPTIONS) without an
  accepted bearer token gets 401 or 403 before a byte of its body is read;
- a body larger than ``max_body_bytes`` gets 413, by its Content-Length or, chunked, as it is
  counted (only authenticated bodies are read, and those are small: an ingest batch, a drill);
- a WebSocket handshake (an agent's event stream) is held to the same Host and token rules,
  whatever its method: it is refused with the status and reason a POST would get.
"""

from __future__ import annotations

import json
import re
from typing import Collection

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.tokens import Accepted, bearer, refusal

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_BODY_BYTES = 8 * 1024 * 1024
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
"""Names every service answers to."""


def host_name(host_header: str) -> str:
    """The name of a ``Host`` header, without its port: ``[::1]:8000`` → ``::1``."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


class RequestGuard:
    def __init__(self, app: ASGIApp, accepted: Accepted, allowed_hosts: Collection[str],
                 max_body_bytes: int = MAX_BODY_BYTES):
        """``allowed_hosts``: names besides the loopback ones; ``*`` answers to any (behind a proxy
        that checks them)."""
        self.app = app
        self.accepted = accepted
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts) | LOOPBACK_NAMES
        self.max_body_bytes = max_body_bytes
        self.methods = MethodTable()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        websocket = scope["type"] == "websocket"
        refused, extra = self._host_refusal(headers), None
        if refused is None and not websocket and (allow := self.methods.allowed(scope)) is not None:
            refused = 405, f"{scope['method']} is not a method of {scope['path']}; it takes {', '.join(allow)}"
            extra = {"allow": ", ".join(allow)}
        if refused is None and (websocket or scope["method"] not in SAFE_METHODS):
            refused = refusal(bearer(headers.get("authorization")), self.accepted(scope["path"]))
            extra = {"www-authenticate": "Bearer"}
        if refused is not None:
            await (_refuse_handshake(scope, send, *refused, extra) if websocket else _answer(send, *refused, extra))
            return
        if websocket or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        if int(headers.get("content-length") or 0) > self.max_body_bytes:
            await _answer(send, 413, f"the body is larger than {self.max_body_bytes} bytes")
            return
        body = await self._read(receive)
        if body is None:
            await _answer(send, 413, f"the body is larger than {self.max_body_bytes} bytes")
            return
        await self.app(scope, _replay(body, receive), send)

    def _host_refusal(self, headers: Headers) -> tuple[int, str] | None:
        host = host_name(headers.get("host", "")).lower()
        if "*" not in self.allowed_hosts and host not in self.allowed_hosts:
            return 421, f"this server does not answer to Host '{host}'; reach it by an address it was told of " \
                        "(--allowed-hosts)"
        return None

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it grows past the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class MethodTable:
    """Which methods each documented path takes, from the app's OpenAPI document (built at the
    first request): a request whose method its path does not take is answered 405 with every
    method in ``Allow``. Starlette's own 405 names only the first route that has the path, where
    a path's reads and its commands are two routers; and it comes after the token is asked for."""

    def __init__(self) -> None:
        self._paths: list[tuple[re.Pattern, list[str]]] | None = None

    def allowed(self, scope: Scope) -> list[str] | None:
        """The methods the request's path takes, when its method is not one of them (None: it
        is, or the path is not in the document). A literal path is tried before a template that
        also matches it (``/drills/kinds`` before ``/drills/{drill_id}``)."""
        if self._paths is None:
            openapi = getattr(scope.get("app"), "openapi", None)
            self._paths = [] if openapi is None else [
                (re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(path)) + "$"),
                 sorted(m.upper() for m in ops if m.upper() in HTTP_METHODS))
                for path, ops in sorted(openapi()["paths"].items(), key=lambda item: item[0].count("{"))]
        path, method = scope["path"], scope["method"]
        for pattern, methods in self._paths:
            if pattern.match(path):
                return None if method in methods else methods
        return None


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _response(status: int, detail: str, extra: dict[str, str] | None = None) -> tuple[bytes, list]:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    return body, headers


async def _answer(send: Send, status: int, detail: str, extra: dict[str, str] | None = None) -> None:
    body, headers = _response(status, detail, extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _refuse_handshake(scope: Scope, send: Send, status: int, detail: str,
                            extra: dict[str, str] | None = None) -> None:
    """The handshake answered with the status and body a request would get, where the server
    can (ASGI's denial response); else closed before it is accepted (the client sees a 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body, headers = _response(status, detail, extra)
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})


async def unreadable_body_as_422(request: Request, err: StarletteHTTPException) -> Response:
    """FastAPI answers a body it cannot even decode (not UTF-8) with an undocumented 400 ("There
    was an error parsing the body"), and one that is text but not JSON with a 422: one answer,
    the documented one-line 422, for both. Every other HTTP error goes out as FastAPI sends it."""
    if err.status_code == 400 and isinstance(err.__cause__, UnicodeDecodeError):
        msg = "not JSON: the body is not even UTF-8 text"
        return JSONResponse(status_code=422, content={"detail": f"body: {msg}", "errors": [
            {"type": "json_invalid", "loc": ["body"], "msg": msg}]})
    return await http_exception_handler(request, err)


async def one_line_422(request: Request, err: RequestValidationError) -> JSONResponse:
    """What is wrong, in one line, and each error's place and message. The input is not echoed:
    it may be a NaN, which JSON cannot carry, or a secret."""
    errors = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in err.errors()]
    where = ".".join(str(p) for p in errors[0]["loc"])
    return JSONResponse(status_code=422, content={"detail": f"{where}: {errors[0]['msg']}", "errors": errors})


DETAIL = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
ONE_LINE_422 = {
    "type": "object", "required": ["detail", "errors"],
    "properties": {"detail": {"type": "string", "description": "where and what, in one line"},
                   "errors": {"type": "array", "items": {
                       "type": "object", "required": ["type", "loc", "msg"],
                       "properties": {"type": {"type": "string"}, "msg": {"type": "string"},
                                      "loc": {"type": "array", "items": {"anyOf": [{"type": "string"},
                                                                                   {"type": "integer"}]}}}}}},
}
GUARD_ANSWERS = {
    "401": "no bearer token", "403": "a token this route does not take", "413": "a body over the size limit",
}


def _documented(document: dict) -> dict:
    """The OpenAPI document as the guard and the 422 handler really answer: 421 on every route,
    401/403/413 on every route that changes something, and the one-line 422 body."""
    json_body = lambda schema, description: {  # noqa: E731
        "description": description, "content": {"application/json": {"schema": schema}}}
    for methods in document.get("paths", {}).values():
        for method, operation in methods.items():
            answers = operation.setdefault("responses", {})
            answers.setdefault("421", json_body(DETAIL, "a Host this server does not answer to"))
            if method.upper() not in SAFE_METHODS:
                for status, description in GUARD_ANSWERS.items():
                    answers.setdefault(status, json_body(DETAIL, description))
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    if "HTTPValidationError" in schemas:
        schemas["HTTPValidationError"] = ONE_LINE_422
    return document


def guard(app: FastAPI, accepted: Accepted, allowed_hosts: Collection[str], max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Put :class:`RequestGuard` in front of the app, answer invalid requests in one line, and say
    both in the app's OpenAPI document."""
    app.add_middleware(RequestGuard, accepted=accepted, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes)
    app.add_exception_handler(RequestValidationError, one_line_422)
    app.add_exception_handler(StarletteHTTPException, unreadable_body_as_422)
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _documented(generate())
        return app.openapi_schema

    app.openapi = openapi
