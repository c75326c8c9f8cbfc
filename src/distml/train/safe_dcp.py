"""Reading a DCP checkpoint without running code from it.

DCP's metadata file is a pickle, and a pickle is a program: unpickled with :mod:`pickle`, even
behind a ``find_class`` that admits only some modules, it can reach any function (protocol 4
resolves dotted names such as ``os.system`` inside an admitted module) and call it. So the
metadata is not unpickled here. Its opcodes are read with :func:`pickletools.genops`, which
decodes without executing, and interpreted by a small machine that knows only plain data (ints,
strings, lists, tuples, dicts) and the exact names DCP's metadata holds. Those names are
kept as inert records, never called; once the whole file is read, the records are checked field
by field and the real metadata objects are built from the checked values. Anything else is a
:class:`CheckpointError`, which the command line reports as bad input (exit 2).

DCP's default planner also reads non-tensor items (an optimizer's lr, betas...) with
``torch.load(weights_only=False)``; :class:`SafeLoadPlanner` reads them with
``weights_only=True``.
"""

from __future__ import annotations

import io
import pickletools
import re
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from distml.config import ConfigError

MAX_METADATA_BYTES = 64 * 2**20  # a GPT of 100 tensors over 4 ranks writes ~120 KB
MAX_DIMS = 64
MAX_EXTENT = 2**62

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

