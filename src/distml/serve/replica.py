"""One model replica: the Open Inference Protocol v2 REST API over a dynamic batcher, tensors in
JSON or with the binary tensor data extension (``tritonclient.http``'s default).

Every route needs the bearer token; every request body is validated (pydantic, then the model's
signature, values within their datatype, at most ``max_batch_rows`` rows) before it reaches the
queue, so a malformed request gets a 4xx and changes nothing. An input the model raises on, or
answers with an overflow, is the request's fault too (422); a batch that fails for another cause
answers 503, which a router takes to another replica. Readiness (``/v2/health/ready``,
``/v2/models/{name}/ready``, ``/healthz``) runs a real one-row inference through the same
queue as the traffic.

>>> app = create_replica_app(load_served_model("runs/digits", "digits-cnn"), token)
... # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from typing import Annotated, Any

import torch
from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram
from starlette.datastructures import Headers
from starlette.responses import Response

from distml.net import create_app, read_body
from distml.net.hot_path import Reply
from distml.serve.batching import MAX_BATCH_ROWS, BatchFailed, DynamicBatcher, InferenceFailed
from distml.serve.infer_path import add_infer_path
from distml.serve.model import ServedModel
from distml.serve.protocol import (
    HEADER_LENGTH,
    MAX_INDEX_BODY,
    OCTET_STREAM,
    InferResponse,
    ModelMetadata,
    ProtocolError,
    RepositoryModel,
    ServerMetadata,
    decode_request,
    encode_response,
    index_body,
    infer_body,
    metadata_of,
    parse_index_request,
    server_metadata,
    to_output,
)

PLATFORM = "pytorch_safetensors"
VERSION = "1"
ModelName = Annotated[str, Path(max_length=256)]
ModelVersion = Annotated[str, Path(max_length=64)]


def create_replica_app(
    served: ServedModel,
    token: str | Mapping[str, str],
    *,
    max_batch_size: int = 32,
    max_delay_ms: float = 0.0,
    max_body: int = 16 * 2**20,
    max_batch_rows: int = MAX_BATCH_ROWS,
    grpc: Callable[..., Any] | None = None,
) -> FastAPI:
    """The replica's app; a request of more than ``max_batch_rows`` rows is refused (413), and
    no forward pass takes more (``max_batch_size`` is the batch the batcher fills up to).
    ``grpc`` serves the same model and batch queue over gRPC for the app's lifetime
    (:meth:`distml.serve.grpc_service.GrpcService.serving`)."""

    async def ready() -> dict[str, Any]:
        try:
            await batcher.infer(served.example())
        except (InferenceFailed, BatchFailed) as exc:
            raise HTTPException(503, f"not ready: {exc}") from None
        return {"model": served.name}

    app = create_app(f"distml replica: {served.name}", token, health=ready)
    registry = app.state.registry
    requests = Counter(
        "distml_replica_requests", "Inference requests by outcome", ["outcome"], registry=registry
    )
    ok, rejected, failed = (requests.labels(kind) for kind in ("ok", "rejected", "failed"))
    latency = Histogram(
        "distml_replica_latency_seconds", "Inference latency in the replica", registry=registry
    )
    batch_rows = Histogram(
        "distml_replica_batch_rows",
        "Rows per batch run through the model",
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        registry=registry,
    )
    batcher = DynamicBatcher(
        served.predict,
        max_batch_size,
        max_delay_ms / 1000,
        on_batch=batch_rows.observe,
        max_rows=max_batch_rows,
    )
    app.state.batcher = batcher

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start(app.state.loops)
        if grpc is None:
            yield
        else:
            async with grpc(served, batcher, registry):
                yield
        await app.state.loops.stop()
        await batcher.close()

    app.router.lifespan_context = lifespan

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        rejected.inc()
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(BatchFailed)
    async def batch_failed(request: Request, exc: BatchFailed) -> JSONResponse:
        # 503: the replica's fault, not the request's; a router sends it to another replica.
        failed.inc()
        return JSONResponse({"error": str(exc)}, status_code=503)

    def check_name(name: str, version: str = VERSION) -> None:
        if name != served.name:
            raise ProtocolError(404, f"unknown model {name!r}; this replica serves {served.name!r}")
        if version != VERSION:
            raise ProtocolError(404, f"unknown version {version!r} of {name!r}; it has {VERSION!r}")

    about = server_metadata("distml", package_version("distml"))

    @app.get("/v2")
    async def server() -> ServerMetadata:
        return about

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def server_ready() -> dict[str, bool]:
        await ready()
        return {"ready": True}

    @app.post("/v2/repository/index", openapi_extra=index_body(), response_model_exclude_none=True)
    async def repository_index(request: Request) -> list[RepositoryModel]:
        query = parse_index_request(await _read_body(request, MAX_INDEX_BODY))
        try:
            await ready()
        except HTTPException as exc:
            unavailable = RepositoryModel(
                name=served.name, version=VERSION, state="UNAVAILABLE", reason=str(exc.detail)
            )
            return [] if query.ready else [unavailable]
        return [RepositoryModel(name=served.name, version=VERSION, state="READY")]

    def model_metadata(name: str, version: str = VERSION) -> ModelMetadata:
        check_name(name, version)
        return ModelMetadata(
            name=served.name,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[metadata_of(served.input)],
            outputs=[metadata_of(served.output)],
        )

    async def model_is_ready(name: str, version: str = VERSION) -> dict[str, Any]:
        check_name(name, version)
        await ready()
        return {"name": served.name, "ready": True}

    async def answer(name: str, version: str | None, body: bytes, headers: Headers) -> Reply:
        """An inference request, authenticated and read, answered; a refusal in the protocol's
        error shape, as the exception handlers above give it on the other routes."""
        try:
            check_name(name, version or VERSION)
            header_length = headers.get(HEADER_LENGTH)
            parsed, x = decode_request(body, served.input, max_batch_rows, header_length)
            if any(o.name != served.output.name for o in parsed.outputs or []):
                raise ProtocolError(400, f"unknown output; the model gives {served.output.name!r}")
            start = time.perf_counter()
            y = await _predict(batcher, x)
        except ProtocolError as exc:
            rejected.inc()
            return Reply.error(exc.status, str(exc))
        except BatchFailed as exc:
            failed.inc()
            return Reply.error(503, str(exc))
        latency.observe(time.perf_counter() - start)
        ok.inc()
        result = InferResponse(
            model_name=served.name,
            model_version=VERSION,
            id=parsed.id,
            outputs=[to_output(y, served.output, parsed.wants_binary(served.output.name))],
        )
        content, json_length = encode_response(result, [y])
        if json_length is None:
            return Reply(200, content)
        return Reply(200, content, OCTET_STREAM, {HEADER_LENGTH: str(json_length)})

    # The inference routes' hot path; the FastAPI routes below answer what it passes on.
    add_infer_path(app, answer, max_body)

    async def run_inference(request: Request, name: str, version: str | None = None) -> Response:
        body = await _read_body(request, max_body)
        reply = await answer(name, version, body, request.headers)
        return reply.response()

    @app.get("/v2/models/{name}")
    async def metadata(name: ModelName) -> ModelMetadata:
        return model_metadata(name)

    @app.get("/v2/models/{name}/versions/{version}")
    async def version_metadata(name: ModelName, version: ModelVersion) -> ModelMetadata:
        return model_metadata(name, version)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: ModelName) -> dict[str, Any]:
        return await model_is_ready(name)

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: ModelName, version: ModelVersion) -> dict[str, Any]:
        return await model_is_ready(name, version)

    infer_route = {"response_model": InferResponse, "openapi_extra": infer_body(max_body)}

    @app.post("/v2/models/{name}/infer", **infer_route)
    async def infer(name: ModelName, request: Request) -> Response:
        return await run_inference(request, name)

    @app.post("/v2/models/{name}/versions/{version}/infer", **infer_route)
    async def version_infer(name: ModelName, version: ModelVersion, request: Request) -> Response:
        return await run_inference(request, name, version)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, its refusal (413) in the protocol's error shape, which OIP clients read."""
    try:
        return await read_body(request, limit)
    except HTTPException as exc:
        raise ProtocolError(exc.status_code, str(exc.detail)) from None


async def _predict(batcher: DynamicBatcher, x: torch.Tensor) -> torch.Tensor:
    """The model's answer to a validated input; an input the model fails on, or answers with
    an overflow, is the request's fault (422), never a ``null`` logit nor a 500."""
    try:
        y = await batcher.infer(x)
    except InferenceFailed as exc:
        raise ProtocolError(422, str(exc)) from None
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ProtocolError(422, "the model's output for this input is not finite (overflow)")
    return y
