"""Reading a DCP checkpoint without running code from it.

DCP's metadata file is a pickle, and its default planner reads non-tensor items with
``torch.load(weights_only=False)``. The reader here unpickles the metadata admitting only DCP's
own classes and a few plain ones; the planner reads other items with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

_SAFE_TORCH_NAMES = {"Size", "device"} | {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and name in _SAFE_TORCH_NAMES)
            or (module == "torch.serialization" and name == "_get_layout")  # a name lookup
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath"})
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice"})
        )
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """A DCP reader whose metadata load admits only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

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
