"""Properties of the checkpoint metadata decoder, which reads files anyone may have crafted:
every input either decodes to exactly the metadata it holds or is refused with
CheckpointError, never another exception, and nothing in it ever runs."""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from conftest import examples, save_dcp_metadata
from distml.models import MLP
from distml.train.safe_dcp import CheckpointError, decode_metadata

MD = "torch.distributed.checkpoint.metadata"
# No clock in a property: a loaded machine must not turn a slow example into a failure.
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    """A file that exists only if a payload ran."""
    return tmp_path_factory.mktemp("payload") / "ran"


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    """What DCP writes for an MLP with SGD momentum state and a step counter."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 64)).sum().backward()
    optimizer.step()
    folder = tmp_path_factory.mktemp("mlp") / "step_00000001"
    return save_dcp_metadata(model, optimizer, folder)


def decoded_or_refused(data: bytes) -> Metadata | None:
    """The property every input must have: a Metadata, or CheckpointError (None here)."""
    try:
        metadata = decode_metadata(data)
    except CheckpointError:
        return None
    assert isinstance(metadata, Metadata)
    return metadata


_EXACT = {
    **{(MD, c.__name__): c for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata)},
    **{(MD, c.__name__): c for c in (ChunkStorageMetadata, TensorProperties, StorageMeta)},
    (MD, "MetadataIndex"): MetadataIndex,
    (MD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
}


class _ExactNames(pickle.Unpickler):
    """The reference: :mod:`pickle` itself, admitting the exact names DCP writes and no other."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _EXACT:
            return _EXACT[(module, name)]
        raise pickle.UnpicklingError(f"{module}.{name}")


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """``data`` with each edit applied: (0, i, b) sets byte i to b, (1, i, _) deletes byte i,
    (2, i, b) inserts b before byte i, (3, i, _) cuts the file at i."""
    out = bytearray(data)
    for kind, at, value in edits:
        i = at % max(len(out), 1)
        if kind == 0 and out:
            out[i] = value
        elif kind == 1 and out:
            del out[i]
        elif kind == 2:
            out.insert(i, value)
        elif kind == 3:
            del out[i:]
    return bytes(out)


edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=4
)


@settings(FAST, max_examples=examples(400))
@given(edits=edits)
def test_a_mutated_real_metadata_file_decodes_as_pickle_would_or_is_refused(real_metadata, edits):
    data = mutate(real_metadata, edits)
    metadata = decoded_or_refused(data)
    if metadata is not None:
        assert metadata == _ExactNames(io.BytesIO(data)).load()
        assert decode_metadata(pickle.dumps(metadata)) == metadata


@settings(FAST, max_examples=examples(500))
@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused_with_checkpoint_error(data):
    assert decoded_or_refused(data) is None


def _text(s: str) -> bytes:
    raw = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def vocabulary(marker: Path) -> list[bytes]:
    """Pieces of pickles: plain data, every admitted name, and payloads that would touch
    ``marker`` under plain pickle, in any order."""
    command = _text(f"touch {marker}")
    return [
        pickle.MARK,
        pickle.EMPTY_DICT,
        pickle.EMPTY_LIST,
        pickle.EMPTY_TUPLE,
        pickle.NONE,
        pickle.NEWTRUE,
        pickle.BININT1 + b"\x02",
        pickle.LONG1 + b"\x01\xff",
        _text("model.w"),
        _text("__0_0.distcp"),
        _text("state_dict_metadata"),
        _text("storage_data"),
        _text("chunks"),
        _text("__reduce__"),
        pickle.TUPLE,
        pickle.TUPLE1,
        pickle.TUPLE2,
        pickle.TUPLE3,
        pickle.APPEND,
        pickle.APPENDS,
        pickle.SETITEM,
        pickle.SETITEMS,
        pickle.MEMOIZE,
        pickle.BINGET + b"\x00",
        pickle.BINGET + b"\x01",
        pickle.REDUCE,
        pickle.NEWOBJ,
        pickle.BUILD,
        _global(MD, "Metadata"),
        _global(MD, "TensorStorageMetadata"),
        _global(MD, "ChunkStorageMetadata"),
        _global(MD, "TensorProperties"),
        _global(MD, "MetadataIndex"),
        _global(MD, "_MEM_FORMAT_ENCODING"),
        _global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        _global("torch", "Size"),
        _global("torch", "float32"),
        _global("torch.serialization", "_get_layout"),
        _global("pathlib", "PosixPath"),
        _global("torch.distributed.checkpoint.filesystem", "os.system") + command,
        _global("os", "system") + command,
        b"cposix\nsystem\n" + command,
        _global("builtins", "exec") + _text(f"open({str(marker)!r}, 'w')"),
    ]


@settings(FAST, max_examples=examples(1500))
@given(data=st.data())
def test_any_sequence_of_opcodes_runs_nothing_and_raises_only_checkpoint_error(marker, data):
    pieces = data.draw(st.lists(st.sampled_from(vocabulary(marker)), max_size=24))
    decoded_or_refused(pickle.PROTO + b"\x04" + b"".join(pieces) + pickle.STOP)
    assert not marker.exists()


dims = st.lists(st.integers(0, 2**40), max_size=4)
names = st.text(max_size=12)


@st.composite
def metadata_objects(draw: st.DrawFn) -> Metadata:
    """Metadata of the shape DCP writes: tensors of any dtype split in chunks, byte items,
    storage in files of the checkpoint folder."""
    dtypes = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]
    items: dict = {}
    where: dict = {}
    for i, key in enumerate(draw(st.lists(names, max_size=5, unique=True))):
        if draw(st.booleans()):
            items[key] = BytesStorageMetadata()
            length = draw(st.integers(0, 2**62 - 1))
            where[MetadataIndex(key)] = _StorageInfo(f"__{i}_0.distcp", i, length)
            continue
        size = torch.Size(draw(dims))
        properties = TensorProperties(
            dtype=draw(st.sampled_from(dtypes)),
            requires_grad=draw(st.booleans()),
            memory_format=draw(st.sampled_from([torch.contiguous_format, torch.channels_last])),
            pin_memory=draw(st.booleans()),
        )
        chunks = [
            ChunkStorageMetadata(torch.Size(draw(dims)), torch.Size(draw(dims)))
            for _ in range(draw(st.integers(0, 3)))
        ]
        items[key] = TensorStorageMetadata(properties, size, chunks)
        for j, chunk in enumerate(chunks):
            index = MetadataIndex(key, chunk.offsets, j)
            where[index] = _StorageInfo(f"__{j}_0.distcp", draw(st.integers(0, 2**50)), 8)
    meta = StorageMeta(
        draw(st.sampled_from([None, "id", PosixPath("/a/step_1")])),
        draw(st.none() | names),
        None,
        draw(st.lists(names, max_size=2)),
    )
    planner = {k: ("model", k) for k in items}
    return Metadata(items, planner, where, draw(st.none() | st.just(meta)), "1.0.0")


@settings(FAST, max_examples=examples(300))
@given(metadata=metadata_objects(), protocol=st.integers(2, 5))
def test_any_metadata_dcp_could_write_decodes_to_itself(metadata, protocol):
    assert decode_metadata(pickle.dumps(metadata, protocol=protocol)) == metadata


def test_the_vocabulary_holds_payloads_that_plain_pickle_runs(marker):
    """The payload pieces above are real: each runs under ``pickle.loads``."""
    for piece in vocabulary(marker)[-4:]:
        pickle.loads(pickle.PROTO + b"\x04" + piece + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
        assert marker.exists()
        marker.unlink()
