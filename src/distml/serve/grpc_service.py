"""The Open Inference Protocol over gRPC (KServe v2 ``inference.GRPCInferenceService``), served
by a replica beside its REST routes: the same model, the same batch queue, the same checks.

A request's tensor comes as ``raw_input_contents`` (little-endian bytes: tritonclient's way),
read in place as the REST route reads a binary tensor
(:func:`distml.serve.protocol.binary_to_tensor`), or as typed ``contents``, read as the REST
route reads JSON data (:func:`distml.serve.protocol.to_tensor`): both protocols refuse the same
requests, here with INVALID_ARGUMENT (NOT_FOUND for another model). Answers come as
``raw_output_contents``. The token travels as ``authorization: Bearer <token>`` metadata;
without it a call fails UNAUTHENTICATED before any method reads the request.

The messages and the servicer base class are those tritonclient generates from KServe's
``grpc_service.proto`` (the optional extra ``distml[grpc]``).

>>> grpc_service = GrpcService(token, port=8201)                          # doctest: +SKIP
>>> app = create_replica_app(served, token, grpc=grpc_service.serving)   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from distml.config import describe_errors
from distml.models.registry import TensorSpec
from distml.serve.batching import BatchFailed, DynamicBatcher, InferenceFailed
from distml.serve.model import ServedModel
from distml.serve.protocol import (
    DATATYPE_OF,
    DTYPES,
    UNSUPPORTED,
    InferRequest,
    InputParameters,
    ProtocolError,
    RequestInput,
    binary_to_tensor,
    to_tensor,
)
from distml.serve.replica import PLATFORM, VERSION, _predict

GRPC_MISSING = "the gRPC service needs grpcio and tritonclient: pip install 'distml[grpc]'"
try:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
except (ImportError, RuntimeError) as exc:  # tritonclient without grpcio raises RuntimeError
    raise ImportError(GRPC_MISSING) from exc

# Where KServe v2 puts the typed values of each datatype (FP16 has no field: raw bytes only).
CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def decode_infer_request(
    request: service_pb2.ModelInferRequest, spec: TensorSpec, max_rows: int
) -> tuple[InferRequest, torch.Tensor]:
    """The request as the REST body it stands for, and its input tensor checked against the
    model input ``spec`` by the REST route's own checks; every refusal is a
    :class:`~distml.serve.protocol.ProtocolError`."""
    try:
        parsed = InferRequest.model_validate(
            {
                "id": request.id or None,
                "inputs": [
                    {"name": t.name, "shape": list(t.shape), "datatype": t.datatype}
                    for t in request.inputs
                ],
                "outputs": [{"name": o.name} for o in request.outputs] or None,
            }
        )
    except ValidationError as exc:
        raise ProtocolError(
            400, f"not an inference request: {describe_errors(exc, 1, 'request')}"
        ) from None
    tensors = [(f"input {i}", t.parameters) for i, t in enumerate(request.inputs)]
    tensors += [(f"output {i}", o.parameters) for i, o in enumerate(request.outputs)]
    for where, parameters in tensors:
        asked = sorted(set(parameters) & UNSUPPORTED.keys())
        if asked:
            raise ProtocolError(400, f"{where}: parameter {asked[0]!r}: {UNSUPPORTED[asked[0]]}")
    item, tensor, raw = parsed.inputs[0], request.inputs[0], request.raw_input_contents
    if not raw:
        values = _typed_values(tensor.contents, item)
        return parsed, to_tensor(item.model_copy(update={"data": values}), spec, max_rows)
    if len(raw) != len(request.inputs) or tensor.HasField("contents"):
        raise ProtocolError(
            400, "each input's values come either in raw_input_contents or in contents"
        )
    size, count = len(raw[0]), math.prod(item.shape)
    if item.datatype in DTYPES and size != count * DTYPES[item.datatype].itemsize:
        raise ProtocolError(
            400,
            f"input {item.name!r}: {size} bytes of raw_input_contents are not {count} values "
            f"of {item.datatype} for shape {item.shape}",
        )
    # The bytes are read as the REST route reads a binary tensor: in place, little-endian.
    sized = item.model_copy(update={"parameters": InputParameters(binary_data_size=size)})
    return parsed, binary_to_tensor(sized, spec, raw[0], 0, max_rows)


def _typed_values(contents: service_pb2.InferTensorContents, item: RequestInput) -> list[Any]:
    """The values of the one field of ``contents`` that ``item``'s datatype fills."""
    field = CONTENTS.get(item.datatype)
    if field is None:
        if item.datatype in DTYPES:  # FP16: KServe v2 has no typed field for it
            raise ProtocolError(
                400, f"input {item.name!r}: {item.datatype} values come in raw_input_contents"
            )
        raise ProtocolError(
            400, f"datatype {item.datatype} is not one distml's models take ({', '.join(DTYPES)})"
        )
    if any(f.name != field for f, _ in contents.ListFields()):
        raise ProtocolError(
            400, f"input {item.name!r} of {item.datatype} takes its values in contents.{field}"
        )
    return list(getattr(contents, field))


def encode_output(
    y: torch.Tensor, spec: TensorSpec
) -> tuple[service_pb2.ModelInferResponse.InferOutputTensor, bytes]:
    """The output tensor's description and its values as raw bytes, in the host's byte order
    (little-endian on every machine distml runs on, as :mod:`distml.serve.protocol` says)."""
    meta = service_pb2.ModelInferResponse.InferOutputTensor(
        name=spec.name, datatype=DATATYPE_OF[y.dtype], shape=list(y.shape)
    )
    return meta, y.contiguous().numpy().tobytes()


