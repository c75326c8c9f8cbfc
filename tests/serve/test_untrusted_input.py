"""What a hostile or careless client can do to a replica and the router: too many rows, numbers
outside their datatype, an input the model fails on, malformed bodies. Each is answered 4xx,
changes nothing, is never retried on another replica, and leaves the service up; the batching
and health loops log their failures and go on. Replicas and routers run in this process."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
import pytest
import torch
from safetensors.torch import save_model
from starlette.testclient import TestClient
from torch import nn

from distml.models import DigitsCNN
from distml.net import BackgroundServer, LoopStopped
from distml.serve.batching import BatchFailed, DynamicBatcher, InferenceFailed
from distml.serve.model import ServedModel, load_served_model
from distml.serve.replica import create_replica_app
from distml.serve.router import Router
from distml.serve.router_app import create_router_app
from distml.serve.upstream import UnsafeHeader

TOKEN = "untrusted-input-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = "/v2/models/digits-cnn/infer"
ROWS = 8  # the replicas' --max-batch-rows
HUGE = "9" * 401
POISON = 1e30  # a valid FP32 value the poisoned model refuses to take


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> ServedModel:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("untrusted") / "model.safetensors"
    save_model(DigitsCNN(), str(path))
    return load_served_model(path, "digits-cnn")


class Poisoned(nn.Module):
    """The served model, raising on any input that holds ``POISON``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == POISON).any()):
            raise ValueError("index out of range in self")
        return self.inner(x)


def raw(rows: int, first: str = "0.5", rest: str = "0.25") -> str:
    data = ",".join([first] + [rest] * (rows * 64 - 1))
    return (
        f'{{"inputs":[{{"name":"input","shape":[{rows},1,8,8],"datatype":"FP32",'
        f'"data":[{data}]}}]}}'
    )


def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def sample(app, name: str, **labels: str) -> float:
    return app.state.registry.get_sample_value(name, labels) or 0.0


# -- the batcher -------------------------------------------------------------------------------


def run(coro, timeout_s: float = 30.0):
    """``coro`` in a fresh event loop, failing instead of hanging should a loop have died."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_batcher_never_runs_more_rows_than_its_cap(served):
    seen: list[int] = []

    def predict(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return served.predict(x)

    batcher = DynamicBatcher(predict, max_batch_size=4, max_delay_s=0.05, max_rows=ROWS)
    xs = [torch.randn(n, 1, 8, 8) for n in (3, 3, 3, ROWS, 1, 2, 4)]

    async def main():
        with pytest.raises(ValueError, match=f"limit of {ROWS}"):
            await batcher.infer(torch.zeros(ROWS + 1, 1, 8, 8))
        out = await asyncio.gather(*(batcher.infer(x) for x in xs))
        await batcher.close()
        return out

    for x, y in zip(xs, run(main()), strict=True):
        torch.testing.assert_close(y, served.predict(x))
    assert max(seen) == ROWS and sum(seen) == sum(x.shape[0] for x in xs)
    with pytest.raises(ValueError, match="at least max_batch_size"):
        DynamicBatcher(predict, max_batch_size=ROWS + 1, max_rows=ROWS)


def test_a_request_the_model_fails_on_fails_alone(served):
    poisoned = ServedModel("digits-cnn", served.entry, Poisoned(served.module))
    sizes: list[int] = []
    batcher = DynamicBatcher(poisoned.predict, max_batch_size=16, on_batch=sizes.append)
    xs = [torch.randn(2, 1, 8, 8) for _ in range(5)]
    xs[2][1, 0, 3, 3] = POISON

    async def main():
        out = await asyncio.gather(*(batcher.infer(x) for x in xs), return_exceptions=True)
        after = await batcher.infer(xs[0])
        await batcher.close()
        return out, after

    out, after = run(main())
    assert sizes[0] == 10  # the five were one batch
    assert isinstance(out[2], InferenceFailed) and "failed on this input" in str(out[2])
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(out[i], served.predict(xs[i]))
    torch.testing.assert_close(after, served.predict(xs[0]))


def test_an_error_in_the_batching_loop_is_logged_and_the_loop_goes_on(served, caplog):
    calls = []

    def on_batch(rows: int) -> None:
        calls.append(rows)
        if len(calls) == 1:
            raise RuntimeError("metrics backend down")

    batcher = DynamicBatcher(served.predict, on_batch=on_batch)
    x = torch.randn(1, 1, 8, 8)

    async def main():
        with pytest.raises(BatchFailed, match="RuntimeError"):
            await batcher.infer(x)
        y = await batcher.infer(x)
        await batcher.close()
        return y

    with caplog.at_level(logging.ERROR, logger="distml.net"):
        torch.testing.assert_close(run(main()), served.predict(x))
    assert "'batcher': a step failed; the loop goes on" in caplog.text
    assert "metrics backend down" in caplog.text


# -- one replica -------------------------------------------------------------------------------


def test_rows_over_the_cap_get_413_and_run_nothing(served):
    app = create_replica_app(served, TOKEN, max_batch_size=4, max_batch_rows=ROWS)
    with TestClient(app) as client:
        before = sample(app, "distml_replica_batch_rows_count")
        r = client.post(INFER, content=raw(ROWS + 1), headers=AUTH)
        assert r.status_code == 413 and f"limit of {ROWS} rows" in r.json()["error"]
        assert sample(app, "distml_replica_batch_rows_count") == before
        r = client.post(INFER, content=raw(ROWS), headers=AUTH)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [ROWS, 10]


@pytest.mark.parametrize(
    "first", [HUGE, "-" + HUGE, "1e39", "-3.5e38", "NaN", "1e999"], ids=lambda v: v[:6]
)
def test_numbers_outside_fp32_get_400(served, first):
    app = create_replica_app(served, TOKEN)
    with TestClient(app) as client:
        r = client.post(INFER, content=raw(1, first), headers=AUTH)
        assert r.status_code == 400, r.text
        assert sample(app, "distml_replica_requests_total", outcome="rejected") == 1
        assert sample(app, "distml_replica_batch_rows_count") == 0


def test_an_input_the_model_fails_on_gets_422_and_the_replica_goes_on(served):
    poisoned = ServedModel("digits-cnn", served.entry, Poisoned(served.module))
    with TestClient(create_replica_app(poisoned, TOKEN)) as client:
        r = client.post(INFER, content=raw(2, repr(POISON)), headers=AUTH)
        assert r.status_code == 422 and "failed on this input" in r.json()["error"]
        assert client.post(INFER, content=raw(2), headers=AUTH).status_code == 200
        assert client.get("/healthz", headers=AUTH).status_code == 200


class Amplified(nn.Module):
    """The served model with its logits scaled up: a large valid input overflows them."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 1e6


