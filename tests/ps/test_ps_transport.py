"""The worker's transport: one exchange a step (``POST /v1/step``: the push, answered with the
parameters once the rule allows, and the next claimed batch), its long poll, and the lean
client it runs on (``KeepAliveClient``), against a real shard on loopback."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import uvicorn
from shard_helpers import INIT, TOKEN, client_for, push, spec, state

from distml.net import BackgroundServer, ServiceError, decode_tensors, encode_tensors
from distml.net.client import KeepAliveClient
from distml.net.ports import listening_socket
from distml.net.tensors import tensor_parts
from distml.ps.app import create_shard_app
from distml.ps.shard import ParameterShard, ShardSettings
from distml.ps.worker import LONG_POLL_S


def step(client, worker, step, grads=None, version=0, headers=None, **query):
    grads = grads if grads is not None else {n: torch.ones_like(t) for n, t in INIT.items()}
    body = encode_tensors(grads) if isinstance(grads, dict) else grads
    params = {"worker": worker, "step": step, "version": version, "wait_s": 0.2, **query}
    return client.post("/v1/step", params=params, content=body, headers=headers)


def test_an_asynchronous_step_answers_the_parameters_it_made():
    client = client_for(consistency="asp")
    answer = step(client, 0, 0)
    assert answer.status_code == 200
    assert answer.headers["X-Status"] == "applied" and answer.headers["X-Version"] == "1"
    got = decode_tensors(answer.content)[0]
    assert torch.allclose(got["w"], INIT["w"] - 0.5) and torch.equal(got["w"], state(client)["w"])
    again = step(client, 0, 0)  # a retried step: the push is not applied twice
    assert again.headers["X-Status"] == "duplicate" and client.shard.version == 1
    assert torch.equal(decode_tensors(again.content)[0]["w"], got["w"])


@pytest.mark.parametrize("route", [push, step])
@pytest.mark.parametrize(
    "grads, status",
    [
        ({"w": torch.ones(3, 2)}, 400),  # a parameter missing
        ({"w": torch.full((3, 2), float("nan")), "b": torch.ones(2)}, 400),
        ({"w": torch.ones(3, 2, dtype=torch.float64), "b": torch.ones(2)}, 400),
        (b"not safetensors at all", 400),
        ({"w": torch.ones(3, 2), "b": torch.ones(2000)}, 413),  # over the 4 KiB limit
    ],
)
def test_a_bad_step_is_refused_like_a_bad_push_and_changes_nothing(route, grads, status):
    client = client_for(consistency="asp")
    before = state(client)
    answer = route(client, 0, 0, grads)
    # The step is answered ahead of FastAPI (distml.net.hot_path): its refusals in FastAPI's shape.
    assert answer.status_code == status and isinstance(answer.json()["detail"], str)
    after = state(client)
    assert all(torch.equal(before[n], after[n]) for n in INIT) and client.shard.version == 0
    assert client.get("/v1/stats").json()["pushes"] == {}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token-xxxxxxxx"}):
        refused = step(client, 0, 0, headers=headers)
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
    out_of_range = step(client, 0, 0, wait_s=61)  # FastAPI's own validation answers it
    assert out_of_range.status_code == 422
    assert out_of_range.json()["detail"][0]["loc"] == ["query", "wait_s"]
    assert step(client, 0, 0).status_code == 200  # the shard still works


def test_a_bsp_step_waits_for_the_barrier_then_answers_the_new_version():
    client = client_for(consistency="bsp", workers=2)
    for w in (0, 1):
        client.post("/v1/register", params={"worker": w})
    first = step(client, 0, 0, {n: torch.full_like(t, 2.0) for n, t in INIT.items()})
    # Worker 1 has not pushed: the push counted, the parameters are not readable yet.
    assert first.status_code == 202 and first.json()["status"] == "accepted"
    assert first.headers["X-Read-Version"] == "1" and client.shard.version == 0
    second = step(client, 1, 0, {n: torch.zeros_like(t) for n, t in INIT.items()})
    assert second.status_code == 200 and second.headers["X-Version"] == "1"
    expected = INIT["w"] - 0.5 * 1.0  # the mean of 2 and 0, at lr 0.5
    assert torch.allclose(decode_tensors(second.content)[0]["w"], expected)
    # Worker 0 reads the same version with GET /v1/params, as its 202 told it to.
    read = client.get("/v1/params", params={"worker": 0, "min_version": 1, "wait_s": 0.2})
    assert read.status_code == 200 and read.content == second.content


def test_a_waiting_reader_is_answered_when_the_barrier_completes_not_when_its_poll_ends():
    shard = ParameterShard(ShardSettings(consistency="bsp", workers=2))
    app = create_shard_app(shard, TOKEN)
    with BackgroundServer(app) as server:
        clients = [KeepAliveClient(server.url, TOKEN) for _ in range(2)]
        body = encode_tensors(INIT, {"optimizer": spec()})
        clients[0].request("POST", "/v1/init", params={"worker": 0}, content=body)
        for w, c in enumerate(clients):
            c.request("POST", "/v1/register", params={"worker": w})
        answers: dict[int, object] = {}

        def worker(w: int) -> None:
            query = {"worker": w, "step": 0, "version": 0, "wait_s": LONG_POLL_S}
            grads = {n: torch.ones_like(t) for n, t in INIT.items()}
            answers[w] = clients[w].request(
                "POST", "/v1/step", params=query, content=tensor_parts(grads)
            )

        first = threading.Thread(target=worker, args=(0,))
        first.start()
        while not shard._pending:  # worker 0's push is in; its read is waiting on the shard
            assert first.is_alive(), answers
            first.join(0.01)
        worker(1)
        first.join(2 * LONG_POLL_S)
        # A poll that had run out would have answered 202; both read version 1 at once.
        assert [answers[w].status for w in (0, 1)] == [200, 200]
        assert answers[0].headers["X-Version"] == answers[1].headers["X-Version"] == "1"
        assert answers[0].content == answers[1].content  # one encoding, for every reader
        for c in clients:
            c.close()


def test_a_step_claims_the_next_batch_once_and_a_retry_gets_the_same():
    client = client_for(consistency="asp")
    claim = {"claim_epoch": 0, "claim_position": 0, "claim_batches": 3}
    assert step(client, 0, 0, **claim).headers["X-Claim"] == "0"
    assert step(client, 0, 0, **claim).headers["X-Claim"] == "0"  # the step sent again
    assert step(client, 1, 0, **claim).headers["X-Claim"] == "1"  # another worker's first
    assert step(client, 0, 1, **(claim | {"claim_position": 1})).headers["X-Claim"] == "2"
    assert step(client, 0, 2, **(claim | {"claim_position": 2})).headers["X-Claim"] == "none"
    assert client.get("/v1/stats").json()["batches_claimed"] == {"0": 2, "1": 1}
    # A claim of another epoch length is left to /v1/claim, which says why it is refused.
    other = step(client, 0, 3, **(claim | {"claim_epoch": 1, "claim_batches": 4}))
    assert other.status_code == 200 and "X-Claim" not in other.headers
    query = {"worker": 0, "epoch": 1, "position": 0, "batches": 4}
    assert client.post("/v1/claim", params=query).status_code == 409
    assert step(client, 0, 4, claim_epoch=1).status_code == 422  # a claim needs all three
    bsp = client_for(consistency="bsp")  # BSP hands out no batches
    assert "X-Claim" not in step(bsp, 0, 0, **claim).headers


def test_the_lean_client_retries_a_connection_the_server_closed_and_reports_4xx():
    shard = ParameterShard(ShardSettings(consistency="asp"))
    with closing_idle_connections(create_shard_app(shard, TOKEN)) as url:
        client = KeepAliveClient(url, TOKEN, retry_s=30)
        assert client.request("GET", "/v1/status").json()["initialized"] is False
        (idle,) = client._idle
        select.select([idle.sock], [], [])  # the server has closed the kept-alive connection
        assert client.request("GET", "/healthz").json()["status"] == "ok"
        assert client.reconnects == 1  # sent again at once, on a new connection
        with pytest.raises(ServiceError) as refused:
            client.request("GET", "/v1/state")  # no parameters yet
        assert refused.value.status == 409
        assert client.request("GET", "/v1/state", ok=(409,)).status == 409
        wrong = KeepAliveClient(url, "wrong-token-0123456789")
        with pytest.raises(ServiceError) as denied:
            wrong.request("GET", "/v1/status")
        assert denied.value.status == 401
        # Requests to several services go out before any answer is read.
        pending = [client.send("GET", "/v1/status") for _ in range(3)]
        assert all(client.receive(p).json()["version"] == 0 for p in pending)
        client.close()
    with pytest.raises(ServiceError, match="still failing"):
        KeepAliveClient(url, TOKEN, retry_s=0.2).request("GET", "/healthz")


@contextmanager
def closing_idle_connections(app) -> Iterator[str]:
    """``app`` on uvicorn in a thread, closing a kept-alive connection as soon as it idles."""
    sock = listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=0.01)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        thread.join(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
