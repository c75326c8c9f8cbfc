"""One model replica: the Open Inference Protocol v2 REST API over a dynamic batcher.

Every route needs the bearer token; every request body is validated (pydantic, then the model's
signature) before it reaches the queue, so a malformed request gets a 4xx and changes nothing.
Readiness (``/v2/health/ready``, ``/v2/models/{name}/ready``, ``/healthz``) runs a real
one-row inference through the same queue as the traffic.

>>> app = create_replica_app(load_served_model("runs/digits", "digits-cnn"), token)
... # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from distml.net import create_app, read_body
from distml.serve.batching import DynamicBatcher
from distml.serve.model import ServedModel
from distml.serve.protocol import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    ProtocolError,
    metadata_of,
    to_output,
    to_tensor,
)

PLATFORM = "pytorch_safetensors"
VERSION = "1"


def create_replica_app(
    served: ServedModel,
    token: str | Mapping[str, str],
    *,
    max_batch_size: int = 32,
    max_delay_ms: float = 2.0,
    max_body: int = 16 * 2**20,
) -> FastAPI:
    async def ready() -> dict[str, Any]:
        await batcher.infer(served.example())
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
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        registry=registry,
    )
    batcher = DynamicBatcher(
        served.predict, max_batch_size, max_delay_ms / 1000, on_batch=batch_rows.observe
    )
    app.state.batcher = batcher

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        requests.labels("rejected").inc()
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

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
    async def metadata(name: str) -> ModelMetadata:
        check_name(name)
        return ModelMetadata(
            name=served.name,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[metadata_of(served.input)],
            outputs=[metadata_of(served.output)],
        )

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> dict[str, Any]:
        check_name(name)
        await ready()
        return {"name": served.name, "ready": True}

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> InferResponse:
        check_name(name)
        body = await read_body(request, max_body)
        try:
            parsed = InferRequest.model_validate_json(body)
        except ValidationError as exc:
            raise ProtocolError(400, f"not an inference request: {_first_error(exc)}") from None
        wanted = [o.name for o in parsed.outputs or []]
        if any(o != served.output.name for o in wanted):
            raise ProtocolError(400, f"unknown output; the model gives {served.output.name!r}")
        x = to_tensor(parsed.inputs[0], served.input)
        start = time.perf_counter()
        y = await batcher.infer(x)
        latency.observe(time.perf_counter() - start)
        requests.labels("ok").inc()
        return InferResponse(
            model_name=served.name,
            model_version=VERSION,
            id=parsed.id,
            outputs=[to_output(y, served.output)],
        )

    return app


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
