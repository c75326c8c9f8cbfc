"""The federated server as a web service (the rounds themselves are in
:mod:`distml.federated.server`).

Each client has its own bearer token; the token says who is calling, so a client cannot answer
for another. Models and updates travel as safetensors bodies; an update that does not fit the
model, the round or the norm bound is answered 4xx and changes nothing.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Query, Request
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.responses import Response

from distml.federated.server import FederatedServer, UpdateRejected
from distml.net import (
    bounded_json,
    create_app,
    decode_tensors,
    encode_tensors,
    finite_float,
    octet_stream_body,
    read_body,
)
from distml.net.tensors import TensorPayloadError

SAFETENSORS = "application/octet-stream"
MessageStage = Literal["advertise", "share_keys", "masked_input", "unmask"]
ViewStage = Literal["share_keys", "masked_input", "unmask"]
# A client's example count weighs its update: bounded, so that no count overflows a float or
# swamps the weighted mean beyond what a real dataset could.
MAX_EXAMPLES = 10**9
MAX_METRICS = 16
MAX_METRIC_NAME = 64
METRICS_BYTES = 4096
EVALUATION = ("loss", "accuracy")
# Each secure-aggregation message holds at most a few base64 strings per client of the round.
SECAGG_BYTES_PER_CLIENT = 256


def _identity(request: Request) -> str:
    identity = request.state.identity
    if identity is None:
        raise HTTPException(403, "this route needs a client's own token")
    return identity


def _metrics_of(meta: dict[str, str]) -> tuple[int, dict[str, float]]:
    """The example count and the metrics of an update's metadata, or 4xx: a count in
    [1, MAX_EXAMPLES], metrics a flat, small JSON object of finite numbers, and a client's
    evaluation (``loss`` with ``accuracy``) whole or absent."""
    try:
        num_examples = _num_examples(meta.get("num_examples"))
        metrics = _metrics(meta.get("metrics", "{}"))
    except ValueError as exc:
        raise HTTPException(422, f"update metadata: {exc}") from None
    return num_examples, metrics


def _num_examples(text: str | None) -> int:
    if text is None:
        raise ValueError("num_examples is missing")
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_EXAMPLES)):
        raise ValueError(f"num_examples must be an integer of at most {MAX_EXAMPLES}: {text!r:.40}")
    number = int(text)
    if not 1 <= number <= MAX_EXAMPLES:
        raise ValueError(f"num_examples must be >= 1 and <= {MAX_EXAMPLES}, got {number}")
    return number


def _metrics(text: str) -> dict[str, float]:
    raw = bounded_json(text, max_bytes=METRICS_BYTES, max_depth=1)
    if not isinstance(raw, dict) or len(raw) > MAX_METRICS:
        raise ValueError(f"metrics must be a JSON object of at most {MAX_METRICS} numbers")
    metrics = {}
    for name, value in raw.items():
        if not name or len(name) > MAX_METRIC_NAME:
            raise ValueError(f"a metric name must have 1 to {MAX_METRIC_NAME} characters")
        metrics[name] = finite_float(value, f"metric {name[:MAX_METRIC_NAME]!r}")
    present = [key for key in EVALUATION if key in metrics]
    if present and len(present) != len(EVALUATION):
        raise ValueError(f"an evaluation needs both {EVALUATION}, got only {present}")
    if present and not (metrics["loss"] >= 0 and 0 <= metrics["accuracy"] <= 1):
        raise ValueError("an evaluation needs loss >= 0 and accuracy in [0, 1]")
    return metrics


def _secagg_payload(stage: str, body: bytes, clients: int) -> Any:
    """A secure-aggregation message as the protocol reads it: the ring values of the masked
    input, or bounded JSON."""
    if stage == "masked_input":
        tensors, _ = decode_tensors(body)
        if set(tensors) != {"masked"} or tensors["masked"].dtype != torch.int32:
            raise ValueError("expected one int32 tensor 'masked'")
        return tensors["masked"].to(torch.int64) % 2**32  # the ring's values again
    limit = 1024 + SECAGG_BYTES_PER_CLIENT * clients
    return bounded_json(body, max_bytes=limit, max_depth=3)


def create_fl_app(
    server: FederatedServer, tokens: dict[str, str], *, max_body_bytes: int = 64 * 2**20
) -> FastAPI:
    """The ASGI app of ``server``; ``tokens`` maps each client's name to its token."""
    registry = CollectorRegistry()
    updates = Counter("distml_fl_updates", "Updates by outcome", ["status"], registry=registry)
    rounds = Gauge("distml_fl_rounds_completed", "Rounds aggregated", registry=registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loops.start("rounds", server.step)
        yield
        await app.state.loops.stop()

    def health() -> dict[str, Any]:
        rounds.set(server.completed)
        return server.status()

    app = create_app("distml federated server", tokens, health, registry)
    app.router.lifespan_context = lifespan

    @app.post("/v1/register")
    async def register(request: Request) -> dict[str, Any]:
        client = _identity(request)
        await server.seen(client)
        return server.status() | {"client": client, "model": server.config.model}

    @app.post("/v1/leave")
    async def leave(request: Request) -> dict[str, Any]:
        """The calling client goes away: the open round stops waiting for it."""
        await server.leave(_identity(request))
        return server.status()

    @app.get("/v1/status")
    async def status(
        after: Annotated[int, Query(ge=-1)] = -1,
        seen_attempt: Annotated[int, Query(ge=0)] = 0,
        wait: Annotated[float, Query(ge=0, le=60)] = 0.0,
        generation: Annotated[str, Query(max_length=16)] = "",
    ) -> dict[str, Any]:
        """With ``wait``, answers once a round opens (other than ``seen_attempt``) or completes
        (past ``after``), or after ``wait`` seconds."""
        if wait:
            await server.wait_for_change(after, seen_attempt, wait, generation)
        return server.status()

    @app.get("/v1/task")
    async def task(request: Request) -> Response:
        client = _identity(request)
        await server.seen(client)
        assignment = server.task_for(client)
        if assignment is None:
            return Response(status_code=204)
        return Response(json.dumps(assignment), media_type="application/json")

    @app.get("/v1/model")
    async def model() -> Response:
        body = server.model_body(encode_tensors)
        return Response(body, media_type=SAFETENSORS)

    @app.post("/v1/update", openapi_extra=octet_stream_body(max_body_bytes, "an update"))
    async def update(request: Request, round: Annotated[int, Query(ge=1)]) -> dict[str, Any]:  # noqa: A002  (the protocol's word)
        client = _identity(request)
        body = await read_body(request, max_body_bytes)
        try:
            delta, meta = decode_tensors(body)
        except TensorPayloadError as exc:
            updates.labels("invalid").inc()
            raise HTTPException(400, str(exc)) from None
        num_examples, metrics = _metrics_of(meta)
        try:
            await server.submit(client, round, delta, num_examples, metrics, len(body))
        except UpdateRejected as exc:
            updates.labels("late" if exc.status == 409 else "refused").inc()
            raise HTTPException(exc.status, str(exc)) from None
        updates.labels("accepted").inc()
        return {"status": "accepted", "round": round}

    message_body = octet_stream_body(
        max_body_bytes, "a secure-aggregation message (JSON, or safetensors for masked_input)"
    )

    @app.post("/v1/secagg/{stage}", openapi_extra=message_body)
    async def secagg_message(
        request: Request, stage: MessageStage, round: Annotated[int, Query(ge=1)]
    ) -> dict[str, Any]:
        """A secure-aggregation message: JSON, or for the masked input a safetensors body with
        the tensor ``masked``."""
        client = _identity(request)
        body = await read_body(request, max_body_bytes)
        try:
            payload = _secagg_payload(stage, body, server.round_size())
        except (TensorPayloadError, ValueError) as exc:
            raise HTTPException(400, f"{stage}: not a valid message ({exc})") from None
        try:
            await server.secure_receive(client, round, stage, payload, len(body))
        except UpdateRejected as exc:
            raise HTTPException(exc.status, str(exc)) from None
        return {"status": "accepted", "stage": stage}

    @app.get("/v1/secagg/{stage}")
    async def secagg_view(
        request: Request,
        stage: ViewStage,
        round: Annotated[int, Query(ge=1)],
        wait: Annotated[float, Query(ge=0, le=60)] = 20.0,
    ) -> Any:
        """What a client needs for ``stage`` once the stage before has closed; 425 until then."""
        client = _identity(request)
        try:
            view = await server.secure_view(client, round, stage, wait)
        except UpdateRejected as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if view is None:
            raise HTTPException(425, f"{stage}: the stage before is still open")
        return view

    @app.get("/v1/history")
    async def history() -> dict[str, Any]:
        return {"history": server.history, "summary": server.summary()}

    return app
