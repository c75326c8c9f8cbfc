"""``distml preprocess`` from the command line, and the coordinator's refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import child_pids, cmdline, remote_preprocess, wait_for
from distml.cli.main import app
from distml.data.preprocess import CsvSource, plan, read_table
from distml.data.preprocess.coordinator import Coordinator, create_coordinator_app
from distml.data.preprocess.output import OutputDir
from distml.data.preprocess.queue import ShardQueue
from distml.data.preprocess.worker import run_worker
from distml.jobs.preprocess import describe_job
from distml.net import TOKEN_ENV

HERE = Path(__file__).resolve().parent
FEATURES = f"{HERE / 'transforms.py'}:features"
FAULTY = f"{HERE / 'transforms.py'}:faulty"
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


@pytest.mark.distributed
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
        (["--transform", "nowhere.py:f"], "no such transform file: nowhere.py"),
        (["--transform", "transform_without_colon"], "is not MODULE:FUNCTION"),
        (["--transform", f"{HERE / 'transforms.py'}:nope"], "has no function 'nope'"),
        (["--format", "sql", "--transform", FEATURES], "--sql-table and --sql-key"),
        (["--format", "xml", "--transform", FEATURES], "--format is one of"),
    ],
)
def test_bad_usage_exits_2_with_one_message(csv, tmp_path, extra, message):
    args = ["preprocess", str(csv), "--out", str(tmp_path / "o"), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "code, error",
    [
        ("def f(table:\n", "SyntaxError"),
        ("import distml_no_such_module\n", "ModuleNotFoundError"),
        ("raise RuntimeError('broken on import')\n", "RuntimeError: broken on import"),
    ],
    ids=["syntax", "import", "raises"],
)
def test_a_transform_file_that_does_not_import_exits_2_naming_it(csv, tmp_path, code, error):
    bad = tmp_path / "bad.py"
    bad.write_text(code)
    args = ["preprocess", str(csv), "--transform", f"{bad}:f", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and str(bad) in result.output, result.output
    assert error in result.output and not (tmp_path / "o").exists()


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


def _remote_worker(url: str, out: Path, delay_s: float) -> subprocess.Popen:
    """``distml preprocess worker``, as on another machine: a process of its own, over HTTP."""
    env = {**os.environ, TOKEN_ENV: TOKEN, "PP_DELAY_S": str(delay_s), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "distml", "preprocess", "worker", "--coordinator", url]
    return subprocess.Popen(
        [*argv, "--transform", FAULTY, "--out", str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.distributed
def test_a_remote_worker_busy_when_the_job_ends_is_told_to_stop(csv, tmp_path, monkeypatch):
    """A slow remote worker holds shard 0 while a fast one does the rest and a backup copy of
    shard 0, which ends the job. The coordinator keeps serving until the slow worker has reported
    its late copy (counted as discarded) and been answered "stop": it exits 0 at once, instead of
    retrying for a minute against a closed port and exiting 1."""
    monkeypatch.delenv("PP_DELAY_S", raising=False)  # the fast worker, in this process
    job, thread = remote_preprocess(csv, FAULTY, tmp_path / "out", TOKEN, lease_s=10)
    slow = _remote_worker(job["url"], tmp_path / "out", delay_s=4)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        wait_for(
            lambda: httpx.get(job["url"] + "/healthz", headers=auth).json()["running"] == 1,
            60,
            "the slow worker's first shard",
        )
        run_worker(job["url"], TOKEN, FAULTY, tmp_path / "out", worker_id="fast")
        thread.join(30)
        assert "result" in job, "the job did not end"
        _, stderr = slow.communicate(timeout=15)  # well under the minute of retries
    finally:
        slow.kill()
    assert slow.returncode == 0, stderr
    stats = job["result"].stats
    assert (stats["speculative"], stats["discarded"]) == (1, 1)
    assert read_table(tmp_path / "out")["id"].to_pylist() == list(range(500))


@pytest.mark.distributed
def test_a_remote_worker_stopped_by_a_failed_job_exits_1_with_its_error(csv, tmp_path, monkeypatch):
    monkeypatch.setenv("PP_ALWAYS_FAIL_AT", "0")  # the first shard's first row is corrupt
    job, thread = remote_preprocess(csv, FAULTY, tmp_path / "out", TOKEN, max_attempts=2)
    worker = _remote_worker(job["url"], tmp_path / "out", delay_s=0)
    try:
        _, stderr = worker.communicate(timeout=60)
    finally:
        worker.kill()
    thread.join(30)
    assert "row 0 is corrupt" in job["error"]
    assert worker.returncode == 1, stderr
    assert "the job failed" in stderr and "row 0 is corrupt" in stderr


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_local_workers_die_with_a_killed_coordinator(csv, tmp_path):
    """``distml preprocess`` SIGKILLed mid-job leaves no worker behind: each gets SIGTERM from
    the kernel at once, instead of retrying the dead coordinator for a minute."""
    env = {**os.environ, "PP_DELAY_S": "30", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "distml", "preprocess", str(csv), "--transform", FAULTY]
    argv += ["--out", str(tmp_path / "out"), "--blocksize-mb", "0.004", "--workers", "2"]
    job = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    pids: list[int] = []

    def workers() -> list[int]:  # once a worker runs its own code, it is set to die with the job
        return [p for p in child_pids(job.pid) if b"distml.data.preprocess.worker" in cmdline(p)]

    try:
        wait_for(lambda: len(workers()) == 2, 120, "two local workers")
        pids = workers()
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        wait_for(lambda: not any(_alive(p) for p in pids), 5, "the workers to follow the job")
    finally:
        job.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
