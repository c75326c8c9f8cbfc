"""A checkpoint's ``.metadata`` is decoded as data: what DCP writes reads back exactly, and a
crafted file runs nothing and is refused with one error the command line reports as bad input."""

from __future__ import annotations

import inspect
import os
import pickle
import struct
import sys
import warnings
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
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

import distml
from conftest import distml_cli, distml_invoke, save_dcp_metadata
from distml.config import ConfigError, GPTConfig
from distml.models import GPT, DigitsCNN
from distml.train import safe_dcp
from distml.train.checkpoint import checkpoint_keys, load_weights
from distml.train.safe_dcp import CheckpointError, SafeFileSystemReader, decode_metadata


def _text(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def call(module: str, name: str, arg: str, protocol: int = 4) -> bytes:
    """A pickle that calls ``module.name(arg)``: what ``pickle.loads`` would run."""
    if protocol >= 4:
        head = pickle.PROTO + bytes([protocol]) + _text(module) + _text(name) + pickle.STACK_GLOBAL
    else:
        head = pickle.PROTO + bytes([protocol]) + b"c" + f"{module}\n{name}\n".encode()
    return head + _text(arg) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file that exists only if a payload ran."""
    return tmp_path / "payload-ran"


def shell(marker: Path) -> str:
    return f"touch {marker}"


def python(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def refused(data: bytes, tmp_path: Path, match: str | None = None) -> CheckpointError:
    """``data`` as the ``.metadata`` of a checkpoint folder is refused by the reader DCP uses."""
    folder = tmp_path / "step_00000001"
    folder.mkdir(exist_ok=True)
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError, match=match) as info:
        SafeFileSystemReader(folder).read_metadata()
    assert isinstance(info.value, ConfigError)  # the command line's exit 2
    return info.value


# What DCP writes reads back exactly.


def saved_metadata(folder: Path) -> bytes:
    """The ``.metadata`` DCP writes for a GPT trained one AdamW step, with a step counter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1, hidden=16, heads=2, seq_len=8, vocab_size=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    return save_dcp_metadata(model, optimizer, folder)


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    return saved_metadata(tmp_path_factory.mktemp("gpt") / "step_00000001")


def sharded_metadata() -> Metadata:
    """Metadata as a save sharded over two ranks writes it: chunks, offsets, a path id."""
    properties = TensorProperties(dtype=torch.bfloat16, requires_grad=True, pin_memory=True)
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0, 0]), torch.Size([4, 3, 2])),
        ChunkStorageMetadata(torch.Size([4, 0, 0]), torch.Size([4, 3, 2])),
    ]
    return Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(properties, torch.Size([8, 3, 2]), chunks),
            "optim.param_groups.0.lr": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "optim.param_groups.0.lr": ("optim", 0)},
        storage_data={
            MetadataIndex("model.w", [4, 0, 0], 1): _StorageInfo("__1_0.distcp", 2**40, 96),
            MetadataIndex("optim.param_groups.0.lr"): _StorageInfo("__0_0.distcp", 0, 11),
        },
        storage_meta=StorageMeta(PosixPath("/somewhere/step_1"), "a-save-id", None, ["m"]),
        version="1.0.0",
    )


def test_what_dcp_writes_decodes_to_what_pickle_reads(real_metadata):
    decoded = decode_metadata(real_metadata)
    assert decoded == pickle.loads(real_metadata)  # the file this test wrote itself
    kinds = {type(v) for v in decoded.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata, BytesStorageMetadata}  # tensors and an lr
    assert "optim.state.0.exp_avg" in decoded.state_dict_metadata


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_sharded_metadata_decodes_in_every_protocol_pickle_dump_may_use(protocol):
    expected = sharded_metadata()
    assert decode_metadata(pickle.dumps(expected, protocol=protocol)) == expected


def test_load_weights_reads_a_real_checkpoint_through_the_decoder(tmp_path):
    torch.manual_seed(1)
    saved = DigitsCNN()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path / "step_1", no_dist=True)
    model = DigitsCNN()
    load_weights(model, tmp_path / "step_1")
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters(), strict=True)
    )
    assert checkpoint_keys(tmp_path / "step_1") == {f"model.{k}" for k in saved.state_dict()}


# Names: only exact ones, never a dotted one.

