"""The transform of ``distml demo``'s preprocessing stage, in a module of its own: each
preprocessing worker imports it by name, and needs numpy for it, not the torch, training and
serving stack that :mod:`distml.lifecycle` imports."""

from __future__ import annotations

from typing import Any

import numpy as np

PIXELS = 64  # 8 x 8


def digit_features(table: Any) -> dict[str, np.ndarray]:
    """The preprocessing transform (each worker runs it on its shards): pixels scaled to
    [0, 1] as ``x``, the same image mirrored left to right as ``x_mirrored``."""
    pixels = np.stack([table[f"p{i}"].to_numpy() for i in range(PIXELS)], axis=1)
    x = (pixels / 16.0).astype(np.float32)
    mirrored = x.reshape(-1, 8, 8)[:, :, ::-1].reshape(-1, PIXELS)
    return {
        "id": table["id"].to_numpy(),
        "val": table["val"].to_numpy(),
        "label": table["label"].to_numpy(),
        "x": x,
        "x_mirrored": np.ascontiguousarray(mirrored),
    }
