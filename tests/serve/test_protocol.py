"""The Open Inference Protocol decoder, by properties: a well-formed request decodes to exactly
the tensor it describes; anything else -- wrong shapes, datatypes, data lengths, nesting, huge
or non-finite numbers, strings, arbitrary JSON or bytes -- raises ``ProtocolError`` with a 4xx
status, never another exception. The same for the binary tensor data extension (a JSON header
and raw bytes), whose answers ``tritonclient``'s own parser reads back."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.http import InferResult
from tritonclient.utils import triton_to_np_dtype

from conftest import examples
from distml.models.registry import TensorSpec
from distml.serve.protocol import (
    DTYPES,
    InferResponse,
    ProtocolError,
    decode_request,
    encode_response,
    parse_index_request,
    parse_request,
    request_schema,
    to_output,
)

MAX_ROWS = 16
COLS = 3
PROPERTY = settings(
    max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
FUZZ = settings(
    max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def spec_of(datatype: str) -> TensorSpec:
    return TensorSpec("x", datatype, (-1, COLS))


def values_of(datatype: str) -> st.SearchStrategy:
    """Values that lie within ``datatype``."""
    dtype = DTYPES[datatype]
    if datatype == "BOOL":
        return st.booleans()
    if dtype.is_floating_point:
        top = torch.finfo(dtype).max
        return st.floats(-top, top, allow_nan=False) | st.integers(-1000, 1000)
    info = torch.iinfo(dtype)
    return st.integers(info.min, info.max)


@st.composite
def valid_requests(draw) -> tuple[str, list[list], bool]:
    datatype = draw(st.sampled_from(sorted(DTYPES)))
    rows = draw(st.integers(1, MAX_ROWS))
    values = draw(
        st.lists(
            st.lists(values_of(datatype), min_size=COLS, max_size=COLS),
            min_size=rows,
            max_size=rows,
        )
    )
    return datatype, values, draw(st.booleans())


def encode(datatype: str, shape: list, data: object, **extra: object) -> bytes:
    item = {"name": "x", "shape": shape, "datatype": datatype, "data": data}
    return json.dumps({"inputs": [{**item, **extra}]}, allow_nan=True).encode()


def decode(body: bytes | str, datatype: str = "FP32") -> torch.Tensor:
    return decode_request(body, spec_of(datatype), MAX_ROWS)[1]


def assert_refused(body: bytes | str, datatype: str = "FP32") -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decode(body, datatype)
    assert 400 <= caught.value.status < 500
    return caught.value


@PROPERTY
@given(valid_requests())
def test_a_valid_request_decodes_to_its_tensor(case):
    datatype, rows, nested = case
    data = rows if nested else [v for row in rows for v in row]
    tensor = decode(encode(datatype, [len(rows), COLS], data), datatype)
    expected = torch.tensor(rows, dtype=DTYPES[datatype])
    assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
    assert torch.equal(tensor, expected)


@PROPERTY
@given(
    datatype=st.sampled_from(sorted(DTYPES)),
    shape=st.lists(st.integers(0, 2**40), min_size=1, max_size=10),
    length=st.integers(0, 64),
)
def test_a_shape_or_length_that_does_not_fit_is_refused(datatype, shape, length):
    fits = len(shape) == 2 and shape[1] == COLS and 1 <= shape[0] <= MAX_ROWS
    if fits and length == math.prod(shape):
        length += 1
    value = True if datatype == "BOOL" else 0
    assert_refused(encode(datatype, shape, [value] * length), datatype)


@PROPERTY
@given(
    datatype=st.sampled_from([d for d in sorted(DTYPES) if d != "BOOL"]),
    digits=st.integers(20, 500),
    negative=st.booleans(),
)
def test_an_integer_beyond_the_datatype_is_refused(datatype, digits, negative):
    huge = int("9" * digits) * (-1 if negative else 1)
    dtype = DTYPES[datatype]
    limit = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    if abs(huge) <= limit:  # a 20-digit integer is an FP32 value
        assert decode(encode(datatype, [1, COLS], [huge, 0, 0]), datatype)[0, 0] == float(huge)
    else:
        assert_refused(encode(datatype, [1, COLS], [huge, 0, 0]), datatype)


@PROPERTY
@given(
    datatype=st.sampled_from(["FP16", "FP32"]),
    scale=st.floats(1.0001, 1e300, allow_nan=False, allow_infinity=False),
)
def test_a_float_beyond_the_datatype_is_refused(datatype, scale):
    """1e39 is finite for Python but no FP32 value: it would reach the model as infinity."""
    beyond = torch.finfo(DTYPES[datatype]).max * scale
    error = assert_refused(encode(datatype, [1, COLS], [0.5, beyond, 0.5]), datatype)
    assert "range" in str(error) or "non-finite" in str(error)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "9" * 401])
@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_non_finite_and_overflowing_numbers_are_refused(token, datatype):
    body = (
        f'{{"inputs":[{{"name":"x","shape":[1,3],"datatype":"{datatype}","data":[1,{token},2]}}]}}'  # noqa: E501
    )
    assert_refused(body, datatype)


def test_values_that_torch_would_wrap_or_truncate_are_refused():
    assert_refused(encode("UINT8", [1, COLS], [-1, 0, 0]), "UINT8")
    assert_refused(encode("INT8", [1, COLS], [128, 0, 0]), "INT8")
    assert_refused(encode("INT64", [1, COLS], [2**63, 0, 0]), "INT64")
    assert_refused(encode("INT32", [1, COLS], [1.5, 0, 0]), "INT32")
    assert_refused(encode("FP32", [1, COLS], [True, 0, 0]), "FP32")


def test_rows_over_the_cap_are_refused_naming_it():
    body = encode("FP32", [MAX_ROWS + 1, COLS], [0.0] * (MAX_ROWS + 1) * COLS)
    error = assert_refused(body)
    assert error.status == 413 and f"limit of {MAX_ROWS} rows" in str(error)
    assert decode(encode("FP32", [MAX_ROWS, COLS], [0.0] * MAX_ROWS * COLS)).shape[0] == MAX_ROWS


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**500), 10**500)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=40,
)


NUMBERS = st.floats(-10, 10) | st.integers(-10, 10)
SMALL_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


def mostly(draw, right: object, *wrong: st.SearchStrategy) -> object:
    """``right`` two times in three, otherwise a draw from one of ``wrong``."""
    if draw(st.integers(0, 2)) < 2:
        return right
    return draw(st.one_of(*wrong))


@st.composite
def malformed_requests(draw) -> bytes:
    """Requests that are nearly right: each field well-formed, slightly off, or anything."""
    rows = draw(st.integers(0, MAX_ROWS + 1))
    shape = mostly(
        draw,
        [rows, COLS],
        st.lists(st.integers(-2, 20), max_size=4),
        st.lists(st.integers(0, 2**70), max_size=2),
        SMALL_JSON,
    )
    values = draw(st.lists(NUMBERS, min_size=rows * COLS, max_size=rows * COLS))
    if draw(st.booleans()):
        values = [values[i : i + COLS] for i in range(0, len(values), COLS)]
    data = mostly(draw, values, st.lists(SCALARS | NUMBERS, max_size=3 * COLS), SMALL_JSON)
    item = {
        "name": mostly(draw, "x", st.sampled_from(["y", ""]), SMALL_JSON),
        "shape": shape,
        "datatype": mostly(draw, "FP32", st.sampled_from(["FP64", "INT64", "FP8"]), SMALL_JSON),
        "data": data,
    }
    if draw(st.integers(0, 4)) == 0:
        del item[draw(st.sampled_from(sorted(item)))]
    body = mostly(draw, {"inputs": [item]}, st.just({"inputs": item}), st.just([item]))
    if isinstance(body, dict) and draw(st.integers(0, 4)) == 0:
        body[draw(st.sampled_from(["id", "parameters", "outputs", "evil"]))] = draw(SMALL_JSON)
    return json.dumps(body, allow_nan=True).encode()


def check_decoded_or_refused(body: bytes | str, length: str | None = None) -> None:
    """The one contract of the decoder: a tensor that fits the model, or a 4xx. With a header
    ``length``, ``body`` is a binary request (JSON header, then raw tensor bytes)."""
    try:
        tensor = decode(body) if length is None else decode_binary(body, length)
    except ProtocolError as exc:
        event(f"refused with {exc.status}")
        assert 400 <= exc.status < 500
        return
    event("decoded")
    assert tensor.dtype == torch.float32 and tensor.ndim == 2 and tensor.shape[1] == COLS
    assert 1 <= tensor.shape[0] <= MAX_ROWS and bool(torch.isfinite(tensor).all())


@FUZZ
@given(malformed_requests())
def test_a_malformed_request_decodes_right_or_is_refused(body):
    check_decoded_or_refused(body)


@FUZZ
@given(st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v, allow_nan=True)))
def test_any_bytes_or_json_decode_right_or_are_refused(body):
    check_decoded_or_refused(body)


@pytest.mark.parametrize("depth", [9, 100, 10_000, 200_000])
def test_deep_nesting_is_refused(depth):
    data = "[" * depth + "1" + "]" * depth
    assert_refused(f'{{"inputs":[{{"name":"x","shape":[1,1],"datatype":"FP32","data":{data}}}]}}')
    assert_refused(
        f'{{"inputs":[{{"name":"x","shape":[1,1],"datatype":"FP32","data":[1],"parameters":{{"a":{data}}}}}]}}'
    )  # noqa: E501


def test_the_declared_schema_is_self_contained():
    """The OpenAPI document's request body refers to nothing outside itself."""
    schema = request_schema()
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    item = schema["properties"]["inputs"]["items"]
    assert set(item["required"]) == {"name", "shape", "datatype"}  # data, or binary bytes
    assert "binary_data_size" in json.dumps(item["properties"]["parameters"])