# The classes DCP pickles into ``.metadata`` (listed from checkpoints that torch 2.13 saved under
# every layout distml uses), each with the fields BUILD may set; NEWOBJ makes an empty one.
_DATACLASSES: dict[str, frozenset[str]] = {
    f"{_MD}.Metadata": frozenset(
        {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}
    ),
    f"{_MD}.TensorStorageMetadata": frozenset({"properties", "size", "chunks"}),
    f"{_MD}.BytesStorageMetadata": frozenset(),
    f"{_MD}.ChunkStorageMetadata": frozenset({"offsets", "sizes"}),
    f"{_MD}.TensorProperties": frozenset(),  # its state is a tuple (its __getstate__)
    f"{_MD}.StorageMeta": frozenset({"checkpoint_id", "save_id", "load_id", "modules"}),
    f"{_MD}.MetadataIndex": frozenset({"fqn", "offset", "index"}),
    f"{_FS}._StorageInfo": frozenset(
        {"relative_path", "offset", "length", "transform_descriptors"}
    ),
}
# The callables whose REDUCE DCP's metadata holds; each is interpreted by this module, not called.
_PATH_CLASSES = {
    f"{module}.{name}": pure
    for module in ("pathlib", "pathlib._local")
    for name, pure in {
        "PosixPath": PurePosixPath,
        "PurePosixPath": PurePosixPath,
        "WindowsPath": PureWindowsPath,
        "PureWindowsPath": PureWindowsPath,
    }.items()
}
_LAYOUT = "torch.serialization._get_layout"  # its argument is a name, e.g. "torch.strided"
_MEMORY = f"{_MD}._MEM_FORMAT_ENCODING"
_CALLABLES = frozenset({"torch.Size", _LAYOUT, _MEMORY, *_PATH_CLASSES})
_DTYPES = {name: v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.dtype)}
_LAYOUTS = {
    f"torch.{name}": v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.layout)
}
# TensorProperties pickles its memory format as this enum's value (torch's _MEM_FORMAT_ENCODING).
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read safely or does not hold what DCP writes."""


@dataclass(frozen=True)
class _Global:
    """A name the metadata refers to, admitted but not imported."""

    name: str


@dataclass(eq=False)
class _Record:
    """An object the metadata builds, kept as data until it is checked: ``args`` of a REDUCE,
    ``state`` of a BUILD. Hashed by identity, as a dict key of the pickle may be one."""

    kind: str
    args: tuple = ()
    state: Any = None
    built: bool = False


class _Machine:
    """The pickle machine reduced to plain data and inert records (see the module docstring).
    It knows only the opcodes that ``pickle.dump`` writes for DCP's metadata (protocols 2 to 5)."""

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.frame_end: int | None = None

    def run(self, data: bytes) -> Any:
        for opcode, arg, pos in pickletools.genops(data):
            self.check_frame(pos)
            if opcode.name == "STOP":
                self.check_frame(pos + 1)
                if len(self.stack) != 1 or self.marks:
                    raise CheckpointError("the pickle does not end with one object")
                return self.stack[0]
            if opcode.name == "FRAME":
                self.open_frame(pos + 9 + arg, len(data))  # after FRAME and its 8-byte length
                continue
            step = getattr(self, f"op_{opcode.name}", None)
            if step is None:
                raise CheckpointError(f"opcode {opcode.name} is not allowed")
            step(arg)
        raise CheckpointError("the pickle has no STOP")  # pragma: no cover (genops stops first)

    def check_frame(self, pos: int) -> None:
        """:func:`pickletools.genops` reads across frames; :mod:`pickle` refuses an opcode that
        crosses the end of its frame, and so does this."""
        if self.frame_end is None or pos < self.frame_end:
            return
        if pos > self.frame_end:
            raise CheckpointError("an opcode of the pickle crosses the end of its frame")
        self.frame_end = None

    def open_frame(self, end: int, size: int) -> None:
        if self.frame_end is not None:
            raise CheckpointError("the pickle opens a frame inside a frame")
        if end > size:
            raise CheckpointError("a frame of the pickle runs past the end of the file")
        self.frame_end = end

    def pop(self) -> Any:
        """The top of the stack; as in :mod:`pickle`, nothing below the last mark is visible."""
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise CheckpointError("the pickle reads past its stack")
        return self.stack.pop()

    def top(self) -> Any:
        value = self.pop()
        self.stack.append(value)
        return value

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise CheckpointError("the pickle closes a mark it never opened")
        start = self.marks.pop()
        items, self.stack[start:] = self.stack[start:], []
        return items

    def container(self, kind: type) -> Any:
        target = self.top()
        if type(target) is not kind:
            raise CheckpointError(f"the pickle adds items to a {type(target).__name__}")
        return target

    def op_PROTO(self, arg: int) -> None:
        if not 2 <= arg <= 5:
            raise CheckpointError(f"pickle protocol {arg} is not one DCP writes")

    def op_MARK(self, arg: None) -> None:
        self.marks.append(len(self.stack))

    def push(self, arg: Any) -> None:
        self.stack.append(arg)

    op_BININT = op_BININT1 = op_BININT2 = op_LONG1 = op_SHORT_BINUNICODE = op_BINUNICODE = push

    def op_NONE(self, arg: None) -> None:
        self.stack.append(None)

    def op_NEWTRUE(self, arg: None) -> None:
        self.stack.append(True)

    def op_NEWFALSE(self, arg: None) -> None:
        self.stack.append(False)

    def op_EMPTY_LIST(self, arg: None) -> None:
        self.stack.append([])

    def op_EMPTY_TUPLE(self, arg: None) -> None:
        self.stack.append(())

    def op_EMPTY_DICT(self, arg: None) -> None:
        self.stack.append({})

    def op_TUPLE(self, arg: None) -> None:
        self.stack.append(tuple(self.pop_mark()))

    def op_TUPLE1(self, arg: None) -> None:
        self.stack.append((self.pop(),))

    def op_TUPLE2(self, arg: None) -> None:
        second = self.pop()
        self.stack.append((self.pop(), second))

    def op_TUPLE3(self, arg: None) -> None:
        third, second = self.pop(), self.pop()
        self.stack.append((self.pop(), second, third))

    def op_APPEND(self, arg: None) -> None:
        value = self.pop()
        self.container(list).append(value)

    def op_APPENDS(self, arg: None) -> None:
        items = self.pop_mark()
        self.container(list).extend(items)

    def op_SETITEM(self, arg: None) -> None:
        value, key = self.pop(), self.pop()
        self.container(dict)[key] = value

    def op_SETITEMS(self, arg: None) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise CheckpointError("a dict of the pickle has a key without a value")
        self.container(dict).update(zip(items[::2], items[1::2], strict=True))

    def op_MEMOIZE(self, arg: None) -> None:
        self.memo[len(self.memo)] = self.top()

    def op_BINPUT(self, arg: int) -> None:
        self.memo[arg] = self.top()

    def op_BINGET(self, arg: int) -> None:
        if arg not in self.memo:
            raise CheckpointError(f"the pickle reads memo {arg}, which it never wrote")
        self.stack.append(self.memo[arg])

    op_LONG_BINPUT, op_LONG_BINGET = op_BINPUT, op_BINGET

    def op_GLOBAL(self, arg: str) -> None:
        module, _, name = arg.partition(" ")
        self.stack.append(_admit(module, name))

    def op_STACK_GLOBAL(self, arg: None) -> None:
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise CheckpointError("the pickle names a global by something else than strings")
        self.stack.append(_admit(module, name))

    def op_REDUCE(self, arg: None) -> None:
        args, func = self.pop(), self.pop()
        if not isinstance(func, _Global) or func.name not in _CALLABLES:
            raise CheckpointError(f"the pickle calls {_describe(func)}")
        if type(args) is not tuple:
            raise CheckpointError(f"the pickle calls {func.name} with {_describe(args)}")
        self.stack.append(_Record(func.name, args=args))

    def op_NEWOBJ(self, arg: None) -> None:
        args, cls = self.pop(), self.pop()
        if not isinstance(cls, _Global) or cls.name not in _DATACLASSES:
            raise CheckpointError(f"the pickle makes an instance of {_describe(cls)}")
        if args != ():
            raise CheckpointError(f"the pickle makes a {cls.name} with arguments")
        self.stack.append(_Record(cls.name))

    def op_BUILD(self, arg: None) -> None:
        state = self.pop()
        target = self.top()
        if not isinstance(target, _Record) or target.kind not in _DATACLASSES or target.built:
            raise CheckpointError(f"the pickle sets the state of {_describe(target)}")
        target.state, target.built = state, True


