"""The parameter-server shard as a web service (the routes; the rules are in
:mod:`distml.ps.shard`).

Every route needs the bearer token. Workers identify themselves with ``worker=RANK``; tensors
travel as safetensors bodies; a push or an initialisation that does not fit the shard is answered
4xx and changes nothing. A push whose optimizer step fails is answered 503 and counted nowhere:
the client sends it again.

A worker's step is one exchange, ``POST /v1/step``: its gradient goes in, and the answer is the
parameters it trains on next, once the consistency rule lets it read them (a long poll: the
request waits on the shard, up to ``wait_s``). ``/v1/push`` and ``/v1/params`` are the same two
halves on their own. Under ASP and SSP the step may also claim the worker's next batch
(``claim_epoch``, ``claim_position``, ``claim_batches``, as ``/v1/claim`` takes them), once the
parameters are readable: the moment the worker would have asked, without a request of its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, HTTPException, Query, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Scope

from distml.net import bounded_json, create_app, decode_tensors, octet_stream_body
from distml.net.hot_path import Reply, add_hot_path
from distml.net.service import read_chunks
from distml.net.tensors import TensorPayloadError
from distml.ps.optimizer_spec import MAX_SPEC_BYTES
from distml.ps.shard import (
    ClaimRejected,
    NotInitialized,
    ParameterShard,
    PushRejected,
    StepFailed,
)
from distml.ps.snapshot import load_snapshot, save_snapshot

SAFETENSORS = "application/octet-stream"
Worker = Annotated[int, Query(ge=0, lt=100_000)]
Count = Annotated[int, Query(ge=0, le=2**62)]
Wait = Annotated[float, Query(gt=0, le=60, description="seconds a long poll may wait")]
Generation = Annotated[str, Query(max_length=64)]
Epoch = Annotated[int, Query(ge=0, le=2**31)]
Position = Annotated[int, Query(ge=0, le=2**40)]
Batches = Annotated[int, Query(ge=1, le=2**40)]
SPEC_DEPTH = 4  # {"groups": [{"betas": [...]}]}
STEP_ROUTE = re.compile(r"/v1/step")
log = logging.getLogger("distml.ps")


class StepQuery(BaseModel):
    """The query of ``POST /v1/step``, as FastAPI's route and the hot path both read it."""

    worker: Worker
    step: Count
    version: Count
    wait_s: Wait = 10.0
    generation: Generation = ""
    claim_epoch: Epoch | None = None
    claim_position: Position | None = None
    claim_batches: Batches | None = None


def step_query(match: re.Match[str], scope: Scope) -> StepQuery | None:
    """The step's query read as Starlette reads it; ``None`` (FastAPI answers, with its own
    422) when it does not validate."""
    text = scope["query_string"].decode("latin-1")
    try:
        return StepQuery.model_validate(dict(parse_qsl(text, keep_blank_values=True)))
    except ValidationError:
        return None


class _Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.pushes = Counter(
            "distml_ps_pushes", "Pushes by outcome", ["status"], registry=registry
        )
        self.version = Gauge("distml_ps_version", "Optimizer steps applied", registry=registry)
        self.apply = Histogram("distml_ps_apply_seconds", "Optimizer step time", registry=registry)
        self.bytes = Counter("distml_ps_bytes", "Payload bytes", ["direction"], registry=registry)