# -- the binary tensor data extension -----------------------------------------------------------


def binary_body(
    datatype: str, shape: list, raw: bytes, size: int | None = None, **extra: object
) -> tuple[bytes, str]:
    """A request whose input's bytes follow its JSON header, and that header's length."""
    item = {"name": "x", "shape": shape, "datatype": datatype}
    item["parameters"] = {"binary_data_size": len(raw) if size is None else size}
    header = json.dumps({**extra, "inputs": [item]}).encode()
    return header + raw, str(len(header))


def decode_binary(body: bytes, header_length: str, datatype: str = "FP32") -> torch.Tensor:
    return decode_request(body, spec_of(datatype), MAX_ROWS, header_length)[1]


def assert_binary_refused(body: bytes, header_length: str, datatype: str = "FP32") -> str:
    with pytest.raises(ProtocolError) as caught:
        decode_binary(body, header_length, datatype)
    assert 400 <= caught.value.status < 500
    return str(caught.value)


def as_numpy(datatype: str, rows: list[list]) -> np.ndarray:
    """``rows`` as the numpy array tritonclient would send, little-endian."""
    return np.array(rows, dtype=np.dtype(triton_to_np_dtype(datatype)).newbyteorder("<"))


@PROPERTY
@given(valid_requests(), st.text(max_size=9))
def test_a_valid_binary_request_decodes_to_its_tensor(case, request_id):
    """Numpy's bytes of the array are the oracle; the id's length moves the bytes' alignment."""
    datatype, rows, _ = case
    array = as_numpy(datatype, rows)
    body, length = binary_body(datatype, list(array.shape), array.tobytes(), id=request_id)
    tensor = decode_binary(body, length, datatype)
    assert tensor.dtype == DTYPES[datatype] and list(tensor.shape) == list(array.shape)
    assert torch.equal(tensor, torch.from_numpy(array.astype(array.dtype.newbyteorder("="))))