def test_an_output_that_overflows_is_422_not_null(served):
    """3e38 is a valid FP32 value; the logits for it are not finite, and would be ``null``."""
    amplified = ServedModel("digits-cnn", served.entry, Amplified(served.module))
    with TestClient(create_replica_app(amplified, TOKEN)) as client:
        r = client.post(INFER, content=raw(1, "3e38", "3e38"), headers=AUTH)
        assert r.status_code == 422 and "not finite" in r.json()["error"], r.text
        assert client.post(INFER, content=raw(1), headers=AUTH).status_code == 200


def test_a_replica_whose_batching_loop_stops_reports_unhealthy(served):
    app = create_replica_app(served, TOKEN)

    async def stopped() -> list:
        raise LoopStopped("the model's device is gone")

    app.state.batcher._collect = stopped
    with TestClient(app) as client:
        r = client.get("/healthz", headers=AUTH)
        assert r.status_code == 503 and "batcher" in r.json()["detail"], r.text
        r = client.post(INFER, content=raw(1), headers=AUTH)
        assert r.status_code == 503 and "stopped" in r.json()["error"]


MALFORMED = [
    b"",
    b"null",
    b"[]",
    b"{",
    b'{"inputs": null}',
    b'{"inputs": [{"name": "input"}]}',
    b'{"inputs": [{"name": "input", "shape": [1e400], "datatype": "FP32", "data": []}]}',
    b'{"inputs": [{"name": "input", "shape": ['
    + HUGE.encode()
    + b'], "datatype": "FP32", "data": []}]}',  # noqa: E501
    b'{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": '
    + b"[" * 5000
    + b"]" * 5000
    + b"}]}",
    b"\xff\xfe\x00",
]


def test_no_route_answers_5xx_to_malformed_input(served):
    with TestClient(create_replica_app(served, TOKEN)) as client:
        for body in MALFORMED:
            r = client.post(INFER, content=body, headers=AUTH)
            assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text)
        for path in ("/v2/models/" + "m" * 300, "/v2/models/%00", "/v2/models/..%2F..%2Fmetrics"):
            r = client.get(path, headers=AUTH)
            assert 400 <= r.status_code < 500, (path, r.status_code)


def test_every_route_declares_its_request_body(served):
    limit = 2**20
    apps = {
        "replica": create_replica_app(served, TOKEN, max_body=limit),
        "router": create_router_app(Router(["http://127.0.0.1:9"], TOKEN), TOKEN, max_body=limit),
    }
    for which, app in apps.items():
        with TestClient(app) as client:
            document = client.get("/openapi.json", headers=AUTH).json()
        posts = {p: ops["post"] for p, ops in document["paths"].items() if "post" in ops}
        infer = ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer")
        assert set(posts) == {*infer, "/v2/repository/index"}, which
        for path in infer:
            body = posts[path]["requestBody"]
            assert body["required"] and str(limit) in body["description"], which
            schema = body["content"]["application/json"]["schema"]
            assert schema["required"] == ["inputs"], which
            assert "$ref" not in str(schema), which


# -- the router --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed(served):
    """Two replicas (at most ``ROWS`` rows a request, a model that fails on ``POISON``) and a
    router in front of them."""
    poisoned = ServedModel("digits-cnn", served.entry, Poisoned(served.module))
    apps = [
        create_replica_app(poisoned, TOKEN, max_batch_size=4, max_batch_rows=ROWS) for _ in "ab"
    ]
    with BackgroundServer(apps[0]) as a, BackgroundServer(apps[1]) as b:
        router = Router([a.url, b.url], TOKEN, health_interval_s=0.05)
        app = create_router_app(router, TOKEN)
        with TestClient(app) as client:
            yield client, app, router, apps


