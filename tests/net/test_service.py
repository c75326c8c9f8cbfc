"""The shared service plumbing: background loops that cannot leave a service half-alive, bodies
declared in OpenAPI, and the parsing of what a peer sends."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import time
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from distml.launch.children import ChildProcess, stop_all
from distml.net import LoopStopped, bounded_json, create_app, finite_float, octet_stream_body
from distml.net.ports import listening_socket

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def app_with_loop(step) -> FastAPI:
    app = create_app("loops", TOKEN, health=lambda: {})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loops.start("work", step)
        yield
        await app.state.loops.stop()

    app.router.lifespan_context = lifespan
    return app


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_failing_step_is_logged_and_the_loop_goes_on(caplog):
    calls: list[int] = []

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise KeyError("loss")
        await asyncio.sleep(0.001)

    app = app_with_loop(step)
    with TestClient(app, headers=AUTH) as client:
        wait_for(lambda: len(calls) >= 5)
        assert client.get("/healthz").status_code == 200
        assert app.state.loops.errors == {"work": 1}
    assert "KeyError: 'loss'" in caplog.text


def test_a_loop_that_stops_makes_the_service_unhealthy():
    async def step() -> None:
        raise LoopStopped("the rounds cannot go on")

    app = app_with_loop(step)
    with TestClient(app, headers=AUTH) as client:
        wait_for(lambda: client.get("/healthz").status_code != 200)
        answer = client.get("/healthz")
        assert answer.status_code == 503
        assert "work" in answer.json()["detail"] and "cannot go on" in answer.json()["detail"]


def test_a_raw_body_is_declared_in_the_openapi_document():
    app = create_app("bodies", TOKEN, health=lambda: {})

    @app.post("/v1/push", openapi_extra=octet_stream_body(1024))
    async def push() -> dict:
        return {}

    with TestClient(app, headers=AUTH) as client:
        body = client.get("/openapi.json").json()["paths"]["/v1/push"]["post"]["requestBody"]
    schema = body["content"]["application/octet-stream"]["schema"]
    assert body["required"] and schema == {"type": "string", "format": "binary", "maxLength": 1024}


@pytest.mark.parametrize(
    "text",
    ["[" * 40 + "]" * 40, '{"a": NaN}', '{"a": Infinity}', "{", "x" * 70_000, b"\xff\xfe"],
)
def test_bounded_json_refuses_what_a_peer_should_not_send(text):
    with pytest.raises(ValueError):
        bounded_json(text)


def test_bounded_json_refuses_nesting_past_pythons_own_recursion_limit():
    with pytest.raises(ValueError, match="nested deeper"):
        bounded_json("[" * 100_000 + "]" * 100_000, max_bytes=10**6)


def test_bounded_json_reads_plain_json():
    assert bounded_json('{"loss": 0.5, "tags": ["a", {"b": 1}]}') == {
        "loss": 0.5,
        "tags": ["a", {"b": 1}],
    }


@pytest.mark.parametrize("value", [10**401, float("nan"), float("inf"), True, "1.0", None, [1]])
def test_finite_float_refuses_what_is_no_finite_number(value):
    with pytest.raises(ValueError):
        finite_float(value, "loss")


def test_finite_float_takes_ints_and_floats():
    assert finite_float(3, "n") == 3.0 and finite_float(-2.5, "n") == -2.5


@pytest.mark.distributed
def test_a_service_started_by_distml_serves_on_the_port_it_was_handed(tmp_path):
    """The port is bound from the moment it is chosen: nothing else can take it before the
    service serves, and the service never binds ``--port`` itself (port 1 would fail)."""
    listen = listening_socket()
    port = listen.getsockname()[1]
    with socket.socket() as rival, pytest.raises(OSError) as taken:
        rival.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    shard = ChildProcess(tmp_path / "shard.log", listen=[listen])
    argv = [sys.executable, "-m", "distml", "ps", "serve", "--port", "1"]
    shard.start(argv, {**os.environ, "DISTML_TOKEN": "t" * 32})
    assert listen.fileno() == -1  # handed over: the child owns the port now
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        wait_for(lambda: _answers(url) or shard.poll() is not None, 120)
        assert shard.poll() is None, shard.log_tail()
    finally:
        stop_all([shard], 10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, headers={"Authorization": "Bearer " + "t" * 32}).status_code == 200
    except httpx.TransportError:
        return False