def test_binary_data_is_read_in_place_when_aligned_and_copied_once_when_not():
    array = np.arange(2 * COLS, dtype="<f4").reshape(2, COLS)
    for request_id in ("", "a", "ab", "abc"):
        body, length = binary_body("FP32", [2, COLS], array.tobytes(), id=request_id)
        tensor = decode_binary(body, length)
        start = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
        shared = start <= tensor.data_ptr() < start + len(body)
        assert shared == ((start + int(length)) % 4 == 0), request_id
        assert tensor.data_ptr() % 4 == 0 and torch.equal(tensor, torch.from_numpy(array))


def test_a_binary_request_that_does_not_add_up_is_refused():
    raw = np.zeros((1, COLS), dtype="<f4").tobytes()
    body, length = binary_body("FP32", [1, COLS], raw)
    assert "past the end" in assert_binary_refused(body, str(len(body) + 1))
    for bad in ("-1", "1e3", " ", "", "0x10", "\u0661\u0662", "9" * 40):
        assert_binary_refused(body, bad)
    assert "add up to" in assert_binary_refused(body + b"\0", length)  # a byte left over
    assert "add up to" in assert_binary_refused(body[:-1], length)  # a byte short
    short, short_length = binary_body("FP32", [1, COLS], raw[:-4])
    assert "binary_data_size 8 is not 3 values" in assert_binary_refused(short, short_length)
    wrong, wrong_length = binary_body("FP32", [2, COLS], raw)  # the size of 1 row for 2
    assert "is not 6 values of 4 bytes" in assert_binary_refused(wrong, wrong_length)
    # The extension without its header: the bytes after the JSON are no JSON.
    assert_binary_refused(body, None)  # type: ignore[arg-type]
    assert decode_binary(body, length).shape == (1, COLS)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_binary_floats_are_refused(datatype, value):
    raw = as_numpy(datatype, [[0.5, value, 0.5]]).tobytes()
    body, length = binary_body(datatype, [1, COLS], raw)
    assert "non-finite" in assert_binary_refused(body, length, datatype)


