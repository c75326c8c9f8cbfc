"""Serving: replica processes behind the router, over loopback. A replica killed under load
loses no request and comes back; batched answers equal the model run here on each input alone;
malformed and unauthenticated requests are refused and leave the replicas up."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI
from starlette.testclient import TestClient

from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.net import TOKEN_ENV, BackgroundServer
from distml.serve import batching
from distml.serve.batching import DynamicBatcher
from distml.serve.model import load_served_model
from distml.serve.policy import PowerOfTwoChoices, ReplicaState
from distml.serve.replica import create_replica_app
from distml.serve.router import Draining, Router
from distml.serve.router_app import create_router_app

TOKEN = "serving-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = "/v2/models/digits-cnn/infer"
ROWS = 64  # the replicas' --max-batch-rows


@pytest.fixture(scope="module")
def oracle(digits_cnn_checkpoint):
    return load_served_model(digits_cnn_checkpoint, "digits-cnn").predict


@pytest.fixture(scope="module")
def deployment(digits_cnn_checkpoint, tmp_path_factory):
    """Two replica processes and the router in this process, as ``distml serve`` runs them."""
    os.environ[TOKEN_ENV] = TOKEN
    command = ReplicaCommand(
        str(digits_cnn_checkpoint),
        "digits-cnn",
        max_batch_size=16,
        max_delay_ms=2,
        max_batch_rows=ROWS,
    )
    logs = tmp_path_factory.mktemp("logs")
    with ReplicaSet(command, 2, TOKEN, log_dir=logs) as replicas:
        replicas.wait_ready(120)
        router = Router(replicas.urls, TOKEN, health_interval_s=0.2)
        with BackgroundServer(create_router_app(router, TOKEN)) as server:
            yield replicas, router, server.url


def body(x: torch.Tensor, **extra) -> dict:
    item = {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten()}
    item["data"] = item["data"].tolist()
    return {"inputs": [{**item, **extra}]}


def logits(response: httpx.Response) -> torch.Tensor:
    out = response.json()["outputs"][0]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


async def _load(url: str, inputs: list[torch.Tensor], concurrency: int, on_done=None):
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(inputs)):
        queue.put_nowait(i)
    results: dict[int, httpx.Response | Exception] = {}

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            try:
                results[i] = await http.post(INFER, json={**body(inputs[i]), "id": str(i)})
            except httpx.HTTPError as exc:
                results[i] = exc
            if on_done is not None:
                on_done(len(results))

    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return [results[i] for i in range(len(inputs))]


@pytest.mark.distributed
def test_batched_answers_equal_one_by_one(deployment, oracle):
    _, _, url = deployment
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1 + i % 3, 1, 8, 8, generator=gen) for i in range(96)]
    responses = asyncio.run(_load(url, inputs, concurrency=16))
    for i, (x, r) in enumerate(zip(inputs, responses, strict=True)):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == str(i)
        torch.testing.assert_close(logits(r), oracle(x))


def test_batcher_runs_queued_requests_together(oracle):
    sizes: list[int] = []
    batcher = DynamicBatcher(oracle, max_batch_size=8, max_delay_s=0.05, on_batch=sizes.append)
    xs = [torch.randn(n, 1, 8, 8) for n in (1, 2, 3, 1, 4)]

    async def main():
        out = await asyncio.gather(*(batcher.infer(x) for x in xs))
        await batcher.close()
        return out

    for x, y in zip(xs, asyncio.run(main()), strict=True):
        torch.testing.assert_close(y, oracle(x))
    assert sizes == [7, 4]  # 1+2+3+1 fill 7 of 8; the 4-row request starts the next batch


@pytest.mark.parametrize("slow", [False, True])
def test_a_short_forward_pass_runs_on_the_event_loop_a_long_one_in_the_worker(
    oracle, slow, monkeypatch
):
    """The first batch, of unknown cost, runs in the worker thread; after it, a model faster
    than :data:`INLINE_FORWARD_S` runs on the event loop, and a slower one stays in the
    thread, so that the loop goes on taking requests while it computes. (The threshold is set
    far from the model's time, so that a busy machine cannot move the model across it.)"""
    monkeypatch.setattr(batching, "INLINE_FORWARD_S", 1e-9 if slow else 60.0)
    threads: list[int] = []

    def predict(x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.get_ident())
        return oracle(x)

    batcher = DynamicBatcher(predict, max_batch_size=1)
    xs = [torch.randn(1, 1, 8, 8) for _ in range(3)]

    async def main() -> tuple[int, list[torch.Tensor]]:
        out = [await batcher.infer(x) for x in xs]
        await batcher.close()
        return threading.get_ident(), out

    loop_thread, out = asyncio.run(main())
    for x, y in zip(xs, out, strict=True):
        torch.testing.assert_close(y, oracle(x))
    assert threads[0] != loop_thread
    if slow:
        assert loop_thread not in threads
    else:
        assert threads[1:] == [loop_thread, loop_thread]


@pytest.mark.distributed
def test_replica_killed_under_load_loses_no_request(deployment, oracle):
    replicas, router, url = deployment
    victim = replicas.processes[0]
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(1, 1, 8, 8, generator=gen) for _ in range(1000)]

    def kill_once(done: int) -> None:
        if done == 150 and victim.restarts == 0:
            os.kill(victim.popen.pid, signal.SIGKILL)

    responses = asyncio.run(_load(url, inputs, concurrency=16, on_done=kill_once))
    failed = [r for r in responses if not isinstance(r, httpx.Response) or r.status_code != 200]
    assert not failed, failed[:3]
    for x, r in zip(inputs[::50], responses[::50], strict=True):
        torch.testing.assert_close(logits(r), oracle(x))
    deadline = time.monotonic() + 60
    while not (victim.restarts == 1 and all(r.healthy for r in router.replicas)):
        assert time.monotonic() < deadline, victim.log_tail()
        time.sleep(0.2)
    assert victim.exits == [-signal.SIGKILL]
    assert httpx.post(url + INFER, json=body(inputs[0]), headers=AUTH).status_code == 200