BAD_THROUGH_ROUTER = [
    ("401-digit integer", raw(1, HUGE), 400),
    ("1e39 in FP32", raw(1, "1e39"), 400),
    ("rows over the cap", raw(ROWS + 1), 413),
    ("an input the model fails on", raw(1, repr(POISON)), 422),
    ("not JSON", "{", 400),
]


@pytest.mark.parametrize("case", BAD_THROUGH_ROUTER, ids=[c[0] for c in BAD_THROUGH_ROUTER])
def test_bad_input_through_the_router_is_answered_once_and_marks_nothing(routed, case):
    client, app, router, replicas = routed
    _, content, status = case
    answered = sum(sample(r, "distml_replica_requests_total", outcome="rejected") for r in replicas)
    retries = sample(app, "distml_router_retries_total")
    r = client.post(INFER, content=content, headers=AUTH)
    assert r.status_code == status, r.text
    assert "error" in r.json()
    assert sample(app, "distml_router_retries_total") == retries
    after = sum(sample(r, "distml_replica_requests_total", outcome="rejected") for r in replicas)
    assert after == answered + 1
    assert all(r.healthy and r.failures == 0 for r in router.replicas)
    assert client.post(INFER, content=raw(2), headers=AUTH).status_code == 200


def test_the_model_name_reaches_the_replica_whole(routed):
    client, _, router, _ = routed
    r = client.get("/v2/models/a%20b%3Fc%23d", headers=AUTH)
    assert r.status_code == 404 and "'a b?c#d'" in r.json()["error"], r.text
    assert all(r.healthy for r in router.replicas)


def test_the_router_health_loop_logs_a_failed_check_and_goes_on(served, caplog):
    with BackgroundServer(create_replica_app(served, TOKEN)) as replica:
        router = Router([replica.url], TOKEN, health_interval_s=0.01)
        probes = []
        probe = router._probe

        async def flaky(state) -> None:
            probes.append(state.url)
            if len(probes) == 1:
                raise RuntimeError("resolver crashed")
            await probe(state)

        router._probe = flaky
        app = create_router_app(router, TOKEN)
        with caplog.at_level(logging.ERROR, logger="distml.net"), TestClient(app) as client:
            until(lambda: len(probes) >= 3 and router.replicas[0].healthy, "later checks")
            assert client.get("/healthz", headers=AUTH).status_code == 200
        assert "'replica-health': a step failed; the loop goes on" in caplog.text
        assert "resolver crashed" in caplog.text


def test_a_router_whose_health_loop_stops_reports_unhealthy(served):
    with BackgroundServer(create_replica_app(served, TOKEN)) as replica:
        router = Router([replica.url], TOKEN, health_interval_s=0.01)

        async def gone(state) -> None:
            raise LoopStopped("no way to reach the replicas")

        router._probe = gone
        with TestClient(create_router_app(router, TOKEN)) as client:
            until(
                lambda: client.get("/healthz", headers=AUTH).status_code == 503,
                "/healthz to report the stopped loop",
            )
            assert "replica-health" in client.get("/healthz", headers=AUTH).json()["detail"]
            r = client.post(INFER, content=raw(1), headers=AUTH)
            assert r.status_code == 200  # the replicas still serve; the router says it is ill
        assert httpx.get(replica.url + "/healthz", headers=AUTH).status_code == 200


def test_a_sequence_longer_than_the_gpt_takes_is_refused_before_the_model():
    """The GPT's sequences are free in length up to its position table's."""
    from distml.models.registry import model_entry

    config = {"vocab_size": 16, "seq_len": 4, "layers": 1, "hidden": 8, "heads": 2}
    entry = model_entry("gpt", config)
    gpt = ServedModel("gpt", entry, entry.build().eval())
    path = "/v2/models/gpt/infer"

    def tokens(n: int) -> dict:
        ids = [1] * n
        return {
            "inputs": [{"name": "input_ids", "shape": [1, n], "datatype": "INT64", "data": ids}]
        }

    with TestClient(create_replica_app(gpt, TOKEN)) as client:
        r = client.post(path, json=tokens(5), headers=AUTH)
        assert r.status_code == 400 and "over its limit of 4" in r.json()["error"], r.text
        assert client.post(path, json=tokens(4), headers=AUTH).status_code == 200
        assert client.get("/healthz", headers=AUTH).status_code == 200


def test_a_header_that_would_split_the_forwarded_request_fails_alone(served):
    with BackgroundServer(create_replica_app(served, TOKEN)) as replica:
        router = Router([replica.url], TOKEN)

        async def main() -> int:
            with pytest.raises(UnsafeHeader):
                await router.forward("POST", INFER, raw(1).encode(), "application/json\r\nX: 1")
            ok = await router.forward("POST", INFER, raw(1).encode(), "application/json")
            await router.close()
            return ok.status

        assert asyncio.run(main()) == 200
        assert router.replicas[0].healthy and router.replicas[0].failures == 0
