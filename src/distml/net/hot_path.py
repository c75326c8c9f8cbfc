"""A service's busiest route in plain ASGI, ahead of FastAPI.

FastAPI's routing, dependency injection, middleware and response classes cost tens to hundreds
of microseconds of CPU a request: more than a replica spends on a small model's request, or a
parameter-server shard on a small model's step (``benchmarks/serving.py``,
``benchmarks/ps_transport.py``). :class:`HotPath` answers one route before FastAPI sees it, with
the checks every route has: the bearer token, the body limit (the declared length first, then
the bytes read). What it does not take, FastAPI answers: every other route, and every request
of this one that ``accept`` turns down (a parameter out of its range, a name too long), so
that its refusal is FastAPI's, word for word. The route stays declared in FastAPI, for the
OpenAPI document and for those refusals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from distml.net.token import Tokens, Unauthorized
from distml.net.untrusted import declared_over


@dataclass
class Reply:
    """An answer, ready to send: what the hot path and the FastAPI routes both give."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, content: Any, **headers: str) -> Reply:
        return cls(status, json.dumps(content).encode(), headers=headers)

    @classmethod
    def error(cls, status: int, message: str, key: str = "error", **headers: str) -> Reply:
        """A refusal: ``{"error": message}`` by default (the Open Inference Protocol's shape),
        ``key="detail"`` for FastAPI's."""
        return cls.json(status, {key: message}, **headers)

    def response(self) -> Response:
        """As a Starlette response, for a FastAPI route to return."""
        return Response(self.body, self.status, self.headers, media_type=self.content_type)


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"body over the limit of {limit} bytes")


# What the route's path and query say, checked; None: FastAPI answers the request instead.
Accept = Callable[[re.Match[str], Scope], Any]
# (what accept gave, the body's chunks as they came, the request's headers) -> the answer.
Answer = Callable[[Any, list[bytes], Headers], Awaitable[Reply]]


@dataclass(frozen=True)
class HotRoute:
    """A service's busiest route: ``POST`` requests whose path ``route`` matches whole, and that
    ``accept`` takes, are authenticated by ``tokens``, read within ``max_body`` and answered by
    ``answer``. Served by :class:`HotPath` inside an ASGI server, and by
    :class:`distml.net.hot_protocol.HotPathProtocol` in uvicorn's own protocol, ahead of ASGI."""

    route: re.Pattern[str]
    accept: Accept
    answer: Answer
    tokens: Tokens
    max_body: int
    refusal_key: str = "error"

    def unauthorized(self, authorization: str | None) -> Reply | None:
        """The refusal of a request without a token this service knows; None: let it in."""
        try:
            self.tokens.identity(authorization)
        except Unauthorized:
            return Reply.error(401, Unauthorized.detail, "detail", **Unauthorized.headers)
        return None

    def too_large(self) -> Reply:
        return Reply.error(413, str(BodyTooLarge(self.max_body)), self.refusal_key)


class HotPath:
    """ASGI middleware: the requests of ``hot`` answered ahead of ``app``; anything else goes
    on to ``app``."""

    def __init__(self, app: ASGIApp, *, hot: HotRoute):
        self.app, self.hot = app, hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot, taken = self.hot, None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = hot.route.fullmatch(scope["path"])
            taken = None if match is None else hot.accept(match, scope)
        if taken is None:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = hot.unauthorized(headers.get("authorization"))
        if refusal is not None:
            return await respond(send, refusal)
        try:
            chunks = await read(receive, headers.get("content-length"), hot.max_body)
        except BodyTooLarge:
            return await respond(send, hot.too_large())
        if chunks is None:  # the client went away
            return None
        return await respond(send, await hot.answer(taken, chunks, headers))


def add_hot_path(
    app: FastAPI,
    *,
    route: re.Pattern[str],
    accept: Accept,
    answer: Answer,
    max_body: int,
    refusal_key: str = "error",
) -> None:
    """Answer ``route`` ahead of ``app``, a service of :func:`distml.net.create_app` (whose
    tokens it checks): in uvicorn's protocol where :func:`distml.net.serve` serves it
    (``app.state.hot_route``), and as a :class:`HotPath` middleware in any other ASGI server."""
    hot = HotRoute(route, accept, answer, app.state.tokens, max_body, refusal_key)
    app.state.hot_route = hot
    app.add_middleware(HotPath, hot=hot)


async def read(receive: Receive, declared: str | None, limit: int) -> list[bytes] | None:
    """The body's chunks as they came, or ``None`` should the client disconnect; over
    ``limit``: :class:`BodyTooLarge` (the declared length is checked first, as
    :func:`distml.net.read_body` does)."""
    if declared_over(declared, limit):
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
            return chunks


async def respond(send: Send, reply: Reply) -> None:
    headers = [
        (b"content-type", reply.content_type.encode("latin-1")),
        (b"content-length", str(len(reply.body)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()),
    ]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
