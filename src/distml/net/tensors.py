"""Tensors on the wire: safetensors bytes, never pickle.

A payload is a flat ``name -> tensor`` mapping plus string metadata. Decoding checks what the
format itself cannot: the names and sizes a receiver expects are checked by the receiver.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save


class TensorPayloadError(ValueError):
    """A body that is not a valid safetensors payload."""


def encode_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    """``tensors`` as safetensors bytes (each made contiguous and moved to the CPU)."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return save(cpu, metadata=metadata)


def decode_tensors(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a safetensors payload; :class:`TensorPayloadError` if
    it is not one."""
    if not body:
        return {}, {}
    try:
        tensors = load(body)
        (size,) = struct.unpack("<Q", body[:8])
        header = json.loads(body[8 : 8 + size])
    except (SafetensorError, ValueError, RuntimeError, OverflowError, struct.error) as exc:
        raise TensorPayloadError(f"not a safetensors payload: {exc}") from None
    metadata = header.get("__metadata__") or {}
    return tensors, metadata
