"""``distml preprocess`` from the command line, and the coordinator's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from distml.cli.main import app
from distml.data.preprocess import CsvSource, plan, read_table
from distml.data.preprocess.coordinator import Coordinator, create_coordinator_app
from distml.data.preprocess.job import describe_job
from distml.data.preprocess.output import OutputDir
from distml.data.preprocess.queue import ShardQueue

HERE = Path(__file__).resolve().parent
FEATURES = f"{HERE / 'transforms.py'}:features"
TOKEN = "coordinator-token-0123456789"


@pytest.fixture
def csv(tmp_path) -> Path:
    n = 500
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(n),
            "a": rng.normal(size=n),
            "b": rng.normal(size=n),
            "label": np.arange(n) % 3,
        }
    )
    pacsv.write_csv(table, tmp_path / "rows.csv")
    return tmp_path / "rows.csv"


def test_the_command_writes_the_job_and_prints_its_manifest(csv, tmp_path):
    out = tmp_path / "out"
    args = ["preprocess", str(csv), "--transform", FEATURES, "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--blocksize-mb", "0.004", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout.strip().splitlines()[-1])
    assert manifest["rows"] == 500 and len(manifest["parts"]) > 2
    assert read_table(out)["id"].to_pylist() == list(range(500))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--transform", "nowhere.py:f"], "no file nowhere.py"),
        (["--transform", "transform_without_colon"], "module:function"),
        (["--format", "sql", "--transform", FEATURES], "--sql-table and --sql-key"),
        (["--format", "xml", "--transform", FEATURES], "--format is one of"),
    ],
)
def test_bad_usage_exits_2_with_one_message(csv, tmp_path, extra, message):
    args = ["preprocess", str(csv), "--out", str(tmp_path / "o"), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_missing_input_and_a_foreign_folder_exit_2(tmp_path):
    result = CliRunner().invoke(
        app, ["preprocess", str(tmp_path / "none.csv"), "--transform", FEATURES, "--out", "o"]
    )
    assert result.exit_code == 2 and "no CSV file" in result.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep me")
    (tmp_path / "in.csv").write_text("id,a,b,label\n0,1,2,0\n")
    result = CliRunner().invoke(
        app,
        [
            "preprocess",
            str(tmp_path / "in.csv"),
            "--transform",
            FEATURES,
            "--out",
            str(tmp_path / "busy"),
        ],
    )
    assert result.exit_code == 2 and "not empty" in result.output
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep me"


def test_the_coordinator_authenticates_and_validates(csv, tmp_path):
    source = CsvSource(path=str(csv), blocksize=2048)
    shards = plan(source)
    output = OutputDir(tmp_path / "out", describe_job(source, FEATURES, shards))
    coordinator = Coordinator(ShardQueue(shards, output.open()), output, FEATURES)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_coordinator_app(coordinator, TOKEN)) as client:
        assert client.post("/v1/claim", json={"worker": "w"}).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token-at-all"}
        assert client.post("/v1/claim", json={"worker": "w"}, headers=wrong).status_code == 401
        for body in ({}, {"worker": "../etc"}, {"worker": "w", "extra": 1}):
            assert client.post("/v1/claim", json=body, headers=auth).status_code == 422
        bad_attempt = {"worker": "w", "attempt": "../../x"}
        assert client.post("/v1/complete", json=bad_attempt, headers=auth).status_code == 422
        work = client.post("/v1/claim", json={"worker": "w"}, headers=auth).json()
        assert work["action"] == "work" and work["shard"]["id"] == 0
        # completing an attempt it does not hold (another worker's, or with no file) keeps nothing
        other = {"worker": "intruder", "attempt": work["attempt"]}
        assert client.post("/v1/complete", json=other, headers=auth).json() == {"kept": False}
        assert client.get("/healthz", headers=auth).json()["done"] == 0
        assert coordinator.queue.error is None
