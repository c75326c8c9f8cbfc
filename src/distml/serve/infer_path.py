"""The inference route's hot path, in plain ASGI, for the replica and the router alike.

``POST /v2/models/{name}[/versions/{version}]/infer`` is nearly every request a deployment
serves, and FastAPI's routing, dependency injection, middleware and response classes cost more
CPU per request than what a small model's replica or the router does with it
(``benchmarks/serving.py``). :class:`InferPath` answers that route before FastAPI sees it: the
same bearer token, the same body limit (the declared length first, then the bytes read), then
the app's own handler. Every other request, and every one this path does not match as FastAPI
would (a name over 256 characters, a version over 64), goes on to FastAPI, where the inference
routes stay declared, for the OpenAPI document and for those refusals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from distml.net.service import Tokens, Unauthorized

# The inference routes as FastAPI matches them: a name of at most 256 characters and a version
# of at most 64, neither holding "/".
INFER_ROUTE = re.compile(r"/v2/models/([^/]{1,256})(?:/versions/([^/]{1,64}))?/infer")


@dataclass
class Reply:
    """An answer, ready to send: what the hot path and the FastAPI routes both give."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def error(cls, status: int, message: str, key: str = "error", **headers: str) -> Reply:
        """The protocol's error shape (``{"error": ...}``; FastAPI's ``detail`` for a 401)."""
        return cls(status, json.dumps({key: message}).encode(), headers=headers)

    def response(self) -> Response:
        """As a Starlette response, for a FastAPI route to return."""
        return Response(self.body, self.status, self.headers, media_type=self.content_type)


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"body over the limit of {limit} bytes")


# (model name, version or None, body, request headers) -> the answer.
InferHandler = Callable[[str, "str | None", bytes, Headers], Awaitable[Reply]]


class InferPath:
    """ASGI middleware: the inference route authenticated, read within ``max_body`` and
    answered by ``handler``; anything else goes on to ``app``."""

    def __init__(self, app: ASGIApp, handler: InferHandler, tokens: Tokens, max_body: int):
        self.app, self.handler, self.tokens, self.max_body = app, handler, tokens, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = INFER_ROUTE.fullmatch(scope["path"])
        if route is None:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        try:
            self.tokens.identity(headers.get("authorization"))
        except Unauthorized:
            reply = Reply.error(401, Unauthorized.detail, "detail", **Unauthorized.headers)
            return await respond(send, reply)
        try:
            body = await read(receive, headers.get("content-length"), self.max_body)
        except BodyTooLarge as exc:
            return await respond(send, Reply.error(413, str(exc)))
        if body is None:  # the client went away
            return None
        name, version = route.groups()
        return await respond(send, await self.handler(name, version, body, headers))


async def read(receive: Receive, declared: str | None, limit: int) -> bytes | None:
    """The body, or ``None`` should the client disconnect; over ``limit``: :class:`BodyTooLarge`
    (the declared length is checked first, as :func:`distml.net.read_body` does)."""
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def respond(send: Send, reply: Reply) -> None:
    headers = [
        (b"content-type", reply.content_type.encode("latin-1")),
        (b"content-length", str(len(reply.body)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()),
    ]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
