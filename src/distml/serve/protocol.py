"""The Open Inference Protocol (KServe v2) REST bodies as pydantic models, and the checks that
turn a request's JSON tensor into a torch tensor the model can take: right name, datatype and
shape, and only finite values. Every failure is a :class:`ProtocolError` (a 4xx)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from distml.models.registry import TensorSpec

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


class ProtocolError(Exception):
    """A request the model cannot take; answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_RANK)]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class RequestOutput(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    parameters: dict[str, Any] | None = None


class InferRequest(_Body):
    id: Annotated[str, Field(max_length=256)] | None = None
    parameters: dict[str, Any] | None = None
    inputs: Annotated[list[RequestInput], Field(min_length=1, max_length=1)]
    outputs: list[RequestOutput] | None = None


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


def _check_values(flat: list[Any], datatype: str) -> None:
    if datatype == "BOOL":
        ok = all(type(v) is bool for v in flat)
    elif datatype.startswith(("INT", "UINT")):
        ok = all(type(v) is int for v in flat)  # 1.5 would be truncated silently
    else:
        ok = all(type(v) in (int, float) for v in flat)
        if ok and not all(math.isfinite(v) for v in flat):
            raise ProtocolError(400, "data holds a non-finite value (NaN or infinity)")
    if not ok:
        raise ProtocolError(400, f"data holds a value that is not of datatype {datatype}")


def to_tensor(item: RequestInput, spec: TensorSpec) -> torch.Tensor:
    """The request tensor ``item`` as torch, checked against the model input ``spec``."""
    if item.name != spec.name:
        raise ProtocolError(400, f"unknown input {item.name!r}; the model takes {spec.name!r}")
    if item.datatype != spec.datatype:
        raise ProtocolError(400, f"input {spec.name!r} is {spec.datatype}, not {item.datatype}")
    want = spec.shape
    fits = len(item.shape) == len(want) and all(
        w in (-1, s) for s, w in zip(item.shape, want, strict=True)
    )
    if not fits or item.shape[0] == 0:
        raise ProtocolError(400, f"input shape {item.shape} does not fit {list(want)}")
    flat: list[Any] = []
    _flatten(item.data, flat)
    if len(flat) != math.prod(item.shape):
        raise ProtocolError(400, f"{len(flat)} values for shape {item.shape}")
    _check_values(flat, item.datatype)
    try:
        tensor = torch.tensor(flat, dtype=DTYPES[item.datatype]).reshape(item.shape)
    except (OverflowError, RuntimeError) as exc:
        raise ProtocolError(400, f"data does not fit {item.datatype}: {exc}") from None
    low, high = spec.low, spec.high
    if (low is not None and bool((tensor < low).any())) or (
        high is not None and bool((tensor >= high).any())
    ):
        raise ProtocolError(400, f"input {spec.name!r} values must lie in [{low}, {high})")
    return tensor


def to_output(tensor: torch.Tensor, spec: TensorSpec) -> ResponseOutput:
    return ResponseOutput(
        name=spec.name,
        shape=list(tensor.shape),
        datatype=DATATYPE_OF[tensor.dtype],
        data=tensor.reshape(-1).tolist(),
    )