BAD = [
    (
        "wrong shape",
        {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]},
        400,
    ),  # noqa: E501
    ("wrong dtype", body(torch.zeros(1, 1, 8, 8), datatype="INT64"), 400),
    ("wrong name", body(torch.zeros(1, 1, 8, 8), name="x"), 400),
    ("too few values", body(torch.zeros(1, 1, 8, 8), shape=[2, 1, 8, 8]), 400),
    ("not numbers", body(torch.zeros(1, 1, 8, 8), data=["a"] * 64), 400),
    ("no inputs", {"inputs": []}, 400),
    ("extra field", {**body(torch.zeros(1, 1, 8, 8)), "evil": 1}, 400),
]


@pytest.mark.distributed
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_malformed_requests_get_4xx(deployment, case):
    replicas, _, url = deployment
    _, payload, status = case
    r = httpx.post(url + INFER, json=payload, headers=AUTH)
    assert r.status_code == status, r.text
    assert "error" in r.json()


@pytest.mark.distributed
def test_nonfinite_unknown_model_and_junk(deployment):
    replicas, _, url = deployment
    data = ",".join(["0.5"] * 63)
    for bad in ("NaN", "Infinity", "1e999"):
        raw = f'{{"inputs":[{{"name":"input","shape":[1,1,8,8],"datatype":"FP32","data":[{bad},{data}]}}]}}'  # noqa: E501
        r = httpx.post(url + INFER, content=raw, headers=AUTH)
        assert r.status_code == 400, (bad, r.text)
    assert httpx.post(url + INFER, content=b"{not json", headers=AUTH).status_code == 400
    other = "/v2/models/resnet/infer"
    assert (
        httpx.post(url + other, json=body(torch.zeros(1, 1, 8, 8)), headers=AUTH).status_code == 404
    )
    assert httpx.get(url + "/v2/models/resnet", headers=AUTH).status_code == 404
    assert all(p.popen.poll() is None for p in replicas.processes)
    assert httpx.get(url + "/v2/health/ready", headers=AUTH).status_code == 200


