"""The KServe v2 gRPC service of a replica, through the standard client (``tritonclient.grpc``):
binary and typed tensors are answered with what the model computes here, metadata and health
answer, malformed requests are refused (INVALID_ARGUMENT) while the server goes on, calls
without the token are refused (UNAUTHENTICATED), and gRPC and REST requests share one batch
queue. One test starts ``distml serve --grpc-port`` for real."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from safetensors.torch import save_model
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from distml.models import DigitsCNN
from distml.models.registry import TensorSpec, model_entry
from distml.net import TOKEN_ENV, BackgroundServer
from distml.net.ports import free_port
from distml.serve.grpc_service import GrpcService, decode_infer_request
from distml.serve.model import ServedModel, load_served_model
from distml.serve.protocol import ProtocolError
from distml.serve.replica import create_replica_app

TOKEN = "grpc-test-token-0123456789"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
METADATA = (("authorization", f"Bearer {TOKEN}"),)
MODEL = "digits-cnn"
ROWS = 16  # the replica's max_batch_rows


@pytest.fixture(scope="module")
def served() -> ServedModel:
    torch.manual_seed(0)
    entry = model_entry(MODEL)
    return ServedModel(MODEL, entry, entry.build().eval())


@contextmanager
def replica(served: ServedModel, **options) -> Iterator[tuple[str, str]]:
    """A replica in this process (uvicorn in a thread, gRPC in its event loop): its REST URL
    and its gRPC target."""
    service = GrpcService(TOKEN)  # port 0: a free one, bound when the app starts
    app = create_replica_app(served, TOKEN, grpc=service.serving, **options)
    with BackgroundServer(app) as server:
        yield server.url, f"127.0.0.1:{service.port}"


@pytest.fixture(scope="module")
def target(served) -> Iterator[str]:
    with replica(served, max_batch_size=8, max_batch_rows=ROWS) as (_, target):
        yield target


@pytest.fixture
def client(target) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(target) as c:
        yield c


@pytest.fixture
def stub(target) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """The generated stub, for the requests tritonclient never sends (typed contents, raw
    bytes that do not fit the shape)."""
    with grpc.insecure_channel(target) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def binary_input(x: torch.Tensor, name: str = "input") -> grpcclient.InferInput:
    array = x.numpy()
    datatype = {np.float32: "FP32", np.float64: "FP64"}[array.dtype.type]
    return grpcclient.InferInput(name, list(x.shape), datatype).set_data_from_numpy(array)


def infer(client: grpcclient.InferenceServerClient, x: torch.Tensor, **options) -> torch.Tensor:
    result = client.infer(MODEL, [binary_input(x)], headers=HEADERS, **options)
    return torch.from_numpy(result.as_numpy("logits").copy())


def typed_request(x: torch.Tensor, **contents) -> service_pb2.ModelInferRequest:
    values = contents or {"fp32_contents": x.flatten().tolist()}
    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name="input",
        datatype="FP32",
        shape=list(x.shape),
        contents=service_pb2.InferTensorContents(**values),
    )
    return service_pb2.ModelInferRequest(model_name=MODEL, inputs=[tensor])


def raw_request(x: torch.Tensor, raw: bytes) -> service_pb2.ModelInferRequest:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name="input", datatype="FP32", shape=list(x.shape)
    )
    return service_pb2.ModelInferRequest(
        model_name=MODEL, inputs=[tensor], raw_input_contents=[raw]
    )


def test_binary_tensors_are_answered_with_the_model_computed_here(client, served):
    x = torch.randn(3, 1, 8, 8)
    result = client.infer(
        MODEL,
        [binary_input(x)],
        outputs=[grpcclient.InferRequestedOutput("logits")],
        request_id="req-7",
        headers=HEADERS,
    )
    response = result.get_response()
    assert (response.id, response.model_version, response.model_name) == ("req-7", "1", MODEL)
    assert response.outputs[0].datatype == "FP32" and list(response.outputs[0].shape) == [3, 10]
    torch.testing.assert_close(
        torch.from_numpy(result.as_numpy("logits").copy()), served.predict(x)
    )


def test_typed_contents_are_answered_with_the_model_computed_here(stub, served):
    x = torch.randn(2, 1, 8, 8)
    response = stub.ModelInfer(typed_request(x), metadata=METADATA)
    out = response.outputs[0]
    assert out.name == "logits" and out.datatype == "FP32" and list(out.shape) == [2, 10]
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(out.shape))
    torch.testing.assert_close(torch.from_numpy(y.copy()), served.predict(x))


def test_health_and_metadata(client):
    assert client.is_server_live(headers=HEADERS)
    assert client.is_server_ready(headers=HEADERS)
    assert client.is_model_ready(MODEL, headers=HEADERS)
    assert client.is_model_ready(MODEL, "1", headers=HEADERS)
    server = client.get_server_metadata(headers=HEADERS)
    assert server.name == "distml" and server.version
    meta = client.get_model_metadata(MODEL, headers=HEADERS)
    assert (meta.name, list(meta.versions), meta.platform) == (MODEL, ["1"], "pytorch_safetensors")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input", "FP32", [-1, 1, 8, 8])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("logits", "FP32", [-1, 10])
    ]
    for call in (
        lambda: client.get_model_metadata("no-such-model", headers=HEADERS),
        lambda: client.is_model_ready(MODEL, "2", headers=HEADERS),
    ):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.NOT_FOUND"


def _nan() -> torch.Tensor:
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 3, 3] = math.nan
    return x


MALFORMED: dict[str, Callable] = {
    "unknown input": lambda c, s: c.infer(
        MODEL, [binary_input(torch.zeros(1, 1, 8, 8), "pixels")], headers=HEADERS
    ),
    "wrong datatype": lambda c, s: c.infer(
        MODEL, [binary_input(torch.zeros(1, 1, 8, 8, dtype=torch.float64))], headers=HEADERS
    ),
    "NaN": lambda c, s: c.infer(MODEL, [binary_input(_nan())], headers=HEADERS),
    "too many rows": lambda c, s: c.infer(
        MODEL, [binary_input(torch.zeros(ROWS + 1, 1, 8, 8))], headers=HEADERS
    ),
    "wrong shape": lambda c, s: c.infer(
        MODEL, [binary_input(torch.zeros(1, 8, 8))], headers=HEADERS
    ),
    "unknown output": lambda c, s: c.infer(
        MODEL,
        [binary_input(torch.zeros(1, 1, 8, 8))],
        outputs=[grpcclient.InferRequestedOutput("probabilities")],
        headers=HEADERS,
    ),
    "raw contents shorter than the shape": lambda c, s: s.ModelInfer(
        raw_request(torch.zeros(1, 1, 8, 8), bytes(4 * 63)), metadata=METADATA
    ),
    "raw contents longer than the shape": lambda c, s: s.ModelInfer(
        raw_request(torch.zeros(1, 1, 8, 8), bytes(4 * 65)), metadata=METADATA
    ),
    "typed contents in another datatype's field": lambda c, s: s.ModelInfer(
        typed_request(torch.zeros(1, 1, 8, 8), int64_contents=[0] * 64), metadata=METADATA
    ),
    "typed contents short of the shape": lambda c, s: s.ModelInfer(
        typed_request(torch.zeros(1, 1, 8, 8), fp32_contents=[0.0] * 63), metadata=METADATA
    ),
    "typed NaN": lambda c, s: s.ModelInfer(
        typed_request(_nan(), fp32_contents=_nan().flatten().tolist()), metadata=METADATA
    ),
}


def _status(exc: Exception) -> str:
    if isinstance(exc, InferenceServerException):
        return exc.status()
    assert isinstance(exc, grpc.RpcError)
    return str(exc.code())


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_is_invalid_and_the_next_is_served(case, client, stub, served):
    with pytest.raises((InferenceServerException, grpc.RpcError)) as refused:
        MALFORMED[case](client, stub)
    assert _status(refused.value) == "StatusCode.INVALID_ARGUMENT", refused.value
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(infer(client, x), served.predict(x))


def test_another_model_is_not_found(client):
    x = binary_input(torch.zeros(1, 1, 8, 8))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("digits-mlp", [x], headers=HEADERS)
    assert refused.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize(
    "headers",
    [None, {"authorization": "Bearer wrong-token-0123456789"}, {"authorization": TOKEN}],
    ids=["none", "wrong", "no-scheme"],
)
def test_a_call_without_the_token_is_unauthenticated(headers, client, served):
    x = binary_input(torch.zeros(1, 1, 8, 8))
    for call in (
        lambda: client.is_server_live(headers=headers),
        lambda: client.get_model_metadata(MODEL, headers=headers),
        lambda: client.infer(MODEL, [x], headers=headers),
    ):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    y = torch.randn(1, 1, 8, 8)
    torch.testing.assert_close(infer(client, y), served.predict(y))


def test_typed_and_raw_integers_are_read_and_checked_alike():
    """The GPT's INT64 token ids, typed and raw, give one tensor; an id past the vocabulary is
    refused either way, as the REST route refuses it."""
    spec = TensorSpec("input_ids", "INT64", (-1, -1), low=0, high=100, longest=(None, 16))
    ids = torch.tensor([[1, 2, 3], [97, 98, 99]])

    def request(values: torch.Tensor, raw: bool) -> service_pb2.ModelInferRequest:
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name="input_ids", datatype="INT64", shape=list(values.shape)
        )
        if raw:
            return service_pb2.ModelInferRequest(
                inputs=[tensor], raw_input_contents=[values.numpy().tobytes()]
            )
        tensor.contents.int64_contents.extend(values.flatten().tolist())
        return service_pb2.ModelInferRequest(inputs=[tensor])

    for raw in (False, True):
        _, x = decode_infer_request(request(ids, raw), spec, max_rows=8)
        assert x.dtype == torch.int64 and torch.equal(x, ids)
        with pytest.raises(ProtocolError, match=r"must lie in \[0, 100\)"):
            decode_infer_request(request(ids + 1, raw), spec, max_rows=8)
        with pytest.raises(ProtocolError, match="over its limit of 16"):
            decode_infer_request(request(torch.zeros(1, 17, dtype=torch.int64), raw), spec, 8)


def test_grpc_and_rest_requests_share_one_batch_queue(served):
    """A batch of two rows, with a delay no test waits out: a one-row gRPC request and a
    one-row REST request are answered only if they fill one batch together."""
    x_grpc, x_rest = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)
    rest_body = {
        "inputs": [
            {
                "name": "input",
                "shape": [1, 1, 8, 8],
                "datatype": "FP32",
                "data": x_rest.flatten().tolist(),
            }
        ]
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with replica(served, max_batch_size=2, max_delay_ms=600_000) as (url, target):

        def by_grpc() -> torch.Tensor:
            with grpcclient.InferenceServerClient(target) as c:
                return infer(c, x_grpc)

        def by_rest() -> torch.Tensor:
            r = httpx.post(
                f"{url}/v2/models/{MODEL}/infer", json=rest_body, headers=auth, timeout=300
            )
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            return torch.tensor(out["data"]).reshape(out["shape"])

        with ThreadPoolExecutor(2) as pool:
            grpc_answer, rest_answer = pool.submit(by_grpc), pool.submit(by_rest)
            torch.testing.assert_close(grpc_answer.result(timeout=300), served.predict(x_grpc))
            torch.testing.assert_close(rest_answer.result(timeout=300), served.predict(x_rest))
        metrics = httpx.get(f"{url}/metrics", headers=auth).text
    assert "distml_replica_batch_rows_count 1.0" in metrics
    assert "distml_replica_batch_rows_sum 2.0" in metrics
    assert 'distml_replica_grpc_calls_total{method="ModelInfer",outcome="ok"} 1.0' in metrics


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are both free now."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.mark.distributed
def test_distml_serve_grpc_port_serves_every_replica(tmp_path):
    torch.manual_seed(1)
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    oracle = load_served_model(tmp_path, MODEL).predict
    port, grpc_port = free_port(), _two_free_ports()
    argv = [sys.executable, "-m", "distml.cli.serve", str(tmp_path), "--replicas", "2"]
    argv += ["--model", MODEL, "--port", str(port), "--grpc-port", str(grpc_port)]
    argv += ["--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: TOKEN})
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def ready() -> bool:
        # The replicas share the HTTP port, which answers once the first of them does: each
        # replica's own gRPC port says when that replica is up.
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", headers=auth)
            for i in range(2):
                with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port + i}") as c:
                    c.is_model_ready(MODEL, headers=HEADERS)
        except (httpx.TransportError, InferenceServerException):
            return False
        return r.status_code == 200

    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        for i in range(2):
            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port + i}") as c:
                assert c.is_model_ready(MODEL, headers=HEADERS)
                x = torch.randn(4, 1, 8, 8)
                torch.testing.assert_close(infer(c, x), oracle(x))
                with pytest.raises(InferenceServerException) as refused:
                    c.is_server_live()
                assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
