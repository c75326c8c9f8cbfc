"""The Open Inference Protocol over HTTP as the standard client speaks it: tritonclient.http's
InferenceServerClient against a replica, and against the router in front of it, in the binary
tensor data mode (its default) and in JSON. Answers equal the model run in this process;
malformed binary requests get a 4xx and the server answers the next one; no token, no answer."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from safetensors.torch import save_model
from tritonclient.utils import InferenceServerException

from distml.models import DigitsCNN
from distml.net import BackgroundServer
from distml.serve.model import load_served_model
from distml.serve.replica import create_replica_app
from distml.serve.router import Router
from distml.serve.router_app import create_router_app

TOKEN = "oip-http-test-token-0123456789"
MODEL = "digits-cnn"
MAX_BODY = 2**16
INFER = f"/v2/models/{MODEL}/infer"
HEADER = "Inference-Header-Content-Length"


def auth() -> dict[str, str]:
    # A fresh dict each call: the client writes Inference-Header-Content-Length into it.
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("oip") / "model.safetensors"
    save_model(DigitsCNN(), str(path))
    return load_served_model(path, MODEL)


@pytest.fixture(scope="module")
def urls(served):
    """A replica, and a router in front of it, each served over loopback by this process."""
    replica = create_replica_app(served, TOKEN, max_batch_size=8, max_body=MAX_BODY)
    with BackgroundServer(replica) as replica_server:
        router = Router([replica_server.url], TOKEN, health_interval_s=0.2)
        with BackgroundServer(create_router_app(router, TOKEN, max_body=MAX_BODY)) as server:
            yield {"replica": replica_server.url, "router": server.url}


@pytest.fixture(params=["replica", "router"])
def url(request, urls):
    return urls[request.param]


@pytest.fixture
def client(url):
    with triton.InferenceServerClient(url.removeprefix("http://")) as client:
        yield client


def digits(rows: int, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1, 8, 8, generator=gen).numpy()


def infer(client, x: np.ndarray, binary_in: bool = True, binary_out: bool | None = True, **kw):
    """``binary_out=None`` names no output: the client then asks for every one in binary."""
    item = triton.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x, binary_data=binary_in)
    outputs = None if binary_out is None else [triton.InferRequestedOutput("logits", binary_out)]
    return client.infer(MODEL, [item], outputs=outputs, headers=auth(), **kw)


def logits(result: triton.InferResult) -> torch.Tensor:
    return torch.tensor(result.as_numpy("logits"))  # a copy: the client's array is read-only


@pytest.mark.parametrize("binary_out", [True, False, None], ids=["bin-out", "json-out", "all"])
@pytest.mark.parametrize("binary_in", [True, False], ids=["bin-in", "json-in"])
def test_inference_equals_the_model(client, served, binary_in, binary_out):
    x = digits(3, seed=1)
    result = infer(client, x, binary_in, binary_out, request_id="r-7")
    expected = served.predict(torch.from_numpy(x))
    torch.testing.assert_close(logits(result), expected)
    answer = result.get_response()
    assert answer["id"] == "r-7" and answer["model_name"] == MODEL
    output = answer["outputs"][0]
    assert output["shape"] == [3, 10] and output["datatype"] == "FP32"
    in_binary = binary_out is not False
    assert ("data" in output) != in_binary
    assert (output.get("parameters", {}).get("binary_data_size") == 3 * 10 * 4) == in_binary


def test_server_and_model_metadata(client):
    meta = client.get_server_metadata(headers=auth())
    assert meta["name"] == "distml" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(MODEL, headers=auth())
    assert model["name"] == MODEL and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert model["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert client.get_model_metadata(MODEL, "1", headers=auth()) == model
    assert client.is_server_live(headers=auth()) and client.is_server_ready(headers=auth())
    assert client.is_model_ready(MODEL, headers=auth())
    assert client.is_model_ready(MODEL, "1", headers=auth())
    assert not client.is_model_ready("resnet", headers=auth())
    assert not client.is_model_ready(MODEL, "2", headers=auth())
    index = client.get_model_repository_index(headers=auth())
    assert index == [{"name": MODEL, "version": "1", "state": "READY"}]
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("resnet", headers=auth())
    assert caught.value.status() == "404" and "resnet" in caught.value.message()


def test_a_versioned_inference_equals_the_unversioned_one(client, served):
    x = digits(2, seed=2)
    item = triton.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)
    result = client.infer(MODEL, [item], model_version="1", headers=auth())
    torch.testing.assert_close(logits(result), served.predict(torch.from_numpy(x)))
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [item], model_version="2", headers=auth())
    assert caught.value.status() == "404"


def binary_request(x: np.ndarray, drop: int = 0, binary_output: bool = False) -> tuple[bytes, int]:
    """A binary request of ``x`` less its last ``drop`` bytes, and its JSON header's length."""
    raw = x.astype("<f4").tobytes()[: x.nbytes - drop]
    item = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    item["parameters"] = {"binary_data_size": len(raw)}
    request = {"inputs": [item], "parameters": {"binary_data_output": binary_output}}
    header = json.dumps(request).encode()
    return header + raw, len(header)


