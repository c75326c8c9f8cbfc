"""One model replica: the Open Inference Protocol v2 REST API over a dynamic batcher.

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
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

import torch
from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram

from distml.net import create_app, read_body
from distml.serve.batching import MAX_BATCH_ROWS, BatchFailed, DynamicBatcher, InferenceFailed
from distml.serve.model import ServedModel
from distml.serve.protocol import (
    InferResponse,
    ModelMetadata,
    ProtocolError,
    decode_request,
    infer_body,
    metadata_of,
    to_output,
)

PLATFORM = "pytorch_safetensors"
VERSION = "1"
ModelName = Annotated[str, Path(max_length=256)]


def create_replica_app(
    served: ServedModel,
    token: str | Mapping[str, str],
    *,
    max_batch_size: int = 32,
    max_delay_ms: float = 2.0,
    max_body: int = 16 * 2**20,
    max_batch_rows: int = MAX_BATCH_ROWS,
) -> FastAPI:
    """The replica's app; a request of more than ``max_batch_rows`` rows is refused (413), and
    no forward pass takes more (``max_batch_size`` is the batch the batcher fills up to)."""

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
        yield
        await app.state.loops.stop()
        await batcher.close()

    app.router.lifespan_context = lifespan

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        requests.labels("rejected").inc()
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(BatchFailed)
    async def batch_failed(request: Request, exc: BatchFailed) -> JSONResponse:
        # 503: the replica's fault, not the request's; a router sends it to another replica.
        requests.labels("failed").inc()
        return JSONResponse({"error": str(exc)}, status_code=503)

    def check_name(name: str) -> None:
        if name != served.name:
            raise ProtocolError(404, f"unknown model {name!r}; this replica serves {served.name!r}")

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def server_ready() -> dict[str, bool]:
        await ready()
        return {"ready": True}

    @app.get("/v2/models/{name}")
    async def metadata(name: ModelName) -> ModelMetadata:
        check_name(name)
        return ModelMetadata(
            name=served.name,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[metadata_of(served.input)],
            outputs=[metadata_of(served.output)],
        )

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: ModelName) -> dict[str, Any]:
        check_name(name)
        await ready()
        return {"name": served.name, "ready": True}

    @app.post("/v2/models/{name}/infer", openapi_extra=infer_body(max_body))
    async def infer(name: ModelName, request: Request) -> InferResponse:
        check_name(name)
        body = await read_body(request, max_body)
        parsed, x = decode_request(body, served.input, max_batch_rows)
        wanted = [o.name for o in parsed.outputs or []]
        if any(o != served.output.name for o in wanted):
            raise ProtocolError(400, f"unknown output; the model gives {served.output.name!r}")
        start = time.perf_counter()
        y = await _predict(batcher, x)
        latency.observe(time.perf_counter() - start)
        requests.labels("ok").inc()
        return InferResponse(
            model_name=served.name,
            model_version=VERSION,
            id=parsed.id,
            outputs=[to_output(y, served.output)],
        )

    return app


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
