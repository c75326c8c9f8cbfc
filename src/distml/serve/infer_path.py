"""The inference route's hot path (:class:`distml.net.hot_path.HotPath`), for the replica and
the router alike: ``POST /v2/models/{name}[/versions/{version}]/infer`` is nearly every request
a deployment serves. Refusals of the token and of the body limit come in the Open Inference
Protocol's error shape, as the routes' own do.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import Scope

from distml.net.hot_path import Reply, add_hot_path

# The inference routes as FastAPI matches them: a name of at most 256 characters and a version
# of at most 64, neither holding "/". Any other path goes to FastAPI, which refuses it.
INFER_ROUTE = re.compile(r"/v2/models/([^/]{1,256})(?:/versions/([^/]{1,64}))?/infer")

# (model name, version or None, body, request headers) -> the answer.
InferHandler = Callable[[str, "str | None", bytes, Headers], Awaitable[Reply]]


def add_infer_path(app: FastAPI, handler: InferHandler, max_body: int) -> None:
    """Answer ``app``'s inference routes with ``handler``, ahead of FastAPI."""

    def accept(match: re.Match[str], scope: Scope) -> tuple[str, str | None]:
        return match[1], match[2]

    async def answer(route: tuple[str, str | None], chunks: list[bytes], headers: Headers):
        return await handler(*route, b"".join(chunks), headers)

    add_hot_path(app, route=INFER_ROUTE, accept=accept, answer=answer, max_body=max_body)