def test_malformed_binary_requests_get_4xx_and_the_server_goes_on(client, url, served):
    x = digits(1, seed=3)
    nan = x.copy()
    nan[0, 0, 3, 3] = np.nan
    short = triton.InferInput("input", [1, 1, 8, 8], "FP32").set_data_from_numpy(x)
    short.set_shape([2, 1, 8, 8])  # the 256 bytes of one row, for two
    not_finite = triton.InferInput("input", [1, 1, 8, 8], "FP32").set_data_from_numpy(nan)
    strings = triton.InferInput("input", [1], "BYTES")
    strings.set_data_from_numpy(np.array([b"abc"], dtype=np.object_))
    through_the_client = (
        ("wrong size", "binary_data_size", short),
        ("NaN", "non-finite", not_finite),
        ("strings", "BYTES", strings),
    )
    for what, message, item in through_the_client:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, [item], headers=auth())
        assert caught.value.status() == "400", what
        assert message in caught.value.message(), (what, caught.value.message())
        assert_answers_like_the_model(client, served)

    body, length = binary_request(x)
    by_hand = (  # what the client never sends
        ("header past the body", body, len(body) + 1, 400),
        ("header not a number", body, "12x", 400),
        ("bytes left over", body + b"\0\0\0\0", length, 400),
        ("bytes missing", body[:-4], length, 400),
        ("size of another shape", *binary_request(x, drop=4), 400),
        ("over the body cap", *binary_request(digits(300, seed=4)), 413),
    )
    with httpx.Client(base_url=url, headers=auth()) as http:
        for what, content, header, status in by_hand:
            sent = {HEADER: str(header)}
            r = http.post(INFER, content=content, headers=sent)
            assert r.status_code == status, (what, r.text)
            assert "error" in r.json(), what
            assert_answers_like_the_model(client, served)


def assert_answers_like_the_model(client, served) -> None:
    x = digits(2, seed=5)
    result = infer(client, x)
    expected = served.predict(torch.from_numpy(x))
    torch.testing.assert_close(logits(result), expected)


@pytest.mark.parametrize("binary_output", [False, True], ids=["json-out", "bin-out"])
def test_the_router_passes_binary_requests_and_answers_through_unchanged(urls, binary_output):
    body, length = binary_request(digits(2, seed=6), binary_output=binary_output)
    headers = {**auth(), HEADER: str(length)}
    replica, router = (
        httpx.post(urls[w] + INFER, content=body, headers=headers) for w in ("replica", "router")
    )
    assert replica.status_code == router.status_code == 200, router.text
    assert replica.content == router.content
    for answer in (replica, router):
        json_length = answer.headers.get("inference-header-content-length")
        if not binary_output:
            assert answer.headers["content-type"] == "application/json" and json_length is None
            continue
        assert answer.headers["content-type"] == "application/octet-stream"
        output = json.loads(answer.content[: int(json_length)])["outputs"][0]
        assert output["parameters"]["binary_data_size"] == len(answer.content) - int(json_length)


class FirstListed:
    """A routing policy that always picks the first replica it may."""

    def choose(self, candidates):
        return candidates[0]


def test_a_binary_request_is_retried_on_another_replica_unchanged(urls, served):
    """The first replica refuses connections: the router sends the same bytes and headers to
    the next, and hands its binary answer back whole."""
    x = digits(2, seed=8)
    body, length = binary_request(x, binary_output=True)
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        router = Router([dead, urls["replica"]], TOKEN, policy=FirstListed(), retry_s=10)

        async def send():
            try:
                return await router.forward("POST", INFER, body, "", {HEADER: str(length)})
            finally:
                await router.close()

        answer = asyncio.run(send())
    assert answer.status == 200 and answer.attempts == 2 and answer.replica == urls["replica"]
    assert answer.content_type == "application/octet-stream"
    result = triton.InferResult.from_response_body(
        answer.content, False, int(answer.headers[HEADER])
    )
    torch.testing.assert_close(logits(result), served.predict(torch.from_numpy(x)))
    assert not router.replicas[0].healthy


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong-token-0123456789"}])
def test_requests_without_the_token_are_refused(client, headers):
    x = digits(1, seed=7)
    item = triton.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)
    for call in (
        lambda: client.infer(MODEL, [item], headers=dict(headers or {})),
        lambda: client.get_server_metadata(headers=dict(headers or {})),
        lambda: client.get_model_repository_index(headers=dict(headers or {})),
        lambda: client.get_model_metadata(MODEL, headers=dict(headers or {})),
    ):
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() in ("401", "403")
    assert not client.is_server_ready(headers=dict(headers or {}))
    assert not client.is_model_ready(MODEL, headers=dict(headers or {}))
