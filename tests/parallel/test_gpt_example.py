"""examples/gpt/train.py: the same parameters under any mesh as in one plain process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES, distml_cli

pytestmark = pytest.mark.distributed  # every test starts processes

SCRIPT = str(EXAMPLES / "gpt" / "train.py")
ARGS = ("--steps", "3", "--global-batch", "8", "--val-samples", "64")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("one")
    env = {**os.environ, "DISTML_RUN_NAME": "one", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, *ARGS],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads((cwd / "runs" / "one" / "summary.json").read_text())


@pytest.mark.parametrize("mesh", ["fsdp=2,tp=2", "dp=2,pp=2"])
def test_any_mesh_writes_the_param_norm_of_one_process(mesh, one_process, tmp_path):
    extra = ("--schedule", "gpipe") if "pp" in mesh else ()
    proc = distml_cli(
        "run",
        "--nproc",
        "4",
        "--mesh",
        mesh,
        *extra,
        "--run-name",
        "gpt",
        SCRIPT,
        *ARGS,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "runs" / "gpt" / "summary.json").read_text())
    assert summary["param_norm"] == pytest.approx(one_process["param_norm"], rel=1e-4)
    assert summary["eval"]["loss"] == pytest.approx(one_process["eval"]["loss"], rel=1e-4)
    assert (
        summary["layout"]["pp"]
        * summary["layout"]["tp"]
        * summary["layout"]["dp"]
        * summary["layout"]["fsdp"]
        == 4
    )
    for rank in summary["memory_per_rank"]:
        assert rank["params"] > 0 and rank["activations"] > 0
    if "pp" in mesh:
        assert summary["bubble"]["formula"] == pytest.approx(1 / 5)  # p = 2, m = 4
    assert set(summary["comm_bytes"]) >= ({"send", "recv"} if "pp" in mesh else {"all_reduce"})