@pytest.mark.distributed
def test_numbers_outside_fp32_and_too_many_rows_are_refused_once(deployment):
    """A 401-digit integer, 1e39 (finite, but no FP32 value) and more rows than
    ``--max-batch-rows`` are the client's fault: 4xx, answered by one replica, never retried on
    another, no replica taken out of rotation."""
    replicas, router, url = deployment

    def retries() -> float:
        text = httpx.get(url + "/metrics", headers=AUTH).text
        line = next(x for x in text.splitlines() if x.startswith("distml_router_retries_total"))
        return float(line.split()[-1])

    before = retries()
    rest = ",".join(["0.5"] * 63)
    for first, rows, status in (("9" * 401, 1, 400), ("1e39", 1, 400), ("0.5", ROWS + 1, 413)):
        data = ",".join([first, rest] + [rest + ",0.5"] * (rows - 1))
        raw = f'{{"inputs":[{{"name":"input","shape":[{rows},1,8,8],"datatype":"FP32","data":[{data}]}}]}}'  # noqa: E501
        r = httpx.post(url + INFER, content=raw, headers=AUTH)
        assert r.status_code == status, (first[:6], rows, r.text)
        assert "error" in r.json()
    assert f"limit of {ROWS} rows" in r.json()["error"]
    assert retries() == before
    assert all(r.healthy and r.failures == 0 for r in router.replicas)
    assert all(p.popen.poll() is None for p in replicas.processes)


def test_oversized_body_gets_413(digits_cnn_checkpoint):
    app = create_replica_app(
        load_served_model(digits_cnn_checkpoint, "digits-cnn"), TOKEN, max_body=1024
    )
    with TestClient(app) as client:
        r = client.post(INFER, json=body(torch.zeros(4, 1, 8, 8)), headers=AUTH)
        assert r.status_code == 413
        assert client.get("/v2/health/ready", headers=AUTH).status_code == 200


@pytest.mark.distributed
def test_metadata_and_metrics(deployment):
    replicas, _, url = deployment
    meta = httpx.get(url + "/v2/models/digits-cnn", headers=AUTH).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"][0]["name"] == "logits"
    assert httpx.get(url + "/v2/models/digits-cnn/ready", headers=AUTH).json()["ready"]
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert 'distml_router_requests_total{outcome="ok"}' in metrics
    assert "distml_router_latency_seconds_bucket" in metrics
    assert f'distml_router_in_flight{{replica="{replicas.urls[0]}"}}' in metrics


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/models/digits-cnn", INFER, "/metrics"])
def test_unauthenticated_requests_get_401(deployment, path):
    replicas, _, url = deployment
    for base in (url, replicas.urls[1]):
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            method = httpx.post if path == INFER else httpx.get
            kwargs = {"json": body(torch.zeros(1, 1, 8, 8))} if path == INFER else {}
            assert method(base + path, headers=headers, **kwargs).status_code == 401


def test_power_of_two_choices_picks_the_less_loaded():
    idle, busy = ReplicaState("http://idle"), ReplicaState("http://busy", in_flight=5)
    policy = PowerOfTwoChoices(random.Random(0))
    assert all(policy.choose([busy, idle]) is idle for _ in range(100))
    three = [ReplicaState(f"http://{i}", in_flight=i) for i in range(3)]
    picks = [policy.choose(three).url for _ in range(300)]
    # The most loaded is never the lesser of a pair; the other two share the rest.
    assert "http://2" not in picks and picks.count("http://0") > picks.count("http://1") > 0


def test_drain_finishes_in_flight_and_refuses_new():
    slow = FastAPI()

    @slow.post("/v2/models/m/infer")
    async def infer() -> dict:
        await asyncio.sleep(0.5)
        return {"ok": True}

    @slow.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    with BackgroundServer(slow) as server:
        router = Router([server.url], TOKEN)

        async def main():
            first = asyncio.create_task(router.forward("POST", "/v2/models/m/infer"))
            await asyncio.sleep(0.1)
            drained = asyncio.create_task(router.drain())
            await asyncio.sleep(0)
            with pytest.raises(Draining):
                await router.forward("POST", "/v2/models/m/infer")
            assert not drained.done()
            await drained
            return await first

        assert asyncio.run(main()).status == 200
