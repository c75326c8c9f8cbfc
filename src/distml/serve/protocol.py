"""The Open Inference Protocol (KServe v2) REST bodies as pydantic models, and the checks that
turn a request's JSON tensor into a torch tensor the model can take: right name, datatype and
shape, and only finite values. Every failure is a :class:`ProtocolError` (a 4xx)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class ProtocolError(Exception):
    """A request the model cannot take; answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    shape: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_DIM)]], Field(min_length=1, max_length=MAX_RANK)
    ]
    datatype: Annotated[str, Field(max_length=16)]
    parameters: dict[str, Any] | None = None
    data: list[Any]


class RequestOutput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    parameters: dict[str, Any] | None = None


class InferRequest(_Body):
    id: Annotated[str, Field(max_length=256)] | None = None
    parameters: dict[str, Any] | None = None
    inputs: Annotated[list[RequestInput], Field(min_length=1, max_length=1)]
    outputs: Annotated[list[RequestOutput], Field(max_length=8)] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


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
    if not bool(torch.isfinite(wide).all()):
        raise ProtocolError(400, "data holds a non-finite value (NaN or infinity)")
    limit = torch.finfo(dtype).max
    if wide.numel() and float(wide.abs().max()) > limit:
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


def to_tensor(item: RequestInput, spec: TensorSpec, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """The request tensor ``item`` as torch, checked against the model input ``spec`` and the
    cap of ``max_rows`` rows (the first dimension) per request."""
    if item.name != spec.name:
        raise ProtocolError(400, f"unknown input {item.name!r}; the model takes {spec.name!r}")
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
    flat: list[Any] = []
    _flatten(item.data, flat)
    if len(flat) != math.prod(item.shape):
        raise ProtocolError(400, f"{len(flat)} values for shape {item.shape}")
    tensor = _as_tensor(flat, item.datatype).reshape(item.shape)
    low, high = spec.low, spec.high
    if (low is not None and bool((tensor < low).any())) or (
        high is not None and bool((tensor >= high).any())
    ):
        raise ProtocolError(400, f"input {spec.name!r} values must lie in [{low}, {high})")
    return tensor


def parse_request(body: bytes) -> InferRequest:
    """``body`` as an inference request; anything else is a :class:`ProtocolError`."""
    try:
        return InferRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ProtocolError(
            400, f"not an inference request: {describe_errors(exc, 1, 'body')}"
        ) from None


def decode_request(
    body: bytes, spec: TensorSpec, max_rows: int = MAX_ROWS
) -> tuple[InferRequest, torch.Tensor]:
    """An OIP request body and its input tensor, checked against the model input ``spec``;
    every refusal is a :class:`ProtocolError`, whatever the body holds."""
    request = parse_request(body)
    return request, to_tensor(request.inputs[0], spec, max_rows)


def request_schema() -> dict[str, Any]:
    """The JSON schema of :class:`InferRequest` with every reference inlined, for a route that
    reads its body itself to declare it in the OpenAPI document."""
    schema = InferRequest.model_json_schema()
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
    """The ``openapi_extra`` of an inference route: an OIP request in JSON, at most ``limit``
    bytes."""
    return {
        "requestBody": {
            "required": True,
            "description": f"an Open Inference Protocol request, at most {limit} bytes",
            "content": {"application/json": {"schema": request_schema()}},
        }
    }


def to_output(tensor: torch.Tensor, spec: TensorSpec) -> ResponseOutput:
    return ResponseOutput(
        name=spec.name,
        shape=list(tensor.shape),
        datatype=DATATYPE_OF[tensor.dtype],
        data=tensor.reshape(-1).tolist(),
    )
