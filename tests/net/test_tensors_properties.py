"""Properties of the safetensors decoder, which reads bytes from any party: every body either
decodes to exactly the tensors and metadata it describes or is refused with
TensorPayloadError, never another exception, and a forged header never makes it allocate
what the header declares."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from conftest import examples
from distml.net import tensors as wire
from distml.net.tensors import ITEMSIZE, TensorPayloadError, decode_tensors, encode_tensors

DTYPES = {
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
# No clock in a property: a loaded machine must not turn a slow example into a failure.
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
# safetensors writes a tensor named "__metadata__" but cannot read it back: not a payload name.
tensor_names = names.filter(lambda name: name != "__metadata__")
metadata = st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=4)
shapes = st.lists(st.integers(0, 4), max_size=3)  # [] is a 0-d tensor


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any supported dtype with arbitrary bytes (NaNs and all), booleans 0 or 1."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(shapes)
    size = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=size, max_size=size))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    return flat.to(torch.uint8).view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``: equality of these is exact, NaN payloads included."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def body_of(header: object, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def decode_or_refuse(body: bytes) -> tuple[dict, dict] | None:
    """The decoded payload, or None if refused: any exception but TensorPayloadError fails."""
    try:
        return decode_tensors(body)
    except TensorPayloadError:
        return None


def test_the_dtype_table_covers_every_dtype_the_decoder_accepts():
    assert set(DTYPES) == set(ITEMSIZE)
    assert all(DTYPES[name].itemsize == size for name, size in ITEMSIZE.items())


@settings(FAST, max_examples=examples(300))
@given(st.dictionaries(tensor_names, tensors(), max_size=5), metadata)
def test_any_payload_round_trips_bit_for_bit(payload, meta):
    got, got_meta = decode_tensors(encode_tensors(payload, meta or None))
    assert got_meta == meta
    assert set(got) == set(payload)
    for name, sent in payload.items():
        assert (got[name].dtype, got[name].shape) == (sent.dtype, sent.shape)
        assert raw_bytes(got[name]) == raw_bytes(sent)


@settings(FAST, max_examples=examples(200))
@given(st.dictionaries(tensor_names, tensors(), max_size=5), metadata)
def test_the_format_is_safetensors_own_both_ways(payload, meta):
    theirs = safetensors_load(encode_tensors(payload, meta or None))
    ours, got_meta = decode_tensors(safetensors_save(payload, metadata=meta or None))
    assert got_meta == meta
    for got in (theirs, ours):
        assert set(got) == set(payload)
        for name, sent in payload.items():
            assert (got[name].dtype, got[name].shape) == (sent.dtype, sent.shape)
            assert raw_bytes(got[name]) == raw_bytes(sent)


def test_a_writable_body_is_decoded_in_place_and_bytes_are_copied():
    sent = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.int8)}
    body = encode_tensors(sent)
    buffer = bytearray(body)
    got, _ = decode_tensors(buffer)
    got["w"].mul_(2)  # a view of the buffer: the receiver's to keep or change
    assert decode_tensors(buffer)[0]["w"].equal(sent["w"] * 2)
    copied, _ = decode_tensors(body)
    copied["w"].zero_()  # the caller's bytes are immutable: the tensors own a copy
    assert decode_tensors(body)[0]["w"].equal(sent["w"])
    # A tensor that does not start at a multiple of its item size (a payload not written
    # by safetensors) is copied into aligned memory, with the same values.
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }
    data = b"xyz" + raw_bytes(torch.tensor([1.5, -2.0]))
    got, _ = decode_tensors(bytearray(body_of(header, data)))
    assert got["b"].tolist() == [1.5, -2.0] and got["b"].data_ptr() % 4 == 0


def test_a_header_decoded_before_is_checked_again_against_each_body():
    body = encode_tensors({"w": torch.ones(4), "b": torch.zeros(2, dtype=torch.int8)})
    assert decode_tensors(body)[0]["w"].tolist() == [1.0] * 4  # its layout is now known
    with pytest.raises(TensorPayloadError):
        decode_tensors(body[:-1])  # the same header over one byte too few
    with pytest.raises(TensorPayloadError):
        decode_tensors(body + b"x")  # or one too many
    got, meta = decode_tensors(encode_tensors({"w": torch.ones(4)}, {"k": "v"}))
    meta["k"] = "changed"  # a caller's copy: the next decoding is not changed by it
    assert decode_tensors(encode_tensors({"w": torch.ones(4)}, {"k": "v"}))[1] == {"k": "v"}


def test_only_what_safetensors_can_hold_is_encoded():
    with pytest.raises(TensorPayloadError, match="complex128"):
        encode_tensors({"z": torch.zeros(2, dtype=torch.complex128)})
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: written in its own order
    assert decode_tensors(encode_tensors({"t": strided}))[0]["t"].equal(strided)


@settings(FAST, max_examples=examples(200))
@given(st.dictionaries(tensor_names, tensors(), min_size=1, max_size=3), st.data())
def test_a_truncated_body_is_refused(payload, data):
    body = encode_tensors(payload)
    cut = data.draw(st.integers(1, len(body) - 1))
    with pytest.raises(TensorPayloadError):
        decode_tensors(body[:cut])


@settings(FAST, max_examples=examples(200))
@given(st.dictionaries(tensor_names, tensors(), max_size=3), st.integers(0, 2**64 - 1))
def test_any_header_length_is_refused_unless_it_is_the_true_one(payload, length):
    body = encode_tensors(payload)
    forged = struct.pack("<Q", length) + body[8:]
    if forged == body:
        assert decode_or_refuse(forged) is not None
    else:
        assert decode_or_refuse(forged) is None


@settings(FAST, max_examples=examples(300))
@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_but_a_payload_error(body):
    decode_or_refuse(body)


@settings(FAST, max_examples=examples(200))
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_a_header_that_is_not_json_is_refused(text, data):
    try:
        json.loads(text)
    except ValueError:
        body = struct.pack("<Q", len(text)) + text + data
        assert decode_or_refuse(body) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
dtype_names = (
    st.sampled_from(sorted(ITEMSIZE))
    | st.sampled_from(["F4", "F6_E2M3", "F8_E8M0", "C128", "f32", "", "I128"])
    | st.text(max_size=6)
)
counts = st.integers(0, 8) | st.integers(-(2**70), 2**70) | st.booleans() | st.floats(0, 8)
entries = st.fixed_dictionaries(
    {
        "dtype": dtype_names,
        "shape": st.lists(counts, max_size=3) | json_values,
        "data_offsets": st.lists(counts, min_size=2, max_size=2) | json_values,
    },
    optional={"extra": json_values},
)
headers = st.dictionaries(names, entries | json_values, max_size=4).flatmap(
    lambda h: st.fixed_dictionaries({}, optional={"__metadata__": json_values}).map(
        lambda m: {**h, **m}
    )
)


BENDS = st.sampled_from([0, 0, 0, 0, -1, 1])  # mostly as written, sometimes off by one


@st.composite
def laid_out(draw: st.DrawFn) -> tuple[dict, bytes]:
    """A header laid out as safetensors writes one, then perhaps bent: a dtype the decoder may
    not know, a tensor moved over its neighbour or past the end, a byte missing or extra."""
    header: dict[str, object] = {}
    end = 0
    for name in draw(st.lists(names, max_size=4, unique=True)):
        dtype = draw(dtype_names)
        shape = draw(shapes)
        begin = end + draw(BENDS)
        end = begin + math.prod(shape) * ITEMSIZE.get(dtype, 1) + draw(BENDS)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    meta = draw(st.none() | metadata | json_values)
    if meta is not None:
        header["__metadata__"] = meta
    size = max(end + draw(BENDS), 0)
    return header, draw(st.binary(min_size=size, max_size=size))


@settings(FAST, max_examples=examples(500))
@given(st.tuples(headers, st.binary(max_size=64)) | laid_out())
def test_a_forged_header_decodes_to_what_it_says_or_is_refused(forged):
    header, data = forged
    decoded = decode_or_refuse(body_of(header, data))
    if decoded is None:
        return
    got, meta = decoded
    assert meta == (header.get("__metadata__") or {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert set(got) == set(header) - {"__metadata__"}
    covered = 0
    for name, t in got.items():
        entry = header[name]
        begin, end = entry["data_offsets"]
        assert t.dtype == DTYPES[entry["dtype"]] and list(t.shape) == entry["shape"]
        assert raw_bytes(t) == data[begin:end]
        covered += end - begin
    assert covered == len(data)  # no overlap, no gap


def test_a_declared_two_gigabyte_tensor_is_refused_before_anything_is_allocated(monkeypatch):
    def must_not_build(*_args: object) -> None:
        raise AssertionError("a forged header reached the step that makes the tensors")

    monkeypatch.setattr(wire, "_views", must_not_build)
    huge = {"t": {"dtype": "F32", "shape": [2**29], "data_offsets": [0, 2**31]}}
    with pytest.raises(TensorPayloadError, match="2147483648"):
        decode_tensors(body_of(huge, b"\0" * 16))
    wide = {"t": {"dtype": "U8", "shape": [2**31], "data_offsets": [0, 2**31]}}
    with pytest.raises(TensorPayloadError):
        decode_tensors(body_of(wide, b"\0" * 16))
    with pytest.raises(TensorPayloadError, match="over the limit"):
        decode_tensors(struct.pack("<Q", 2**63) + b"{}")


@pytest.mark.parametrize(
    "header, data",
    [
        (  # the same bytes twice
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            },
            b"abcd",
        ),
        (  # half over each other
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"abcdef",
        ),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"abcd"),  # a gap
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"abcd"),  # shape x size
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"abc"),  # past the end
        ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"a"),  # sub-byte dtype
        ({"a": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [0, 1]}}, b"a"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"a"),
        ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"a"),
        ({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}, b"a"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 0}}, b"a"),
        ({"__metadata__": {"step": 3}}, b""),
        ({"__metadata__": {"step": {"nested": "x"}}}, b""),
        ({"__metadata__": ["step"]}, b""),
        ([1, 2], b""),
    ],
)
def test_each_kind_of_forged_header_is_refused(header, data):
    with pytest.raises(TensorPayloadError):
        decode_tensors(body_of(header, data))


def test_a_tensor_named_like_the_metadata_is_refused():
    with pytest.raises(TensorPayloadError):
        decode_tensors(encode_tensors({"__metadata__": torch.zeros(2)}))


def test_a_zero_dimensional_tensor_and_metadata_round_trip():
    got, meta = decode_tensors(encode_tensors({"step": torch.tensor(7)}, {"round": "3"}))
    assert got["step"].shape == () and got["step"].item() == 7 and meta == {"round": "3"}
    assert decode_tensors(b"") == ({}, {})