PAYLOADS = [
    ("torch.distributed.checkpoint.filesystem", "os.system", shell),
    ("torch.distributed.checkpoint.metadata", "os.system", shell),
    ("torch.distributed.checkpoint", "filesystem.os.system", shell),
    ("torch", "serialization.os.system", shell),
    ("pathlib", "os.system", shell),
    ("os", "system", shell),
    ("posix", "system", shell),
    ("subprocess", "getoutput", shell),
    ("builtins", "eval", python),
    ("builtins", "exec", python),
    ("torch.distributed.checkpoint.metadata", "torch.serialization.os.system", shell),
]


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize(("module", "name", "payload"), PAYLOADS)
def test_a_global_outside_the_exact_names_runs_nothing(
    tmp_path, marker, module, name, payload, protocol
):
    err = refused(call(module, name, payload(marker), protocol), tmp_path)
    assert f"{module}.{name}" in str(err)
    assert not marker.exists()


def test_the_crafted_pickles_do_run_under_plain_pickle(marker):
    """The payloads above are real: ``pickle.loads`` (as DCP's own reader) runs them."""
    pickle.loads(call("torch.distributed.checkpoint.filesystem", "os.system", shell(marker)))
    assert marker.exists()
    marker.unlink()
    pickle.loads(call("builtins", "eval", python(marker), protocol=2))
    assert marker.exists()


def modules_dcp_metadata_imports() -> list:
    """DCP's metadata and filesystem modules, the modules they import, and the modules of the
    names they import (``dataclass`` brings ``dataclasses``...)."""
    found = {dcp_metadata.__name__: dcp_metadata, dcp_filesystem.__name__: dcp_filesystem}
    for source in (dcp_metadata, dcp_filesystem):
        for value in vars(source).values():
            module = (
                value
                if inspect.ismodule(value)
                else sys.modules.get(getattr(value, "__module__", None) or "")
            )
            if module is not None:
                found[module.__name__] = module
    return sorted(found.values(), key=lambda m: m.__name__)


def test_every_name_of_every_module_dcp_metadata_imports_is_refused_or_inert(tmp_path, marker):
    """Each name any of those modules holds, called as ``pickle.loads`` would call it: refused
    at the name, or (the few exact names DCP writes) kept as a record that is never called."""
    tried = 0
    for module in modules_dcp_metadata_imports():
        names = [n for n in dir(module) if not n.startswith("__")]
        names += [f"{n}.system" for n in names] + ["os.system", "__builtins__.eval"]
        for name in names:
            with pytest.raises(CheckpointError):
                decode_metadata(call(module.__name__, name, shell(marker)))
            tried += 1
    assert tried > 1000 and not marker.exists()
    assert {"torch", "os", "dataclasses", "pathlib"} <= {
        m.__name__ for m in modules_dcp_metadata_imports()
    }


# Building objects: only records of plain dataclasses, checked before anything is made.


class _Boom:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_reduce_payload_alone_or_inside_real_metadata_runs_nothing(tmp_path, marker):
    refused(pickle.dumps(_Boom(shell(marker))), tmp_path, match="posix.system")
    inside = sharded_metadata()
    inside.version = _Boom(shell(marker))
    refused(pickle.dumps(inside), tmp_path, match="posix.system")
    inside = sharded_metadata()
    inside.state_dict_metadata["model.w"].chunks.append(_Boom(shell(marker)))
    refused(pickle.dumps(inside), tmp_path, match="posix.system")
    assert not marker.exists()


def _global(name: str) -> bytes:
    module, _, attr = name.rpartition(".")
    return _text(module) + _text(attr) + pickle.STACK_GLOBAL


PROTO4 = pickle.PROTO + b"\x04"
METADATA = "torch.distributed.checkpoint.metadata.Metadata"
TRICKS = {
    # REDUCE may call only torch.Size, the layout and memory-format lookups, and paths.
    "calls torch.distributed.checkpoint.metadata.Metadata": PROTO4
    + _global(METADATA)
    + pickle.EMPTY_TUPLE
    + pickle.REDUCE,
    # NEWOBJ may make only the dataclasses.
    "makes an instance of torch.Size": PROTO4
    + _global("torch.Size")
    + pickle.EMPTY_TUPLE
    + pickle.NEWOBJ,
    "with arguments": PROTO4 + _global(METADATA) + _text("x") + pickle.TUPLE1 + pickle.NEWOBJ,
    # BUILD may set the fields of a record only, never of a class or twice.
    "sets the state of torch.distributed": PROTO4
    + _global(METADATA)
    + pickle.EMPTY_DICT
    + _text("__reduce__")
    + _global("torch.Size")
    + pickle.SETITEM
    + pickle.BUILD,
    "sets the state of a": PROTO4
    + _global(METADATA)
    + pickle.EMPTY_TUPLE
    + pickle.NEWOBJ
    + pickle.EMPTY_DICT
    + pickle.BUILD
    + pickle.EMPTY_DICT
    + pickle.BUILD,
    "fields DCP does not write": PROTO4
    + _global(METADATA)
    + pickle.EMPTY_TUPLE
    + pickle.NEWOBJ
    + pickle.EMPTY_DICT
    + _text("__class__")
    + _global("torch.Size")
    + pickle.SETITEM
    + pickle.BUILD,
    "adds items to a": PROTO4 + _global("torch.Size") + pickle.MARK + _text("x") + pickle.APPENDS,
    # Opcodes that instantiate or look names up by other routes are not interpreted at all.
    "opcode INST": b"(ios\nsystem\n",
    "opcode OBJ": PROTO4 + pickle.MARK + _global("torch.Size") + pickle.OBJ,
    "opcode EXT1": PROTO4 + pickle.EXT1 + b"\x01",
    "opcode BINPERSID": PROTO4 + _text("x") + pickle.BINPERSID,
    "opcode NEWOBJ_EX": PROTO4 + _global(METADATA) + b")}" + pickle.NEWOBJ_EX,
    "protocol 1": pickle.PROTO + b"\x01",
}