def create_shard_app(
    shard: ParameterShard,
    token: str,
    *,
    snapshot_path: Path | None = None,
    snapshot_every: int = 50,
    max_body_bytes: int = 256 * 2**20,
) -> FastAPI:
    """The ASGI app of one shard. With ``snapshot_path``, the shard restores from it at start
    and writes it every ``snapshot_every`` versions."""
    last_snapshot = {"version": 0}

    async def health() -> dict[str, Any]:
        async with shard.lock:  # what a pull does: read every parameter under the lock
            body = shard.encoded_params() if shard.initialized else b""
        return {"version": shard.version, "param_bytes": len(body)}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if snapshot_path is not None and snapshot_path.exists():
            load_snapshot(shard, snapshot_path)
            last_snapshot["version"] = shard.version
        interval = shard.settings.heartbeat_timeout_s / 4
        app.state.loops.start("liveness", shard.check_liveness, interval)
        yield
        await app.state.loops.stop()

    app = create_app("distml parameter server", token, health)
    app.router.lifespan_context = lifespan
    metrics = _Metrics(app.state.registry)

    async def write_snapshot() -> None:
        async with shard.lock:
            await asyncio.to_thread(save_snapshot, shard, snapshot_path)
            last_snapshot["version"] = shard.version

    async def snapshot_if_due(force: bool = False) -> None:
        """A snapshot when one is due; one that cannot be written is logged and tried again at
        the next push (the push it follows is applied all the same)."""
        if snapshot_path is None or not shard.initialized:
            return
        if force or shard.version - last_snapshot["version"] >= snapshot_every:
            try:
                await write_snapshot()
            except OSError:
                log.exception("cannot write the snapshot %s", snapshot_path)

    def tensors_of(body: bytearray) -> tuple[dict, dict[str, str], int]:
        try:
            tensors, meta = decode_tensors(body)  # views of the buffer: no copy
        except TensorPayloadError as exc:
            raise HTTPException(400, str(exc)) from None
        return tensors, meta, len(body)

    async def pushed(
        body: bytearray,
        worker: int,
        step: int,
        version: int,
        pull: tuple[float, str] | None = None,
    ) -> tuple[dict[str, Any], tuple[bytes, int, float] | None]:
        """The push of ``body`` (and, with ``pull=(wait_s, generation)``, the pull after it),
        with a push's errors as HTTP answers and its metrics counted."""
        grads, _, nbytes = tensors_of(body)
        try:
            if pull is None:
                answer, got = await shard.push(worker, step, version, grads, nbytes), None
            else:
                answer, got = await shard.push_pull(worker, step, version, grads, nbytes, *pull)
        except PushRejected as exc:
            metrics.pushes.labels("rejected").inc()
            raise HTTPException(400, str(exc)) from None
        except NotInitialized as exc:
            raise HTTPException(409, str(exc)) from None
        except StepFailed as exc:
            metrics.pushes.labels("failed").inc()
            raise HTTPException(503, str(exc)) from None
        metrics.pushes.labels(answer["status"]).inc()
        metrics.bytes.labels("pushed").inc(nbytes)
        metrics.version.set(shard.version)
        if shard.apply_s:
            metrics.apply.observe(shard.apply_s[-1])
        await snapshot_if_due()
        return answer, got

    def params_reply(got: tuple[bytes, int, float], headers: dict[str, str]) -> Reply:
        body, version, waited = got
        shard.bytes_pulled += len(body)
        metrics.bytes.labels("pulled").inc(len(body))
        headers |= {
            "X-Version": str(version),
            "X-Generation": shard.generation,
            "X-Wait-S": f"{waited:.6f}",
        }
        return Reply(200, body, SAFETENSORS, headers)

    @app.post("/v1/register")
    async def register(worker: Worker) -> dict[str, Any]:
        return await shard.register(worker)

    init_body = octet_stream_body(
        max_body_bytes,
        "the initial parameters, with the optimizer's JSON description as the "
        "metadata entry 'optimizer'",
    )

    @app.post("/v1/init", openapi_extra=init_body)
    async def initialize(request: Request, worker: Worker) -> dict[str, Any]:
        tensors, meta, _ = tensors_of(await read_buffer(request, max_body_bytes))
        try:
            text = meta.get("optimizer", "")
            spec = bounded_json(text, max_bytes=MAX_SPEC_BYTES, max_depth=SPEC_DEPTH)
            done = await shard.initialize(tensors, spec)
        except (ValueError, PushRejected) as exc:
            raise HTTPException(400, f"bad initialisation: {exc}") from None
        if done:
            await snapshot_if_due(force=True)
        return {**shard.status(), "accepted": done}

    push_body = octet_stream_body(max_body_bytes, "the gradients of the shard's parameters")

    @app.post("/v1/push", openapi_extra=push_body)
    async def push(request: Request, worker: Worker, step: Count, version: Count) -> dict[str, Any]:
        answer, _ = await pushed(await read_buffer(request, max_body_bytes), worker, step, version)
        return {**answer, "generation": shard.generation}

    step_body = octet_stream_body(
        max_body_bytes, "the gradients of the shard's parameters; the answer is the parameters"
    )

    async def exchange(query: StepQuery, body: bytearray) -> Reply:
        """A push, answered with the parameters to read next (safetensors, 200) once the rule
        lets the worker read them; 202 with the push's answer (JSON) if it could not read
        within ``wait_s``: the push counted, and ``GET /v1/params`` reads on. With a claim, its
        batch is the header ``X-Claim`` (``none`` once the epoch is used up); a claim this shard
        refuses is left out, for ``/v1/claim`` to answer. A refusal comes as FastAPI's."""
        q = query
        claim = (q.claim_epoch, q.claim_position, q.claim_batches)
        if any(v is not None for v in claim) and None in claim:
            needs = "a claim needs claim_epoch, claim_position and claim_batches"
            return Reply.error(422, needs, "detail")
        try:
            answer, got = await pushed(body, q.worker, q.step, q.version, (q.wait_s, q.generation))
        except HTTPException as exc:
            return Reply.error(exc.status_code, str(exc.detail), "detail")
        headers = {"X-Status": answer["status"], "X-Read-Version": str(answer["read_version"])}
        if got is None:
            return Reply.json(202, {**answer, "generation": shard.generation}, **headers)
        if q.claim_epoch is not None and shard.settings.consistency != "bsp":
            try:
                batch = await shard.claim(q.worker, *claim)
                headers["X-Claim"] = "none" if batch is None else str(batch)
            except ClaimRejected:
                pass
        return params_reply(got, headers)

    async def step_hot(query: StepQuery, chunks: list[bytes], headers: Headers) -> Reply:
        return await exchange(query, bytearray().join(chunks))

    # Every worker's every step: answered ahead of FastAPI (distml.net.hot_path).
    add_hot_path(
        app,
        route=STEP_ROUTE,
        accept=step_query,
        answer=step_hot,
        max_body=max_body_bytes,
        refusal_key="detail",
    )

    @app.post("/v1/step", openapi_extra=step_body)
    async def push_pull(request: Request, query: Annotated[StepQuery, Query()]) -> Response:
        return (await exchange(query, await read_buffer(request, max_body_bytes))).response()

    @app.get("/v1/params")
    async def params(
        worker: Worker, min_version: Count = 0, wait_s: Wait = 10.0, generation: Generation = ""
    ) -> Response:
        got = await shard.pull(worker, min_version, wait_s, generation)
        if got is None:
            raise HTTPException(425, "not readable yet under the consistency rule; ask again")
        return params_reply(got, {}).response()

    @app.post("/v1/claim")
    async def claim(
        worker: Worker, epoch: Epoch, position: Position, batches: Batches
    ) -> dict[str, Any]:
        """The next training batch of ``epoch`` for ``worker`` (ASP and SSP)."""
        if shard.settings.consistency == "bsp":
            raise HTTPException(409, "BSP workers keep fixed shards of the data; nothing to claim")
        try:
            return {"batch": await shard.claim(worker, epoch, position, batches)}
        except ClaimRejected as exc:
            raise HTTPException(409, str(exc)) from None

    @app.get("/v1/state")
    async def state() -> Response:
        """The parameters now, for an observer that is not a worker (the final export)."""
        if not shard.initialized:
            raise HTTPException(409, "the shard has no parameters yet")
        body, version = await shard.read()
        return Response(body, media_type=SAFETENSORS, headers={"X-Version": str(version)})

    @app.post("/v1/heartbeat")
    async def heartbeat(worker: Worker) -> dict[str, Any]:
        await shard.heartbeat(worker)
        return {"generation": shard.generation, "version": shard.version}

    @app.post("/v1/done")
    async def done(worker: Worker) -> dict[str, Any]:
        try:
            await shard.done(worker)
        except StepFailed as exc:  # the worker is done; the step it completed is tried again
            raise HTTPException(503, str(exc)) from None
        return shard.status()

    @app.post("/v1/snapshot")
    async def snapshot() -> dict[str, Any]:
        if snapshot_path is None:
            raise HTTPException(409, "this shard was started without a snapshot path")
        if not shard.initialized:
            raise HTTPException(409, "the shard has no parameters yet: nothing to snapshot")
        try:
            await write_snapshot()
        except OSError as exc:
            log.exception("cannot write the snapshot %s", snapshot_path)
            raise HTTPException(503, f"cannot write the snapshot: {exc.strerror}") from None
        return {"path": str(snapshot_path), "version": last_snapshot["version"]}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return shard.status()

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return shard.stats()

    return app


async def read_buffer(request: Request, limit: int) -> bytearray:
    """The request body in a ``bytearray`` (that :func:`decode_tensors` views in place), with
    :func:`distml.net.read_body`'s limits."""
    return bytearray().join(await read_chunks(request, limit))