def _admit(module: str, name: str) -> Any:
    """A global of the metadata: a dtype (a constant), or the tag of an exact admitted name."""
    if module == "torch" and name in _DTYPES:
        return _DTYPES[name]
    full = f"{module}.{name}"
    if "." in name or (full not in _DATACLASSES and full not in _CALLABLES):
        raise CheckpointError(f"the pickle refers to {full}, which DCP metadata never holds")
    return _Global(full)


def _describe(value: Any) -> str:
    if isinstance(value, _Global):
        return value.name
    return f"a {value.kind}" if isinstance(value, _Record) else f"a {type(value).__name__}"


def _fields(value: Any, kind: str, what: str) -> dict[str, Any]:
    """The BUILD state of a record of ``kind``: a dict of the fields DCP writes for it."""
    if not isinstance(value, _Record) or value.kind != kind:
        raise CheckpointError(f"{what} is {_describe(value)}, not a {kind.rsplit('.')[-1]}")
    state = {} if value.state is None else value.state
    if not isinstance(state, dict) or not set(state) <= _DATACLASSES[kind]:
        raise CheckpointError(f"{what} holds fields DCP does not write")
    return state


def _of_type(value: Any, kinds: Any, what: str) -> Any:
    """``value`` if it is one of ``kinds``; a bool is not an int here."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
        raise CheckpointError(f"{what} is {_describe(value)}")
    return value


def _optional(value: Any, kinds: Any, what: str) -> Any:
    return None if value is None else _of_type(value, kinds, what)


def _extent(value: Any, what: str) -> int:
    if not 0 <= _of_type(value, int, what) < MAX_EXTENT:
        raise CheckpointError(f"{what} is {value}, outside 0..2**62")
    return value


def _argument(value: Any, kind: str) -> Any:
    """The one argument of a REDUCE of ``kind``, or None."""
    if isinstance(value, _Record) and value.kind == kind and len(value.args) == 1:
        return value.args[0]
    return None


def _size(value: Any, what: str) -> torch.Size:
    dims = _argument(value, "torch.Size")
    if not isinstance(dims, tuple | list) or len(dims) > MAX_DIMS:
        raise CheckpointError(f"{what} is {_describe(value)}, not a torch.Size")
    return torch.Size([_extent(d, what) for d in dims])


def _properties(value: Any, what: str) -> TensorProperties:
    """TensorProperties pickles itself as a tuple (its ``__getstate__``)."""
    record = isinstance(value, _Record) and value.kind == f"{_MD}.TensorProperties"
    state = value.state if record else None
    if type(state) is not tuple or len(state) != 5:
        raise CheckpointError(f"{what}: properties are {_describe(value)}")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    layout, memory_format = _argument(layout, _LAYOUT), _argument(memory_format, _MEMORY)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{what}: dtype is {_describe(dtype)}")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise CheckpointError(f"{what}: layout is not one of torch's")
    if type(memory_format) is not int or memory_format not in _MEMORY_FORMATS:
        raise CheckpointError(f"{what}: memory format is not one of DCP's")
    return TensorProperties(
        dtype=dtype,
        layout=_LAYOUTS[layout],
        requires_grad=_of_type(requires_grad, bool, f"{what}: requires_grad"),
        memory_format=_MEMORY_FORMATS[memory_format],
        pin_memory=_of_type(pin_memory, bool, f"{what}: pin_memory"),
    )


def _tensor(value: Any, what: str) -> TensorStorageMetadata:
    state = _fields(value, f"{_MD}.TensorStorageMetadata", what)
    chunks = _of_type(state.get("chunks"), list, f"{what}: chunks")
    return TensorStorageMetadata(
        properties=_properties(state.get("properties"), what),
        size=_size(state.get("size"), f"{what}: size"),
        chunks=[_chunk(c, f"{what}: chunk {i}") for i, c in enumerate(chunks)],
    )


def _chunk(value: Any, what: str) -> ChunkStorageMetadata:
    state = _fields(value, f"{_MD}.ChunkStorageMetadata", what)
    return ChunkStorageMetadata(
        offsets=_size(state.get("offsets"), f"{what}: offsets"),
        sizes=_size(state.get("sizes"), f"{what}: sizes"),
    )


def _item(key: Any, value: Any) -> tuple[str, TensorStorageMetadata | BytesStorageMetadata]:
    key = _of_type(key, str, "a checkpoint key")
    if isinstance(value, _Record) and value.kind == f"{_MD}.BytesStorageMetadata":
        _fields(value, value.kind, key)
        return key, BytesStorageMetadata()
    return key, _tensor(value, key)


def _stored(key: Any, value: Any) -> tuple[MetadataIndex, _StorageInfo]:
    """Where an item's bytes are: a file of this checkpoint's folder, never a path elsewhere."""
    state = _fields(key, f"{_MD}.MetadataIndex", "a storage index")
    fqn = _of_type(state.get("fqn"), str, "a storage index's name")
    offset = state.get("offset")
    index = MetadataIndex(
        fqn=fqn,
        offset=None if offset is None else _size(offset, f"the offset of {fqn}"),
        index=_optional(state.get("index"), int, f"the index of {fqn}"),
    )
    info = _fields(value, f"{_FS}._StorageInfo", f"the storage of {fqn}")
    name = _of_type(info.get("relative_path"), str, f"the file of {fqn}")
    if not _FILE_NAME.fullmatch(name) or name.strip(".") == "":
        raise CheckpointError(f"{fqn} is stored in {name!r}, not in a file of the checkpoint")
    if info.get("transform_descriptors"):
        raise CheckpointError(f"{fqn} is stored with transforms, which distml never writes")
    where = _StorageInfo(
        relative_path=name,
        offset=_extent(info.get("offset"), f"the offset of {fqn}"),
        length=_extent(info.get("length"), f"the length of {fqn}"),
    )
    return index, where


def _storage_meta(value: Any) -> StorageMeta | None:
    if value is None:
        return None
    state = _fields(value, f"{_MD}.StorageMeta", "storage_meta")
    checkpoint_id = state.get("checkpoint_id")
    if isinstance(checkpoint_id, _Record) and checkpoint_id.kind in _PATH_CLASSES:
        parts = [_of_type(p, str, "checkpoint_id") for p in checkpoint_id.args]
        checkpoint_id = _PATH_CLASSES[checkpoint_id.kind](*parts)
    modules = _of_type(state.get("modules", []), list, "storage_meta.modules")
    return StorageMeta(
        checkpoint_id=_optional(checkpoint_id, str | PurePath, "checkpoint_id"),
        save_id=_optional(state.get("save_id"), str, "save_id"),
        load_id=_optional(state.get("load_id"), str, "load_id"),
        modules=[_of_type(m, str, "storage_meta.modules") for m in modules],
    )


def _planner_data(value: Any) -> dict[str, tuple[str | int, ...]] | None:
    """DCP's default planner keeps each flattened key's path in the state dict here."""
    if value is None:
        return None
    paths = _of_type(value, dict, "planner_data")
    for key, path in paths.items():
        _of_type(key, str, "a planner_data key")
        for part in _of_type(path, tuple | list, f"the planner_data of {key}"):
            _of_type(part, str | int, f"the planner_data of {key}")
    return {key: tuple(path) for key, path in paths.items()}


def decode_metadata(data: bytes) -> Metadata:
    """The :class:`Metadata` a DCP ``.metadata`` file holds, or :class:`CheckpointError`;
    nothing in ``data`` is executed (see the module docstring).

    >>> decode_metadata(b"\\x80\\x04N.")
    Traceback (most recent call last):
    ...
    distml.train.safe_dcp.CheckpointError: the metadata is a NoneType, not a Metadata
    """
    try:
        top = _Machine().run(data)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"not a pickle DCP writes: {exc}") from None
    state = _fields(top, f"{_MD}.Metadata", "the metadata")
    items = _of_type(state.get("state_dict_metadata"), dict, "state_dict_metadata")
    where = _of_type(state.get("storage_data"), dict, "storage_data")
    return Metadata(
        state_dict_metadata=dict(_item(k, v) for k, v in items.items()),
        planner_data=_planner_data(state.get("planner_data")),
        storage_data=dict(_stored(k, v) for k, v in where.items()),
        storage_meta=_storage_meta(state.get("storage_meta")),
        version=_optional(state.get("version"), str, "version"),
    )


def read_metadata_file(path: Path) -> Metadata:
    """:func:`decode_metadata` of the file at ``path``, refusing one past ``MAX_METADATA_BYTES``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path} is over {MAX_METADATA_BYTES >> 20} MiB")
    try:
        return decode_metadata(data)
    except CheckpointError as exc:
        raise CheckpointError(f"{path} is not a checkpoint distml can read safely: {exc}") from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """A DCP reader whose metadata is decoded as data (:func:`decode_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(Path(self.path) / ".metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner reads non-tensor items (an optimizer's lr, betas...) with
    ``torch.load(weights_only=False)``; this one admits only plain data."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