def test_a_binary_bool_that_is_no_0_or_1_is_refused():
    body, length = binary_body("BOOL", [1, COLS], bytes([1, 2, 0]))
    assert "BOOL" in assert_binary_refused(body, length, "BOOL")
    body, length = binary_body("BOOL", [1, COLS], bytes([1, 0, 1]))
    assert decode_binary(body, length, "BOOL").tolist() == [[True, False, True]]


def test_bytes_shared_memory_classification_and_mixed_inputs_are_refused():
    body, length = binary_body("BYTES", [1, COLS], b"\3\0\0\0abc" * 3)
    assert "BYTES is not one distml's models take" in assert_binary_refused(body, length)
    item = {"name": "x", "shape": [1, COLS], "datatype": "FP32", "data": [0, 0, 0]}
    both = {"inputs": [{**item, "parameters": {"binary_data_size": 12}}]}
    raw = json.dumps(both).encode()
    assert "both data and binary_data_size" in assert_binary_refused(
        raw + b"\0" * 12, str(len(raw))
    )
    shm = {"inputs": [{**item, "parameters": {"shared_memory_region": "r"}}]}
    assert "shared-memory" in str(assert_refused(json.dumps(shm)))
    classify = {"inputs": [item], "outputs": [{"name": "y", "parameters": {"classification": 3}}]}
    assert "classification" in str(assert_refused(json.dumps(classify)))
    no_data = {"inputs": [{k: v for k, v in item.items() if k != "data"}]}
    assert "neither data nor binary_data_size" in str(assert_refused(json.dumps(no_data)))
    for size in ("true", "1.0", '"12"', "-1"):
        raw = f'{{"inputs":[{{"name":"x","shape":[1,3],"datatype":"FP32","parameters":{{"binary_data_size":{size}}}}}]}}'  # noqa: E501
        assert_binary_refused(raw.encode() + b"\0" * 12, str(len(raw)))