@pytest.mark.parametrize("message", TRICKS)
def test_tricks_with_the_admitted_names_are_refused(tmp_path, message):
    before = dict(vars(Metadata))
    refused(TRICKS[message] + pickle.STOP, tmp_path, match=message)
    assert dict(vars(Metadata)) == before


@pytest.mark.parametrize(
    "name", ["../secret.distcp", "/etc/passwd", "sub/__0_0.distcp", "..", "", "a\x00b"]
)
def test_an_item_stored_outside_the_checkpoint_folder_is_refused(tmp_path, name):
    metadata = sharded_metadata()
    index = MetadataIndex("optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo(name, 0, 11)
    refused(pickle.dumps(metadata), tmp_path, match="not in a file of the checkpoint")


def test_transforms_and_bad_extents_are_refused(tmp_path):
    metadata = sharded_metadata()
    index = MetadataIndex("optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo("__0_0.distcp", 0, 11, ["zstd"])
    refused(pickle.dumps(metadata), tmp_path, match="transforms")
    metadata.storage_data[index] = _StorageInfo("__0_0.distcp", -1, 11)
    refused(pickle.dumps(metadata), tmp_path, match="outside")
    metadata = sharded_metadata()
    metadata.state_dict_metadata["model.w"].size = (8, 3, 2)  # a tuple, not a torch.Size
    refused(pickle.dumps(metadata), tmp_path, match="not a torch.Size")


def test_a_metadata_file_past_the_limit_is_refused_unread(tmp_path, monkeypatch, real_metadata):
    monkeypatch.setattr(safe_dcp, "MAX_METADATA_BYTES", len(real_metadata) - 1)
    refused(real_metadata, tmp_path, match="over")


# The paths that read a checkpoint: the command line, fine-tuning, resuming.


@pytest.fixture
def crafted_run(tmp_path: Path, marker: Path) -> Path:
    """A run folder whose latest checkpoint's metadata would run ``touch MARKER``."""
    checkpoint = tmp_path / "run" / "checkpoint"
    (checkpoint / "step_00000001").mkdir(parents=True)
    (checkpoint / "latest").write_text("step_00000001")
    payload = call("torch.distributed.checkpoint.filesystem", "os.system", shell(marker))
    (checkpoint / "step_00000001" / ".metadata").write_bytes(payload)
    return tmp_path / "run"


@pytest.mark.distributed
def test_distml_infer_on_a_crafted_checkpoint_exits_2_with_one_message(crafted_run, marker):
    out = crafted_run.parent / "x.safetensors"
    result = distml_cli("infer", str(crafted_run), "--nproc", "1", "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "os.system" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not marker.exists() and not out.exists()


def test_distml_finetune_on_a_crafted_checkpoint_exits_2(crafted_run, marker, tmp_path):
    result = distml_invoke("finetune", str(crafted_run), "--nproc", "1", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert "os.system" in result.output and "Traceback" not in result.output
    assert not marker.exists()


def resume(ctx: distml.Context) -> bool:
    model = torch.nn.Linear(2, 2)
    ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return ctx.load_checkpoint()


@pytest.mark.distributed
def test_resuming_from_a_crafted_checkpoint_fails_and_runs_nothing(crafted_run, marker):
    with pytest.raises(distml.LaunchError, match="CheckpointError") as info:
        distml.launch(
            resume,
            nproc=1,
            runs_dir=crafted_run.parent,
            run_name=crafted_run.name,
            telemetry={"progress": False},
        )
    assert "os.system" in str(info.value)
    assert not marker.exists()
