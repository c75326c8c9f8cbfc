"""Oracles of the parameter server, with real shard and worker processes over loopback:
BSP with N workers of batch B = synchronous SGD with batch N*B; SSP with s = 0 = BSP; ASP with
one worker = sequential SGD."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import distml
from conftest import rel_err

sys.path.insert(0, str(Path(__file__).parent.parent / "parallel"))
from dp_oracle import BATCH, single_process, train_worker  # noqa: E402

pytestmark = pytest.mark.distributed  # every test starts processes

STEPS = 12


def launch_ps(tmp_path, name: str, nproc: int, momentum: float, **ps) -> tuple[dict, dict]:
    out = distml.launch(
        train_worker,
        STEPS,
        BATCH,
        momentum,
        nproc=nproc,
        runs_dir=tmp_path,
        run_name=name,
        strategy={"name": "ps"},
        ps=ps,
        telemetry={"progress": False},
    )
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    return out, summary


def test_bsp_with_n_workers_equals_sync_sgd_with_batch_nb(tmp_path):
    out, summary = launch_ps(tmp_path, "bsp", 2, 0.9, consistency="bsp", servers=2)
    oracle = single_process(STEPS, 2 * BATCH, momentum=0.9)
    assert rel_err(out["params"], oracle) <= 1e-5
    # The server's final parameters, exported by the job, are the same ones.
    assert summary["param_norm"] == pytest.approx(float(oracle.double().norm()), rel=1e-6)
    ps = summary["ps"]
    assert ps["versions"] == [STEPS, STEPS]  # one optimizer step per BSP step on each shard
    assert ps["staleness"] == {"0": 2 * STEPS * 2}  # 2 shards x 2 workers x STEPS, all fresh
    assert sum(s["param_bytes"] for s in ps["shards"]) == 4 * oracle.numel()
    assert summary["comm_bytes"]["ps_push"] > 0 and summary["comm_bytes"]["ps_pull"] > 0


def test_ssp_with_bound_zero_equals_bsp(tmp_path):
    """Against BSP's own oracle, synchronous SGD with batch N*B (the test above holds BSP to it),
    for plain SGD: SSP applies each worker's push on its own, which with momentum is not one
    step on their average."""
    ssp, summary = launch_ps(tmp_path, "ssp0", 2, 0.0, consistency="ssp", staleness=0)
    assert rel_err(ssp["params"], single_process(STEPS, 2 * BATCH, momentum=0.0)) <= 1e-5
    assert summary["ps"]["versions"] == [2 * STEPS]  # SSP applies each push on its own


def test_asp_with_one_worker_equals_sequential_sgd(tmp_path):
    out, summary = launch_ps(tmp_path, "asp1", 1, 0.9, consistency="asp")
    assert rel_err(out["params"], single_process(STEPS, BATCH, momentum=0.9)) <= 1e-5
    assert summary["ps"]["staleness"] == {"0": STEPS}