@st.composite
def malformed_binary_requests(draw) -> tuple[bytes, str]:
    """Nearly right binary requests: a size, shape, header length or tail slightly off, and
    tails of arbitrary bytes (NaN and infinity patterns among them)."""
    rows = draw(st.integers(0, MAX_ROWS + 1))
    datatype = mostly(draw, "FP32", st.sampled_from(["FP64", "BOOL", "BYTES", "FP16", "x"]))
    n = mostly(draw, 4 * COLS * rows, st.integers(0, 4 * COLS * (rows + 1)))
    tail = draw(st.binary(min_size=n, max_size=n))
    size = mostly(draw, len(tail), st.integers(-2, 10**30), st.just(True), SMALL_JSON)
    shape = mostly(draw, [rows, COLS], st.lists(st.integers(-2, 20), max_size=3), SMALL_JSON)
    item = {
        "name": "x",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }
    if draw(st.integers(0, 4)) == 0:
        item["data"] = draw(SMALL_JSON)
    header = json.dumps({"inputs": [item]}, allow_nan=True).encode()
    length = mostly(
        draw,
        str(len(header)),
        st.integers(-1, len(header) + len(tail) + 2).map(str),
        st.text(max_size=4),
    )
    return header + tail, length


@FUZZ
@given(malformed_binary_requests())
def test_a_malformed_binary_request_decodes_right_or_is_refused(case):
    body, length = case
    check_decoded_or_refused(body, length)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 310).map(str) | st.text(max_size=6))
def test_any_bytes_with_any_header_length_decode_right_or_are_refused(body, length):
    check_decoded_or_refused(body, length)


@PROPERTY
@given(valid_requests(), st.booleans())
def test_tritonclient_reads_the_encoded_answer_back(case, binary):
    """tritonclient's own parser of responses is the oracle of the encoder."""
    datatype, rows, _ = case
    tensor = torch.tensor(rows, dtype=DTYPES[datatype])
    spec = TensorSpec("y", datatype, (-1, COLS))
    response = InferResponse(model_name="m", outputs=[to_output(tensor, spec, binary)])
    body, length = encode_response(response, [tensor])
    assert (length is not None) == binary
    result = InferResult.from_response_body(body, header_length=length)
    got = result.as_numpy("y")
    assert got.dtype == triton_to_np_dtype(datatype) and got.shape == tuple(tensor.shape)
    assert np.array_equal(got, tensor.numpy())


@pytest.mark.parametrize(
    ("parameters", "outputs", "binary"),
    [
        (None, None, False),
        ({"binary_data_output": True}, None, True),
        (
            {"binary_data_output": True},
            [{"name": "y", "parameters": {"binary_data": False}}],
            False,
        ),
        (None, [{"name": "y", "parameters": {"binary_data": True}}], True),
        (None, [{"name": "y"}], False),
        ({"binary_data_output": True}, [{"name": "y"}], True),
        ({"binary_data_output": False, "priority": 1}, None, False),
    ],
)
def test_an_output_is_binary_as_the_request_asks(parameters, outputs, binary):
    item = {"name": "x", "shape": [1, COLS], "datatype": "FP32", "data": [0, 0, 0]}
    body = {"inputs": [item], "parameters": parameters, "outputs": outputs}
    request = parse_request(json.dumps({k: v for k, v in body.items() if v is not None}))
    assert request.wants_binary("y") == binary


def test_a_repository_index_request_is_empty_or_a_ready_filter():
    assert parse_index_request(b"").ready is None and parse_index_request(b" \n").ready is None
    assert parse_index_request(b'{"ready": true}').ready is True
    for bad in (b"{", b'{"ready": 1}', b'{"other": 1}', b"[]", b"\xff"):
        with pytest.raises(ProtocolError) as caught:
            parse_index_request(bad)
        assert caught.value.status == 400
