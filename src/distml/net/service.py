"""An ASGI service as distml builds them: FastAPI with a bearer token on every route, a cap on
request bodies, ``/healthz`` through the real work path, ``/metrics`` for Prometheus, and uvicorn
(with TLS when given a certificate) to serve it.

>>> app = create_app("echo", token="s3cret", health=lambda: {"ok": True})
>>> serve(app, "127.0.0.1", 8080)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp

from distml.net.hot_protocol import http_protocol
from distml.net.ports import inherited_sockets, listening_socket
from distml.net.token import Tokens, Unauthorized
from distml.net.untrusted import declared_over

DEFAULT_MAX_BODY = 256 * 2**20
SAFETENSORS = "application/octet-stream"

Health = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]
log = logging.getLogger("distml.net")


def octet_stream_body(limit: int, description: str = "a safetensors payload") -> dict[str, Any]:
    """The ``openapi_extra`` of a route that reads its body with :func:`read_body`: the body is
    declared in the OpenAPI document (binary, with its size limit), so a schema fuzzer reaches it.

    >>> @app.post("/v1/push", openapi_extra=octet_stream_body(2**20))  # doctest: +SKIP
    """
    return {
        "requestBody": {
            "required": True,
            "description": f"{description}, at most {limit} bytes",
            "content": {
                SAFETENSORS: {"schema": {"type": "string", "format": "binary", "maxLength": limit}}
            },
        }
    }


class BackgroundLoops:
    """The background loops of one service (a federation's rounds, a router's health checks...).

    A loop's step that raises is logged with its traceback and the loop goes on: one bad input
    never stops the service for everyone else. A loop that ends all the same (its step raised
    :class:`LoopStopped`, or a bug outside the step) makes ``/healthz`` answer 503, so the service
    is never left half-alive behind a healthy answer.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.errors: dict[str, int] = {}

    def start(
        self, name: str, step: Callable[[], Awaitable[Any]], interval_s: float = 0.0
    ) -> asyncio.Task[None]:
        """Run ``await step()`` forever, ``interval_s`` apart, in this event loop."""

        async def loop() -> None:
            while True:
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except LoopStopped:
                    raise
                except Exception:
                    self.errors[name] = self.errors.get(name, 0) + 1
                    log.exception("background loop %r: a step failed; the loop goes on", name)
                await asyncio.sleep(interval_s)

        task = asyncio.get_running_loop().create_task(loop(), name=name)
        self._tasks[name] = task
        return task

    def check(self) -> None:
        """Raise ``RuntimeError`` naming every loop that has stopped (health checks call this)."""
        dead = {n: t for n, t in self._tasks.items() if t.done() and not t.cancelled()}
        if dead:
            causes = ", ".join(f"{n}: {t.exception()!r}" for n, t in dead.items())
            raise RuntimeError(f"background loop stopped ({causes})")

    async def stop(self) -> None:
        """Cancel every loop and wait for each to end."""
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass  # a stopped loop's cause was already reported by check()
        self._tasks.clear()


class LoopStopped(Exception):
    """Raised by a loop's step when the loop cannot go on; the service then reports unhealthy."""


def create_app(
    title: str,
    token: str | Mapping[str, str],
    health: Health,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """A FastAPI app whose every route, ``/healthz`` and ``/metrics`` included, needs
    ``Authorization: Bearer <token>``. ``health()`` does real work: a failure answers 503, and so
    does a background loop of ``app.state.loops`` (:class:`BackgroundLoops`) that has stopped.

    ``token`` is one shared token, or a mapping ``identity -> token`` (one token per client):
    a route then finds who called it in ``request.state.identity`` (``None`` for a shared token).
    ``app.state.tokens`` (:class:`distml.net.token.Tokens`) checks them, for a path served
    beside FastAPI's.
    """
    tokens = Tokens(token)
    bearer = HTTPBearer(auto_error=False)  # declares the scheme in the OpenAPI document

    # async: a hash and a lookup, never blocking; a plain def would send every request of every
    # service through FastAPI's thread pool for it.
    async def authenticate(request: Request, _: Any = Depends(bearer)) -> None:
        try:
            request.state.identity = tokens.identity(request.headers.get("authorization"))
        except Unauthorized:
            raise HTTPException(401, Unauthorized.detail, headers=Unauthorized.headers) from None

    # The OpenAPI document is served behind the token too (FastAPI's own routes for it and
    # its docs pages would not be).
    app = FastAPI(
        title=title,
        dependencies=[Depends(authenticate)],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.registry = registry or CollectorRegistry()
    app.state.tokens = tokens
    app.state.loops = BackgroundLoops()

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        try:
            app.state.loops.check()
            result = health()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # the health check's own failure is the answer
            raise HTTPException(503, f"unhealthy: {exc}") from None
        return {"status": "ok", **result}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def read_body(request: Request, limit: int = DEFAULT_MAX_BODY) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (the declared length is
    checked first; a body without one is counted as it streams)."""
    return b"".join(await read_chunks(request, limit))


async def read_chunks(request: Request, limit: int = DEFAULT_MAX_BODY) -> list[bytes]:
    """The request body's chunks as they came, with :func:`read_body`'s limits: for a caller
    that joins them into a buffer of its own."""
    declared = request.headers.get("content-length")
    if declared_over(declared, limit):
        raise HTTPException(413, f"body over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body over the limit of {limit} bytes")
        chunks.append(chunk)
    return chunks


def serve(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    shared: tuple[str, int] | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "warning",
) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (uvicorn finishes the requests in flight first), on
    ``host:port``, and with ``shared`` on that ``(host, port)`` too, bound with ``SO_REUSEPORT``
    so that every process serving it there takes a share of its connections. Sockets the
    process that started this one handed over (:data:`distml.net.ports.LISTEN_FD_ENV`) are
    served in place of binding: the shared port's by its number, the first other one as
    ``host:port``."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http_protocol(app),
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        log_level=log_level,
        access_log=False,
    )
    handed = inherited_sockets()
    if not handed and shared is None:
        uvicorn.Server(config).run()  # uvicorn binds host:port itself
        return
    shared_socket = None
    if shared is not None:
        ours = [s for s in handed if s.getsockname()[1] == shared[1]]
        shared_socket = ours[0] if ours else listening_socket(*shared, reuse_port=True)
        handed = [s for s in handed if s is not shared_socket]
    sockets = [handed[0] if handed else listening_socket(host, port)]
    if shared_socket is not None:
        sockets.append(shared_socket)
    uvicorn.Server(config).run(sockets=sockets)


class BackgroundServer:
    """``app`` served by uvicorn in a thread of this process, for as long as the ``with`` block
    runs (a simulation's server, a test's).

    >>> with BackgroundServer(app, port) as server:  # doctest: +SKIP
    ...     httpx.get(server.url + "/healthz")
    """

    def __init__(self, app: FastAPI, port: int = 0, host: str = "127.0.0.1"):
        self._socket = listening_socket(host, port)  # port 0: a free one, bound from now on
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                http=http_protocol(app),
                log_level="warning",
                access_log=False,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> BackgroundServer:

        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
