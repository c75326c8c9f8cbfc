"""The Open Inference Protocol (KServe v2) REST bodies as pydantic models, and the checks that
turn a request's tensor into a torch tensor the model can take: right name, datatype and
shape, and only finite values. Every failure is a :class:`ProtocolError` (a 4xx).

A tensor travels as JSON numbers, or with the binary tensor data extension (what
``tritonclient.http`` sends by default): the header ``Inference-Header-Content-Length: N`` says
the body's first N bytes are the JSON request, and each input whose ``parameters`` hold
``binary_data_size`` has that many raw little-endian bytes after it, in input order. An answer
comes back the same way for each output asked for with ``parameters: {"binary_data": true}``
(or for all, with ``binary_data_output`` on the request). Byte order is the host's: distml runs
on little-endian machines (x86-64, arm64).

>>> request, x = decode_request(body, spec, header_length="112")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from distml.config import describe_errors
from distml.models.registry import TensorSpec
from distml.net.untrusted import finite_float

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
DATATYPE_OF = {dtype: name for name, dtype in DTYPES.items()}
MAX_RANK = 8
MAX_ROWS = 1024
MAX_DIM = 2**31 - 1
HEADER_LENGTH = "Inference-Header-Content-Length"
OCTET_STREAM = "application/octet-stream"
EXTENSIONS = ["binary_tensor_data"]
MAX_INDEX_BODY = 4096
# Parameters of extensions distml does not implement: refused by name rather than ignored, or
# a client would read an answer that ignores what it asked for.
UNSUPPORTED = {
    "shared_memory_region": "the shared-memory extensions are not supported; send the data",
    "classification": "the classification extension is not supported; ask for the output",
}


class ProtocolError(Exception):
    """A request the model cannot take; answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Parameters(BaseModel):
    """OIP parameters: the ones distml reads are typed, any other is kept and ignored (clients
    send their own, e.g. a request's ``priority``), except those of :data:`UNSUPPORTED`."""

    model_config = ConfigDict(extra="allow")

    def refuse_unsupported(self, where: str) -> None:
        asked = sorted((self.model_extra or {}).keys() & UNSUPPORTED.keys())
        if asked:
            raise ProtocolError(400, f"{where}: parameter {asked[0]!r}: {UNSUPPORTED[asked[0]]}")


class InputParameters(_Parameters):
    binary_data_size: Annotated[StrictInt, Field(ge=0)] | None = None


class OutputParameters(_Parameters):
    binary_data: StrictBool | None = None


class RequestParameters(_Parameters):
    binary_data_output: StrictBool | None = None


class RequestInput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    shape: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_DIM)]], Field(min_length=1, max_length=MAX_RANK)
    ]
    datatype: Annotated[str, Field(max_length=16)]
    parameters: InputParameters | None = None
    data: list[Any] | None = None  # absent where the bytes follow the JSON (binary_data_size)


class RequestOutput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    parameters: OutputParameters | None = None


class InferRequest(_Body):
    id: Annotated[str, Field(max_length=256)] | None = None
    parameters: RequestParameters | None = None
    inputs: Annotated[list[RequestInput], Field(min_length=1, max_length=1)]
    outputs: Annotated[list[RequestOutput], Field(max_length=8)] | None = None

    def wants_binary(self, output: str) -> bool:
        """Whether ``output`` is to be answered as raw bytes: its own ``binary_data`` if the
        request names it with one, else the request's ``binary_data_output``."""
        for item in self.outputs or []:
            if item.name == output and item.parameters and item.parameters.binary_data is not None:
                return item.parameters.binary_data
        return bool(self.parameters and self.parameters.binary_data_output)


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, int] | None = None  # binary_data_size, for an output sent as bytes
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[ResponseOutput]


class MetadataTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class RepositoryIndexRequest(_Body):
    ready: StrictBool | None = None  # true: list only the models ready for inference


class RepositoryModel(BaseModel):
    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE"]
    reason: str | None = None


def server_metadata(name: str, version: str) -> ServerMetadata:
    return ServerMetadata(name=name, version=version, extensions=EXTENSIONS)


def metadata_of(spec: TensorSpec) -> MetadataTensor:
    return MetadataTensor(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))


