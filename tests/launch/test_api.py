"""distml.launch: return values, errors with their rank and traceback, nothing left behind."""

from __future__ import annotations

import os

import pytest

import distml
from conftest import child_pids


def report(ctx: distml.Context, base: int) -> dict:
    return {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "value": base + ctx.rank,
        "device": str(ctx.device),
        "mesh": ctx.mesh.mesh_dim_names,
    }


def explode_on_rank_one(ctx: distml.Context) -> None:
    if ctx.rank == 1:
        raise ValueError("bad value on purpose")


@pytest.mark.distributed
def test_returns_rank_zero_value(tmp_path):
    out = distml.launch(report, 40, nproc=3, runs_dir=tmp_path)
    assert out == {"rank": 0, "world": 3, "value": 40, "device": "cpu", "mesh": ("dp",)}


@pytest.mark.distributed
def test_worker_exception_names_rank_and_traceback_and_leaves_no_process(tmp_path):
    with pytest.raises(distml.LaunchError) as info:
        distml.launch(explode_on_rank_one, nproc=2, runs_dir=tmp_path)
    err = info.value
    assert [f.rank for f in err.failures] == [1]
    message = str(err)
    assert "rank 1" in message
    assert "ValueError: bad value on purpose" in message
    assert "explode_on_rank_one" in message  # the original traceback, not just the message
    assert child_pids(os.getpid()) == []


def test_bad_settings_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(distml.config.ConfigError, match="nproc"):
        distml.launch(report, 0, nproc=0, runs_dir=tmp_path)
    assert not any(tmp_path.iterdir())
