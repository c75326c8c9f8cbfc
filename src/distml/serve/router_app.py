"""The router as a service: the replicas' Open Inference Protocol routes, forwarded (binary
tensor data included, passed through unread), plus
Prometheus metrics of its own (requests by outcome, latency, in-flight per replica), and a
uvicorn server that drains before it stops: on SIGTERM/SIGINT new requests get 503 while the
ones in flight finish, then the server exits.

>>> router = Router(["http://10.0.0.1:8100", "http://10.0.0.2:8100"], token)  # doctest: +SKIP
>>> run_router(create_router_app(router, token), router, "0.0.0.0", 8000)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from typing import Annotated, Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Gauge, Histogram
from starlette.datastructures import Headers
from starlette.responses import Response

from distml.net import create_app, read_body
from distml.net.hot_path import Reply
from distml.net.hot_protocol import http_protocol
from distml.serve.infer_path import add_infer_path
from distml.serve.protocol import (
    HEADER_LENGTH,
    MAX_INDEX_BODY,
    InferResponse,
    ModelMetadata,
    ProtocolError,
    RepositoryModel,
    ServerMetadata,
    index_body,
    infer_body,
    parse_header_length,
    server_metadata,
)
from distml.serve.router import Draining, NoReplica, Router
from distml.serve.upstream import UnsafeHeader

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ModelName = Annotated[str, Path(max_length=256)]
ModelVersion = Annotated[str, Path(max_length=64)]


@functools.lru_cache(maxsize=1024)  # each request names its model: quote it once
def model_path(name: str, tail: str = "", version: str | None = None) -> str:
    # Quoted whole: a name holding "?", "#", "/" or a space stays one path segment.
    path = f"/v2/models/{quote(name, safe='')}"
    if version is not None:
        path += f"/versions/{quote(version, safe='')}"
    return path + tail


def create_router_app(router: Router, token: str, max_body: int = 16 * 2**20) -> FastAPI:
    """The router's app; its lifespan runs the replicas' health checks as a background loop
    of ``app.state.loops`` (``/healthz`` answers 503 should that loop ever stop)."""

    async def health() -> dict[str, Any]:
        # The router is healthy when a replica answers a real inference through it.
        if not await router.ready():
            raise RuntimeError("no replica is ready")
        return {"replicas": {r.url: r.healthy for r in router.replicas}}

    app = create_app("distml router", token, health=health)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loops.start("replica-health", router.check_health, router.health_interval_s)
        yield
        await app.state.loops.stop()
        await router.close()

    app.router.lifespan_context = lifespan
    registry = app.state.registry
    outcomes = Counter(
        "distml_router_requests", "Requests by outcome", ["outcome"], registry=registry
    )
    # Each outcome's child looked up once: .labels() on every request costs a lock and a hash.
    ok, client_error, error, refused, failed = (
        outcomes.labels(kind) for kind in ("ok", "client_error", "error", "refused", "failed")
    )
    retries = Counter(
        "distml_router_retries", "Requests sent again to another replica", registry=registry
    )
    latency = Histogram(
        "distml_router_latency_seconds",
        "Time from request to response, retries included",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    in_flight = Gauge(
        "distml_router_in_flight", "Requests in flight per replica", ["replica"], registry=registry
    )
    healthy = Gauge("distml_router_replica_healthy", "1 if ready", ["replica"], registry=registry)
    for replica in router.replicas:
        # Read at scrape time: the router's own counts are the truth.
        in_flight.labels(replica.url).set_function(lambda r=replica: r.in_flight)
        healthy.labels(replica.url).set_function(lambda r=replica: float(r.healthy))

    async def relay(
        method: str, path: str, body: bytes, content_type: str, header_length: str | None
    ) -> Reply:
        """A request the caller has authenticated and read, checked and sent on."""
        headers: dict[str, str] = {}
        if header_length is not None:  # checked: what reaches a replica is well-formed
            try:
                parse_header_length(header_length, len(body))
            except ProtocolError as exc:
                return Reply.error(exc.status, str(exc))
            headers[HEADER_LENGTH] = header_length
        with latency.time():
            try:
                result = await router.forward(method, path, body, content_type, headers)
            except Draining:
                refused.inc()
                return Reply.error(503, "the router is shutting down")
            except NoReplica as exc:
                failed.inc()
                return Reply.error(503, str(exc))
            except UnsafeHeader as exc:  # nothing was sent: the client's fault alone
                client_error.inc()
                return Reply.error(400, str(exc))
        if result.attempts > 1:
            retries.inc(result.attempts - 1)
        (ok if result.status < 400 else client_error if result.status < 500 else error).inc()
        return Reply(result.status, result.content, result.content_type, result.headers)

    async def forward(request: Request, path: str, limit: int = max_body) -> Response:
        body = b""
        if request.method == "POST":
            try:
                body = await read_body(request, limit)
            except HTTPException as exc:
                return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        reply = await relay(
            request.method,
            path,
            body,
            request.headers.get("content-type", ""),
            request.headers.get(HEADER_LENGTH) if request.method == "POST" else None,
        )
        return reply.response()

    async def infer(name: str, version: str | None, body: bytes, headers: Headers) -> Reply:
        path = model_path(name, "/infer", version)
        content_type = headers.get("content-type", "")
        return await relay("POST", path, body, content_type, headers.get(HEADER_LENGTH))

    add_infer_path(app, infer, max_body)

    about = server_metadata("distml", package_version("distml"))

    @app.get("/v2")
    async def server() -> ServerMetadata:
        return about

    @app.post(
        "/v2/repository/index", openapi_extra=index_body(), response_model=list[RepositoryModel]
    )
    async def repository_index(request: Request) -> Response:
        return await forward(request, "/v2/repository/index", MAX_INDEX_BODY)

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": not router.draining}

    @app.get("/v2/health/ready")
    async def ready(request: Request) -> Response:
        if router.draining or not await router.ready():
            raise HTTPException(503, "no replica is ready")
        return await forward(request, "/v2/health/ready")

    @app.get("/v2/models/{name}", response_model=ModelMetadata)
    async def metadata(name: ModelName, request: Request) -> Response:
        return await forward(request, model_path(name))

    @app.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata)
    async def version_metadata(
        name: ModelName, version: ModelVersion, request: Request
    ) -> Response:
        return await forward(request, model_path(name, version=version))

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: ModelName, request: Request) -> Response:
        return await forward(request, model_path(name, "/ready"))

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: ModelName, version: ModelVersion, request: Request) -> Response:
        return await forward(request, model_path(name, "/ready", version))

    infer_route = {"response_model": InferResponse, "openapi_extra": infer_body(max_body)}

    @app.post("/v2/models/{name}/infer", **infer_route)
    async def infer(name: ModelName, request: Request) -> Response:
        return await forward(request, model_path(name, "/infer"))

    @app.post("/v2/models/{name}/versions/{version}/infer", **infer_route)
    async def version_infer(name: ModelName, version: ModelVersion, request: Request) -> Response:
        return await forward(request, model_path(name, "/infer", version))

    return app


def run_router(
    app: FastAPI,
    router: Router,
    host: str,
    port: int,
    *,
    drain_s: float = 30.0,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve until a signal, draining first (uvicorn alone would stop listening at once, and a
    client would see refused connections instead of a 503 it can act on)."""

    class DrainingServer(uvicorn.Server):
        # Exit flags are set directly: uvicorn re-raises the signals its own handler recorded
        # once it stops, which would kill this process before the replicas are stopped.
        def handle_exit(self, sig: int, frame: Any) -> None:
            if router.draining:  # a second signal: stop now
                self.force_exit = True
                self.should_exit = True
                return
            done = asyncio.run_coroutine_threadsafe(router.drain(drain_s), self._loop)
            done.add_done_callback(lambda _: setattr(self, "should_exit", True))

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if on_started is not None:
                on_started()

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http_protocol(app),
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        log_level="warning",
        access_log=False,
    )
    DrainingServer(config).run()