def _flatten(data: list[Any], out: list[Any], depth: int = 0) -> None:
    """OIP allows a tensor's data flat (row-major) or nested; either becomes one flat list."""
    if depth > MAX_RANK:
        raise ProtocolError(400, f"data nested deeper than {MAX_RANK}")
    for value in data:
        if isinstance(value, list):
            _flatten(value, out, depth + 1)
        else:
            out.append(value)


def _first_bad(flat: list[Any], datatype: str) -> str:
    """Why the first value of ``flat`` that cannot be read as a number is refused."""
    for i, value in enumerate(flat):
        try:
            finite_float(value, f"data[{i}]")
        except ValueError as exc:
            return str(exc)
    return f"data does not fit {datatype}"


def _as_tensor(flat: list[Any], datatype: str) -> torch.Tensor:
    """``flat`` as a tensor of ``datatype``, every value checked to lie within that datatype."""
    dtype = DTYPES[datatype]
    if datatype == "BOOL":
        if not all(type(v) is bool for v in flat):
            raise ProtocolError(400, "data holds a value that is not of datatype BOOL")
        return torch.tensor(flat, dtype=dtype)
    if dtype.is_floating_point:
        return _floats(flat, datatype, dtype)
    return _integers(flat, datatype, dtype)


def _floats(flat: list[Any], datatype: str, dtype: torch.dtype) -> torch.Tensor:
    """Finite and within the range of ``dtype``: 1e39 is no FP32 value (it would become an
    infinity, and the model's answer ``null``), 70000 no FP16 value."""
    # bool is an int to Python, but JSON true is no number.
    if not all(type(v) in (int, float) for v in flat):
        raise ProtocolError(400, f"data holds a value that is not of datatype {datatype}")
    try:
        wide = torch.tensor(flat, dtype=torch.float64)
    except (OverflowError, RuntimeError, ValueError):  # an integer of hundreds of digits
        raise ProtocolError(400, _first_bad(flat, datatype)) from None
    limit = torch.finfo(dtype).max
    # One reduction checks all three (the maximum of values holding a NaN is NaN); which one
    # failed is worked out only for a refusal. Each torch call costs microseconds, which count
    # on the one-row requests that most of a replica's traffic is.
    peak = float(wide.abs().max()) if wide.numel() else 0.0
    if not peak <= limit:
        if not bool(torch.isfinite(wide).all()):
            raise ProtocolError(400, "data holds a non-finite value (NaN or infinity)")
        raise ProtocolError(400, f"data holds a value beyond the range of {datatype} (±{limit:g})")
    return wide.to(dtype)


def _integers(flat: list[Any], datatype: str, dtype: torch.dtype) -> torch.Tensor:
    """Integers within the range of ``dtype``: torch would wrap -1 into a UINT8 255 silently."""
    if not all(type(v) is int for v in flat):  # 1.5 would be truncated silently
        raise ProtocolError(400, f"data holds a value that is not of datatype {datatype}")
    info = torch.iinfo(dtype)
    outside = f"data holds an integer outside {datatype} [{info.min}, {info.max}]"
    try:
        wide = torch.tensor(flat, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):
        raise ProtocolError(400, outside) from None
    if wide.numel() and bool((wide < info.min).any() or (wide > info.max).any()):
        raise ProtocolError(400, outside)
    return wide.to(dtype)


def _check_signature(item: RequestInput, spec: TensorSpec, max_rows: int) -> None:
    """``item``'s name, datatype and shape against the model input ``spec`` and the cap of
    ``max_rows`` rows (the first dimension) per request; its values are not read here."""
    if item.name != spec.name:
        raise ProtocolError(400, f"unknown input {item.name!r}; the model takes {spec.name!r}")
    if item.datatype not in DTYPES:  # BYTES (strings) and BF16 included
        raise ProtocolError(
            400, f"datatype {item.datatype} is not one distml's models take ({', '.join(DTYPES)})"
        )
    if item.datatype != spec.datatype:
        raise ProtocolError(400, f"input {spec.name!r} is {spec.datatype}, not {item.datatype}")
    want = spec.shape
    fits = len(item.shape) == len(want) and all(
        w in (-1, s) for s, w in zip(item.shape, want, strict=True)
    )
    if not fits or 0 in item.shape:
        raise ProtocolError(400, f"input shape {item.shape} does not fit {list(want)}")
    for dim, (size, most) in enumerate(zip(item.shape, spec.longest, strict=False)):
        if most is not None and size > most:
            raise ProtocolError(
                400, f"input shape {item.shape}: dimension {dim} is over its limit of {most}"
            )
    if item.shape[0] > max_rows:
        raise ProtocolError(
            413, f"{item.shape[0]} rows in one request, over the limit of {max_rows} rows"
        )


