"""Transforms the preprocessing tests run in real worker processes (named by file path, as a
user's would be). Faults are keyed by a shard's first ``id`` and fire once, on the attempt that
finds no marker file in ``PP_MARKERS``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa


def features(table: pa.Table) -> dict[str, np.ndarray]:
    """The oracle's transform: a row's features from its columns, deterministic."""
    a, b = table["a"].to_numpy(), table["b"].to_numpy()
    return {
        "id": table["id"].to_numpy(),
        "x": np.stack([a * 2 + b, np.tanh(a * b)], axis=1).astype(np.float32),
        "label": table["label"].to_numpy(),
    }


def _first_time(table: pa.Table, env: str) -> bool:
    at = os.environ.get(env)
    if at is None or table["id"][0].as_py() != int(at):
        return False
    marker = Path(os.environ["PP_MARKERS"]) / f"{env}-{at}"
    if marker.exists():
        return False
    marker.touch()
    return True


def faulty(table: pa.Table) -> dict[str, np.ndarray]:
    """``features``, with the faults the environment asks for:
    PP_KILL_AT: the worker SIGKILLs itself mid-shard; PP_RAISE_AT: the transform raises once;
    PP_SLOW_AT: the shard takes PP_SLOW_S seconds once; PP_ALWAYS_FAIL_AT: it raises every time;
    PP_DELAY_S: every shard takes that long."""
    time.sleep(float(os.environ.get("PP_DELAY_S", "0")))
    if _first_time(table, "PP_KILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    if _first_time(table, "PP_RAISE_AT"):
        raise RuntimeError("a transient failure")
    if _first_time(table, "PP_SLOW_AT"):
        time.sleep(float(os.environ["PP_SLOW_S"]))
    at = os.environ.get("PP_ALWAYS_FAIL_AT")
    if at is not None and table["id"][0].as_py() == int(at):
        raise ValueError(f"row {at} is corrupt")
    return features(table)


def schema_drift(table: pa.Table) -> dict[str, np.ndarray]:
    """A buggy transform: the first shard's ``label`` is an integer, the others' a float."""
    out = features(table)
    if table["id"][0].as_py() != 0:
        out["label"] = out["label"].astype(np.float64)
    return out


def file_sizes(table: pa.Table) -> dict[str, list]:
    paths = table["path"].to_pylist()
    return {"name": [Path(p).name for p in paths], "size": [Path(p).stat().st_size for p in paths]}
