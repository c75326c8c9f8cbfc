"""Tensors on the wire: safetensors bytes, never pickle.

A payload is a flat ``name -> tensor`` mapping plus string metadata. A body from another party
is untrusted: its header is checked here, in full, before any byte of it reaches the
safetensors parser, so that a forged header (a length past the body, a 2 GB tensor declared in
a 1 kB body, two tensors over the same bytes, a dtype this torch cannot hold, metadata that is
not text) is refused with :class:`TensorPayloadError` alone, whatever the installed safetensors
version accepts or raises. The names and sizes a receiver expects are checked by the receiver.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from distml.net.untrusted import bounded_json

# A header of 4 MiB names some 40,000 tensors, far past any model distml serves; the bound keeps
# a header of a million empty tensors from costing seconds of work to refuse.
MAX_HEADER_BYTES = 4 * 2**20
HEADER_DEPTH = 3  # {name: {"shape": [dims]}}
# Bounds that keep the size arithmetic small: a product of 64 dims of 63 bits each, at most.
MAX_DIMS = 64
MAX_COUNT = 2**63 - 1

# The safetensors dtypes this decoder accepts, with their size in bytes: those that torch holds
# as whole bytes. Sub-byte ones (F4, F6_*) and F8_E8M0 are refused.
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class TensorPayloadError(ValueError):
    """A body that is not a valid safetensors payload."""


def encode_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    """``tensors`` as safetensors bytes (each made contiguous and moved to the CPU)."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return save(cpu, metadata=metadata)


def decode_tensors(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a safetensors payload; :class:`TensorPayloadError` (and
    no other exception) if it is not one. An empty body is an empty payload.

    >>> decode_tensors(encode_tensors({"w": torch.ones(2)}, {"step": "3"}))
    ({'w': tensor([1., 1.])}, {'step': '3'})
    """
    if not body:
        return {}, {}
    metadata = check_header(body)
    try:
        tensors = load(bytes(body))
    except (SafetensorError, ValueError, RuntimeError, TypeError, KeyError, OverflowError) as exc:
        raise TensorPayloadError(f"not a safetensors payload: {exc}") from None
    return tensors, metadata


def check_header(body: bytes) -> dict[str, str]:
    """The metadata of ``body``, once its header is known to describe exactly its bytes:
    every tensor's span within the data, of the size its shape and dtype give, the spans
    back to back with neither overlap nor gap, as safetensors itself writes them."""
    header, data_size = _read_header(body)
    metadata = _metadata(header.pop("__metadata__", None))
    spans = sorted(_span(name, entry) for name, entry in header.items())
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise TensorPayloadError(f"tensor {name!r} at byte {begin} {what} (ending at {end})")
        end = stop
    if end != data_size:
        raise TensorPayloadError(f"the tensors cover {end} bytes of data, the body has {data_size}")
    return metadata


def _read_header(body: bytes) -> tuple[dict[str, Any], int]:
    """The header as a dict, and the size of the data that follows it."""
    if len(body) < 8:
        raise TensorPayloadError(f"a body of {len(body)} bytes has no header length")
    size = int.from_bytes(body[:8], "little")
    if size > MAX_HEADER_BYTES:
        raise TensorPayloadError(f"header of {size} bytes, over the limit of {MAX_HEADER_BYTES}")
    if 8 + size > len(body):
        raise TensorPayloadError(f"header of {size} bytes in a body of {len(body)}")
    try:
        header = bounded_json(
            bytes(body[8 : 8 + size]).decode("utf-8"),
            max_bytes=MAX_HEADER_BYTES,
            max_depth=HEADER_DEPTH,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise TensorPayloadError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorPayloadError(f"header is a JSON {type(header).__name__}, not an object")
    return header, len(body) - 8 - size


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TensorPayloadError("__metadata__ must map strings to strings")
    return value


def _span(name: str, entry: Any) -> tuple[int, int, str]:
    """``(begin, end, name)`` of one tensor's bytes in the data, checked against its shape."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise TensorPayloadError(f"tensor {name!r}: an entry has exactly {sorted(ENTRY_KEYS)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise TensorPayloadError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_is_count, shape)):
        raise TensorPayloadError(
            f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} counts"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise TensorPayloadError(f"tensor {name!r}: data_offsets must be [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != nbytes:
        raise TensorPayloadError(
            f"tensor {name!r}: {dtype} of shape {shape} is {nbytes} bytes, "
            f"its offsets span {end - begin}"
        )
    return begin, end, name


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