def _check_bounds(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    low, high = spec.low, spec.high
    if (low is not None and bool((tensor < low).any())) or (
        high is not None and bool((tensor >= high).any())
    ):
        raise ProtocolError(400, f"input {spec.name!r} values must lie in [{low}, {high})")
    return tensor


def to_tensor(item: RequestInput, spec: TensorSpec, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """The request tensor ``item`` (its JSON ``data``) as torch, checked against the model
    input ``spec`` and the cap of ``max_rows`` rows (the first dimension) per request."""
    _check_signature(item, spec, max_rows)
    if item.data is None:
        raise ProtocolError(400, f"input {item.name!r} has neither data nor binary_data_size")
    flat: list[Any] = []
    _flatten(item.data, flat)
    if len(flat) != math.prod(item.shape):
        raise ProtocolError(400, f"{len(flat)} values for shape {item.shape}")
    return _check_bounds(_as_tensor(flat, item.datatype).reshape(item.shape), spec)


def binary_to_tensor(
    item: RequestInput, spec: TensorSpec, body: bytes, offset: int, max_rows: int = MAX_ROWS
) -> torch.Tensor:
    """The request tensor ``item`` read from the ``binary_data_size`` bytes of ``body`` that
    start at ``offset``, checked as :func:`to_tensor` checks JSON data. The tensor shares the
    body's memory (it keeps the body alive), unless the bytes are not aligned for its datatype:
    those are copied once."""
    _check_signature(item, spec, max_rows)
    size = item.parameters.binary_data_size if item.parameters else None
    dtype, count = DTYPES[item.datatype], math.prod(item.shape)
    if size != count * dtype.itemsize:
        raise ProtocolError(
            400,
            f"input {item.name!r}: binary_data_size {size} is not {count} values of "
            f"{dtype.itemsize} bytes ({item.datatype}) for shape {item.shape}",
        )
    with warnings.catch_warnings():
        # The body is immutable bytes; nothing writes to an input tensor.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        raw = torch.frombuffer(body, dtype=torch.uint8, count=size, offset=offset)
    if dtype == torch.bool:
        if bool((raw > 1).any()):  # any other byte is no bool, and undefined to torch
            raise ProtocolError(400, "data holds a byte that is not of datatype BOOL (0 or 1)")
    elif raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    tensor = raw.view(dtype).reshape(item.shape)
    if dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(400, "data holds a non-finite value (NaN or infinity)")
    return _check_bounds(tensor, spec)


def parse_header_length(value: str, body_size: int) -> int:
    """The ``Inference-Header-Content-Length`` header: a decimal count of bytes, within the
    body of ``body_size`` bytes."""
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        raise ProtocolError(400, f"{HEADER_LENGTH} must be a count of bytes, not {value[:32]!r}")
    length = int(value)
    if length > body_size:
        raise ProtocolError(
            400, f"{HEADER_LENGTH} is {length}, past the end of the body of {body_size} bytes"
        )
    return length


def parse_request(body: bytes) -> InferRequest:
    """``body`` as an inference request; anything else is a :class:`ProtocolError`."""
    try:
        request = InferRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ProtocolError(
            400, f"not an inference request: {describe_errors(exc, 1, 'body')}"
        ) from None
    for i, item in enumerate(request.inputs):
        if item.parameters is not None:
            item.parameters.refuse_unsupported(f"input {i}")
    for i, out in enumerate(request.outputs or []):
        if out.parameters is not None:
            out.parameters.refuse_unsupported(f"output {i}")
    return request


def decode_request(
    body: bytes, spec: TensorSpec, max_rows: int = MAX_ROWS, header_length: str | None = None
) -> tuple[InferRequest, torch.Tensor]:
    """An OIP request body and its input tensor, checked against the model input ``spec``;
    ``header_length`` is the request's ``Inference-Header-Content-Length`` (binary tensor
    data), if any. Every refusal is a :class:`ProtocolError`, whatever the body holds."""
    start = len(body) if header_length is None else parse_header_length(header_length, len(body))
    request = parse_request(body if start == len(body) else body[:start])
    offsets, end = [], start
    for item in request.inputs:
        size = item.parameters.binary_data_size if item.parameters else None
        if size is not None and item.data is not None:
            raise ProtocolError(400, f"input {item.name!r} has both data and binary_data_size")
        offsets.append(end)
        end += size or 0
    if end != len(body):
        raise ProtocolError(
            400,
            f"the inputs' binary_data_size add up to {end - start} bytes, but "
            f"{len(body) - start} follow the JSON header",
        )
    item = request.inputs[0]
    if item.data is None and item.parameters and item.parameters.binary_data_size is not None:
        return request, binary_to_tensor(item, spec, body, offsets[0], max_rows)
    return request, to_tensor(item, spec, max_rows)


def to_output(tensor: torch.Tensor, spec: TensorSpec, binary: bool = False) -> ResponseOutput:
    """``tensor`` as the output ``spec``: its values in JSON, or (``binary``) only its size,
    for :func:`encode_response` to append its bytes."""
    output = ResponseOutput(
        name=spec.name, shape=list(tensor.shape), datatype=DATATYPE_OF[tensor.dtype]
    )
    if binary:
        output.parameters = {"binary_data_size": tensor.numel() * tensor.element_size()}
    else:
        output.data = tensor.reshape(-1).tolist()
    return output


def encode_response(
    response: InferResponse, tensors: Sequence[torch.Tensor]
) -> tuple[bytes, int | None]:
    """The body of ``response`` (``tensors`` are its outputs' values, in order) and the length
    of its JSON header: ``None`` where every output is in the JSON, the body being that JSON
    alone; otherwise the bytes of each binary output follow the JSON, in output order."""
    header = response.model_dump_json(exclude_none=True).encode()
    raw = [
        t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        for out, t in zip(response.outputs, tensors, strict=True)
        if out.parameters and "binary_data_size" in out.parameters
    ]
    if not raw:
        return header, None
    return b"".join([header, *raw]), len(header)


def request_schema() -> dict[str, Any]:
    """The JSON schema of :class:`InferRequest` with every reference inlined, for a route that
    reads its body itself to declare it in the OpenAPI document."""
    return _inlined(InferRequest)


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)


def infer_body(limit: int) -> dict[str, Any]:
    """The ``openapi_extra`` of an inference route: an OIP request in JSON, or with the binary
    tensor data extension (its JSON header's length in ``Inference-Header-Content-Length``),
    at most ``limit`` bytes."""
    binary = {"type": "string", "format": "binary", "maxLength": limit}
    return {
        "parameters": [
            {
                "name": HEADER_LENGTH,
                "in": "header",
                "required": False,
                "description": "binary tensor data: the length of the body's JSON header",
                "schema": {"type": "integer", "minimum": 0, "maximum": limit},
            }
        ],
        "requestBody": {
            "required": True,
            "description": f"an Open Inference Protocol request, at most {limit} bytes",
            "content": {
                "application/json": {"schema": request_schema()},
                OCTET_STREAM: {"schema": binary},
            },
        },
    }


def parse_index_request(body: bytes) -> RepositoryIndexRequest:
    """A repository index request: an empty body (what ``tritonclient`` sends) or
    ``{"ready": bool}``."""
    if not body.strip():
        return RepositoryIndexRequest()
    try:
        return RepositoryIndexRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ProtocolError(
            400, f"not a repository index request: {describe_errors(exc, 1, 'body')}"
        ) from None


def index_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v2/repository/index``: an optional JSON body."""
    return {
        "requestBody": {
            "required": False,
            "description": f"optional filter, at most {MAX_INDEX_BODY} bytes",
            "content": {"application/json": {"schema": _inlined(RepositoryIndexRequest)}},
        }
    }
