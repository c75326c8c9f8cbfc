"""Tensors on the wire: safetensors bytes, never pickle.

A payload is a flat ``name -> tensor`` mapping plus string metadata. A body from another party
is untrusted: its header is checked here, in full, before any byte of it reaches the
safetensors parser, so that a forged header (a length past the body, a 2 GB tensor declared in
a 1 kB body, two tensors over the same bytes, a dtype this torch cannot hold, metadata that is
not text) is refused with :class:`TensorPayloadError` alone, whatever the installed safetensors
version accepts or raises. The names and sizes a receiver expects are checked by the receiver.

Both directions are written here rather than through ``safetensors.torch``, whose ``save`` and
``load`` copy every tensor two or three times on the way (``benchmarks/ps_transport.py``
measures them side by side): the header is checked here anyway, and the rest of the format is
the tensors' bytes back to back. Encoding copies each tensor once, into the body; decoding a
writable buffer (a ``bytearray`` a receiver read the body into) copies nothing: the tensors
are views of it, that the receiver may keep or write to.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any

import torch

# A header of 4 MiB names some 40,000 tensors, far past any model distml serves; the bound keeps
# a header of a million empty tensors from costing seconds of work to refuse.
MAX_HEADER_BYTES = 4 * 2**20
# Bounds that keep the size arithmetic small: a product of 64 dims of 63 bits each, at most.
MAX_DIMS = 64
MAX_COUNT = 2**63 - 1

# The safetensors dtypes this codec accepts: those that torch holds as whole bytes. Sub-byte ones
# (F4, F6_*) and F8_E8M0 are refused.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
METADATA = "__metadata__"
Buffer = bytes | bytearray | memoryview
# Headers checked once, by their bytes and the body's size (bounded: a peer cannot grow it).
MAX_CACHED_HEADER = 64 * 2**10
MAX_CACHED_LAYOUTS = 256
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class TensorPayloadError(ValueError):
    """A body that is not a valid safetensors payload."""


def encode_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    """``tensors`` as safetensors bytes (each moved to the CPU and made contiguous, where it is
    not): the layout ``safetensors.torch.save`` writes, which any safetensors reader loads.

    >>> len(encode_tensors({"w": torch.ones(2)}))
    72
    """
    return b"".join(tensor_parts(tensors, metadata))


def tensor_parts(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> list[bytes | memoryview]:
    """The safetensors bytes of ``tensors`` as parts to send one after the other: the header,
    then each tensor's own memory (no copy of a contiguous CPU tensor). The tensors must not
    change until the parts are sent."""
    if METADATA in tensors:
        raise TensorPayloadError(f"a tensor cannot be named {METADATA!r}: it holds the metadata")
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    # Widest items first: every tensor then starts at a multiple of its item size (safetensors'
    # own order), so that a reader can view it in place.
    order = sorted(cpu, key=lambda name: (-cpu[name].element_size(), name))
    layout = tuple((name, cpu[name].dtype, tuple(cpu[name].shape)) for name in order)
    head = _header(layout, tuple(metadata.items()) if metadata else ())
    return [head, *(_bytes_of(cpu[name]) for name in order if cpu[name].numel())]


@functools.lru_cache(maxsize=256)
def _header(
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], metadata: tuple[tuple[str, str]]
) -> bytes:
    """The header's bytes (its length, then its JSON) for tensors of ``layout``, in that order:
    the same for every payload of one model, so written once."""
    header: dict[str, Any] = {METADATA: dict(metadata)} if metadata else {}
    end = 0
    for name, dtype, shape in layout:
        if dtype not in NAMES:
            raise TensorPayloadError(f"tensor {name!r}: safetensors has no dtype {dtype}")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [end, end + size],
        }
        end += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text


def decode_tensors(body: Buffer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a safetensors payload; :class:`TensorPayloadError` (and
    no other exception) if it is not one. An empty body is an empty payload.

    A writable ``body`` (a ``bytearray``) is not copied: the tensors are views of it. Anything
    else is copied once, so that the tensors are writable and the caller's bytes untouched.

    >>> decode_tensors(encode_tensors({"w": torch.ones(2)}, {"step": "3"}))
    ({'w': tensor([1., 1.])}, {'step': '3'})
    """
    view = memoryview(body).cast("B")
    if not view.nbytes:
        return {}, {}
    metadata, spans, start = _layout(view)
    buffer = view if not view.readonly else memoryview(bytearray(view))
    return _views(buffer, spans, start), metadata


