"""An ASGI service as distml builds them: FastAPI with a bearer token on every route, a cap on
request bodies, ``/healthz`` through the real work path, ``/metrics`` for Prometheus, and uvicorn
(with TLS when given a certificate) to serve it.

>>> app = create_app("echo", token="s3cret", health=lambda: {"ok": True})
>>> serve(app, "127.0.0.1", 8080)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

DEFAULT_MAX_BODY = 256 * 2**20

Health = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def create_app(
    title: str,
    token: str | Mapping[str, str],
    health: Health,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """A FastAPI app whose every route, ``/healthz`` and ``/metrics`` included, needs
    ``Authorization: Bearer <token>``. ``health()`` does real work: a failure answers 503.

    ``token`` is one shared token, or a mapping ``identity -> token`` (one token per client):
    a route then finds who called it in ``request.state.identity`` (``None`` for a shared token).
    """
    bearer = HTTPBearer(auto_error=False)
    # Tokens are looked up by their SHA-256: the lookup time says nothing about a guess's prefix.
    if isinstance(token, str):
        identities: dict[bytes, str | None] = {_digest(token): None}
    else:
        identities = {_digest(t): identity for identity, t in token.items()}
    if len(identities) < (1 if isinstance(token, str) else len(token)):
        raise ValueError("two identities share one token")

    def authenticate(
        request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)
    ) -> None:
        digest = _digest(creds.credentials) if creds is not None else b""
        if digest not in identities:
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        request.state.identity = identities[digest]

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

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        try:
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
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413, f"body over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def serve(
    app: FastAPI,
    host: str,
    port: int,
    *,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "warning",
) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (uvicorn finishes the requests in flight first)."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        log_level=log_level,
        access_log=False,
    )


class BackgroundServer:
    """``app`` served by uvicorn in a thread of this process, for as long as the ``with`` block
    runs (a simulation's server, a test's).

    >>> with BackgroundServer(app, port) as server:  # doctest: +SKIP
    ...     httpx.get(server.url + "/healthz")
    """

    def __init__(self, app: FastAPI, port: int, host: str = "127.0.0.1"):
        import threading

        import uvicorn

        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> BackgroundServer:
        import time

        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