def _tensor_metadata(spec: TensorSpec) -> service_pb2.ModelMetadataResponse.TensorMetadata:
    return service_pb2.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.datatype, shape=list(spec.shape)
    )


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 methods of a replica; the others (repository, shared memory, streaming)
    answer UNIMPLEMENTED, from the base class."""

    def __init__(self, served: ServedModel, batcher: DynamicBatcher, calls: Counter):
        self.served = served
        self.batcher = batcher
        self.calls = calls

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=await self._ready())

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerMetadataResponse(name="distml", version=version("distml"))

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ModelReady"):
            self._check_model(request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=await self._ready())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ModelMetadata"):
            self._check_model(request.name, request.version)
        return service_pb2.ModelMetadataResponse(
            name=self.served.name,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[_tensor_metadata(self.served.input)],
            outputs=[_tensor_metadata(self.served.output)],
        )

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ModelInfer"):
            self._check_model(request.model_name, request.model_version)
            parsed, x = decode_infer_request(request, self.served.input, self.batcher.max_rows)
            if any(o.name != self.served.output.name for o in parsed.outputs or []):
                raise ProtocolError(
                    400, f"unknown output; the model gives {self.served.output.name!r}"
                )
            output, raw = encode_output(await _predict(self.batcher, x), self.served.output)
        return service_pb2.ModelInferResponse(
            model_name=self.served.name,
            model_version=VERSION,
            id=request.id,
            outputs=[output],
            raw_output_contents=[raw],
        )

    def _check_model(self, name: str, model_version: str) -> None:
        if name != self.served.name:
            raise ProtocolError(
                404, f"unknown model {name!r}; this replica serves {self.served.name!r}"
            )
        if model_version not in ("", VERSION):
            raise ProtocolError(404, f"unknown version {model_version!r} of {name!r}")

    async def _ready(self) -> bool:
        """A real one-row inference through the queue the traffic takes, as REST's readiness."""
        try:
            await self.batcher.infer(self.served.example())
        except (InferenceFailed, BatchFailed):
            return False
        return True

    @asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
        """Count the call by outcome. A refused request ends the call with its status and
        message (abort raises), and the server goes on with the others."""
        try:
            yield
        except ProtocolError as exc:
            self.calls.labels(method, "rejected").inc()
            not_found = exc.status == 404
            code = grpc.StatusCode.NOT_FOUND if not_found else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(exc))
        except BatchFailed as exc:  # the replica's fault: a client may try another replica
            self.calls.labels(method, "failed").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.calls.labels(method, "ok").inc()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


class BearerToken(grpc.aio.ServerInterceptor):
    """Every call needs ``authorization: Bearer <token>`` metadata. A call without it gets a
    handler of the same kind that reads nothing (no deserializer) and fails UNAUTHENTICATED.
    Tokens are compared by their SHA-256, as the REST services compare them."""

    def __init__(self, token: str | Mapping[str, str]):
        tokens = [token] if isinstance(token, str) else list(token.values())
        self._digests = {_digest(t) for t in tokens}

    def allows(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, credentials = value.partition(" ")
                return scheme.lower() == "bearer" and _digest(credentials) in self._digests
        return False

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or self.allows(details.invocation_metadata):
            return handler
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse)
        return grpc.unary_unary_rpc_method_handler(_refuse)


@dataclass
class GrpcService:
    """Where a replica serves gRPC: ``host:port`` (port 0: a free one, and ``port`` is the bound
    one once serving), TLS with ``ssl_certfile`` and ``ssl_keyfile``, requests of at most
    ``max_message`` bytes. ``serving`` is the hook :func:`~distml.serve.replica.create_replica_app`
    runs for the app's lifetime."""

    token: str | Mapping[str, str]
    port: int = 0
    host: str = "127.0.0.1"
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_message: int = 16 * 2**20

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("gRPC over TLS needs both a certificate and its key file")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @asynccontextmanager
    async def serving(
        self, served: ServedModel, batcher: DynamicBatcher, registry: CollectorRegistry
    ) -> AsyncIterator[GrpcService]:
        """Serve ``served`` through ``batcher`` (the replica's, shared with its REST routes)
        in this event loop; calls in flight finish when the block ends."""
        calls = Counter(
            "distml_replica_grpc_calls",
            "gRPC calls of the model's methods by outcome",
            ["method", "outcome"],
            registry=registry,
        )
        server = grpc.aio.server(
            interceptors=[BearerToken(self.token)],
            # No SO_REUSEPORT: a port taken by another process is an error, not a shared port.
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self.max_message),
            ],
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(served, batcher, calls), server
        )
        try:
            if self.ssl_certfile is None or self.ssl_keyfile is None:
                self.port = server.add_insecure_port(self.address)
            else:
                key, cert = (
                    Path(self.ssl_keyfile).read_bytes(),
                    Path(self.ssl_certfile).read_bytes(),
                )
                credentials = grpc.ssl_server_credentials([(key, cert)])
                self.port = server.add_secure_port(self.address, credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {self.address}: {exc}") from None
        await server.start()
        try:
            yield self
        finally:
            await server.stop(grace=5.0)