def check_header(body: Buffer) -> dict[str, str]:
    """The metadata of ``body``, once its header is known to describe exactly its bytes (see
    :func:`decode_tensors`)."""
    return _layout(memoryview(body).cast("B"))[0]


Span = tuple[int, int, str, torch.dtype, list[int]]  # begin, end, name, dtype, shape
_LAYOUTS: dict[tuple[bytes, int], tuple[dict[str, str], list[Span], int]] = {}


def _layout(body: memoryview) -> tuple[dict[str, str], list[Span], int]:
    """The metadata, every tensor's span and where the data starts, once the header is known
    to describe exactly the body's bytes (:func:`_check_layout`). A header already accepted
    for a body of the same size is not checked again: a worker sends the same one every
    step."""
    size = int.from_bytes(body[:8], "little") if body.nbytes >= 8 else -1
    key = bytes(body[: 8 + size]) if 0 <= size <= MAX_CACHED_HEADER else None
    cached = _LAYOUTS.get((key, body.nbytes)) if key is not None else None
    if cached is not None:
        return dict(cached[0]), cached[1], cached[2]
    metadata, spans, start = _check_layout(body)
    if key is not None:
        if len(_LAYOUTS) >= MAX_CACHED_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key, body.nbytes] = (dict(metadata), spans, start)
    return metadata, spans, start


def _check_layout(body: memoryview) -> tuple[dict[str, str], list[Span], int]:
    """The metadata, every tensor's span and where the data starts, once the header is known
    to describe exactly the body's bytes: every tensor's span within the data, of the size its
    shape and dtype give, the spans back to back with neither overlap nor gap, as safetensors
    itself writes them."""
    header, data_size = _read_header(body)
    metadata = _metadata(header.pop(METADATA, None))
    spans = sorted(_span(name, entry) for name, entry in header.items())
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise TensorPayloadError(f"tensor {name!r} at byte {begin} {what} (ending at {end})")
        end = stop
    if end != data_size:
        raise TensorPayloadError(f"the tensors cover {end} bytes of data, the body has {data_size}")
    return metadata, spans, body.nbytes - data_size


def _views(buffer: memoryview, spans: list[Span], start: int) -> dict[str, torch.Tensor]:
    """The tensors of checked ``spans``, as views of ``buffer`` (a copy only for a tensor whose
    bytes are not aligned to its item size: a forged payload's, never one written here)."""
    tensors = {}
    for begin, end, name, dtype, shape in spans:
        offset = start + begin
        if begin == end:
            tensor = torch.empty(shape, dtype=dtype)
        elif offset % dtype.itemsize:
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=offset)
            tensor = raw.clone().view(dtype).view(shape)
        else:
            count = (end - begin) // dtype.itemsize
            tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)
        tensors[name] = tensor
    return tensors


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_header(body: memoryview) -> tuple[dict[str, Any], int]:
    """The header as a dict, and the size of the data that follows it."""
    if body.nbytes < 8:
        raise TensorPayloadError(f"a body of {body.nbytes} bytes has no header length")
    size = int.from_bytes(body[:8], "little")
    if size > MAX_HEADER_BYTES:
        raise TensorPayloadError(f"header of {size} bytes, over the limit of {MAX_HEADER_BYTES}")
    if 8 + size > body.nbytes:
        raise TensorPayloadError(f"header of {size} bytes in a body of {body.nbytes}")
    # Plain json.loads: the header's shape is then checked entry by entry (_span, _metadata),
    # which refuses any nesting past {name: {"shape": [dims]}}; a general depth walk would
    # cost more than the rest of a small payload's decoding.
    try:
        text = bytes(body[8 : 8 + size]).decode("utf-8")
        header = json.loads(text, parse_constant=_refuse_constant)
    except (RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise TensorPayloadError(f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise TensorPayloadError(f"header is a JSON {type(header).__name__}, not an object")
    return header, body.nbytes - 8 - size


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TensorPayloadError("__metadata__ must map strings to strings")
    return value


def _span(name: str, entry: Any) -> Span:
    """``(begin, end, name)`` of one tensor's bytes in the data, checked against its shape."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise TensorPayloadError(f"tensor {name!r}: an entry has exactly {sorted(ENTRY_KEYS)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
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
    return begin, end, name, DTYPES[dtype], shape


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT  # a bool is not a count


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
