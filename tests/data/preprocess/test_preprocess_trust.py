"""What a preprocessing worker and its coordinator refuse from each other: a coordinator (or
whoever answers in its place) naming files outside the job, a worker reporting a completion
without its file; the coordinator's background lease expiry and its declared request bodies."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import remote_preprocess, wait_for
from distml.cli.main import app as cli
from distml.data.preprocess import (
    CsvSource,
    FilesSource,
    SourceError,
    plan,
    read_table,
)
from distml.data.preprocess.coordinator import Coordinator, create_coordinator_app
from distml.data.preprocess.output import TMP, OutputDir
from distml.data.preprocess.queue import ShardQueue
from distml.data.preprocess.scope import JobScope, RefusedAnswer
from distml.data.preprocess.worker import run_worker
from distml.jobs.preprocess import describe_job
from distml.net import TOKEN_ENV, BackgroundServer, LoopStopped

HERE = Path(__file__).resolve().parent
FEATURES = f"{HERE / 'transforms.py'}:features"
TOKEN = "coordinator-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROWS = 300


def _write_rows(path: Path, first_id: int = 0) -> Path:
    rng = np.random.default_rng(first_id)
    table = pa.table(
        {
            "id": np.arange(first_id, first_id + ROWS),
            "a": rng.normal(size=ROWS),
            "b": rng.normal(size=ROWS),
            "label": np.arange(ROWS) % 3,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pacsv.write_csv(table, path)
    return path


@pytest.fixture
def csv_job(tmp_path) -> tuple[OutputDir, list[dict]]:
    """A CSV job's output folder, as the coordinator leaves it before any shard is done, and
    its shards; next to it, outside the job, a CSV of the same columns (``secret.csv``)."""
    source = CsvSource(path=str(_write_rows(tmp_path / "input" / "rows.csv")), blocksize=2048)
    _write_rows(tmp_path / "secret.csv", first_id=10_000)
    shards = plan(source)
    output = OutputDir(tmp_path / "out", describe_job(source, FEATURES, shards))
    output.open()
    return output, shards


def _fake_coordinator(job: dict, answers: list[Any]) -> FastAPI:
    """A coordinator that answers ``answers`` to the claims (then "stop") and records every
    report in ``app.state.reports``."""
    app = FastAPI()
    app.state.reports = []

    @app.get("/v1/job")
    def job_answer() -> dict:
        return {"transform": FEATURES, "fingerprint": job["fingerprint"], "lease_s": 30.0}

    @app.post("/v1/claim")
    def claim() -> Any:
        return answers.pop(0) if answers else {"action": "stop", "error": None}

    @app.post("/v1/{route}")
    async def report(route: str, request: Request) -> dict:
        app.state.reports.append((route, await request.json()))
        return {"ok": True, "kept": False}

    return app


def _work(shard: dict, attempt: str, elsewhere: Path) -> dict:
    """A claim's answer, with the file the old protocol let a coordinator name."""
    return {"action": "work", "attempt": attempt, "shard": shard, "output": str(elsewhere)}


def _run_against(app: FastAPI, out: Path) -> int:
    with BackgroundServer(app) as server:
        return run_worker(server.url, TOKEN, FEATURES, out, worker_id="w")


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _escapes(tmp_path: Path, shard: dict) -> dict[str, dict]:
    secret = tmp_path / "secret.csv"
    return {
        "dotdot": {**shard, "path": str(tmp_path / "input" / ".." / "secret.csv")},
        "relative-dotdot": {**shard, "path": os.path.relpath(secret)},
        "absolute-elsewhere": {**shard, "path": str(secret)},
        "another-kind": {"id": 0, "kind": "parquet", "path": str(secret), "row_groups": [0]},
        "shard-out-of-range": {**shard, "id": 10_000},
    }


@pytest.mark.parametrize(
    "case",
    ["dotdot", "relative-dotdot", "absolute-elsewhere", "another-kind", "shard-out-of-range"],
)
def test_a_worker_refuses_a_shard_outside_its_jobs_input(csv_job, tmp_path, case):
    """The fake coordinator names a CSV outside the job's input (a readable one, of the same
    columns) and an output file outside the output folder: the worker stops, and neither reads
    the one (no report) nor writes the other."""
    output, shards = csv_job
    elsewhere = tmp_path / "evil.parquet"
    answer = _work(_escapes(tmp_path, shards[0])[case], "0.1", elsewhere)
    app = _fake_coordinator(output.job, [answer])
    before = _files_under(tmp_path)
    with pytest.raises(RefusedAnswer):
        _run_against(app, output.path)
    assert _files_under(tmp_path) == before and not elsewhere.exists()
    assert [route for route, _ in app.state.reports if route != "heartbeat"] == []
    assert _files_under(output.path / TMP) == []


@pytest.mark.parametrize(
    "answer",
    [
        {"action": "work", "attempt": "../../evil", "shard": None},
        {"action": "work", "attempt": "/tmp/evil", "shard": None},
        {"action": "explode"},
        {"action": "wait", "seconds": 1e9},
        [],
    ],
    ids=["attempt-dotdot", "attempt-absolute", "unknown-action", "endless-wait", "not-an-object"],
)
def test_a_worker_refuses_a_malformed_answer(csv_job, tmp_path, answer):
    output, shards = csv_job
    if isinstance(answer, dict) and answer.get("shard", 0) is None:
        answer = {**answer, "shard": shards[0]}
    before = _files_under(tmp_path)
    with pytest.raises(RefusedAnswer, match="malformed answer"):
        _run_against(_fake_coordinator(output.job, [answer]), output.path)
    assert _files_under(tmp_path) == before


def test_a_worker_writes_nothing_through_links_in_the_output_folder(csv_job, tmp_path):
    """``.tmp`` turned into a link elsewhere stops the worker; a link planted at an attempt's
    file name is not followed: the shard is reported failed and the link's target is intact."""
    output, shards = csv_job
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    planted = output.tmp_path("0.1")
    planted.symlink_to(victim)
    app = _fake_coordinator(output.job, [_work(shards[0], "0.1", victim)])
    assert _run_against(app, output.path) == 0
    assert victim.read_text() == "keep me"
    (fail,) = [body for route, body in app.state.reports if route == "fail"]
    assert fail["attempt"] == "0.1" and "OSError" in fail["error"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.unlink()
    (output.path / TMP).rmdir()
    (output.path / TMP).symlink_to(elsewhere)
    with pytest.raises(RefusedAnswer, match="is not a folder of the job's output"):
        _run_against(_fake_coordinator(output.job, [_work(shards[0], "0.2", victim)]), output.path)
    assert list(elsewhere.iterdir()) == [] and victim.read_text() == "keep me"


def test_a_worker_reads_no_file_outside_a_files_job(tmp_path):
    """A files job: ``..`` and a link in the input folder that leads out of it are refused,
    and the planner refuses such a link in the first place."""
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    (tmp_path / "secret.txt").write_text("secret")
    source = FilesSource(pattern=str(folder))
    output = OutputDir(tmp_path / "out", describe_job(source, FEATURES, plan(source)))
    output.open()
    (folder / "link.txt").symlink_to(tmp_path / "secret.txt")
    scope = JobScope.open(output.path, output.job["fingerprint"])
    ok = {"id": 0, "kind": "files", "paths": [str(folder / "a.txt")]}
    assert scope.shard(ok) == ok
    for path in (folder / ".." / "secret.txt", folder / "link.txt", tmp_path / "secret.txt"):
        with pytest.raises(RefusedAnswer, match="outside the job's input"):
            scope.shard({**ok, "paths": [str(folder / "a.txt"), str(path)]})
    with pytest.raises(SourceError, match="links outside the input folder"):
        plan(source)


def test_a_worker_needs_its_jobs_output_folder(csv_job, tmp_path):
    output, _ = csv_job
    with pytest.raises(ValueError, match="holds no preprocessing job"):
        JobScope.open(tmp_path / "input", output.job["fingerprint"])
    with pytest.raises(ValueError, match="another job"):
        JobScope.open(output.path, "0" * 64)


# -- the coordinator ------------------------------------------------------------------------------


def _coordinator(output: OutputDir, shards: list[dict], **queue) -> Coordinator:
    return Coordinator(ShardQueue(shards, output.open(), **queue), output, FEATURES)


def _state(coordinator: Coordinator) -> tuple:
    q = coordinator.queue
    parts = sorted(p.name for p in coordinator.output.path.glob("part-*"))
    return (sorted(q.running), dict(q.done), list(q.pending), q.error, parts, asdict(q.stats))


def test_a_completion_without_its_file_is_refused_and_changes_nothing(csv_job, tmp_path):
    """No file, a file that is not Parquet, a link to a Parquet file elsewhere, a Parquet file
    of another schema: each is answered 409, the attempt stays its worker's, nothing is kept;
    the worker's real file then is."""
    output, shards = csv_job
    coordinator = _coordinator(output, shards)
    elsewhere = tmp_path / "elsewhere.parquet"
    pq.write_table(pa.table({"x": [1]}), elsewhere)
    with TestClient(create_coordinator_app(coordinator, TOKEN)) as client:
        first = client.post("/v1/claim", json={"worker": "w"}, headers=AUTH).json()
        ids = {"worker": "w", "attempt": first["attempt"]}
        pq.write_table(pa.table({"x": [0]}), output.tmp_path(first["attempt"]))
        assert client.post("/v1/complete", json=ids, headers=AUTH).json() == {"kept": True}

        work = client.post("/v1/claim", json={"worker": "w"}, headers=AUTH).json()
        ids = {"worker": "w", "attempt": work["attempt"]}
        before = _state(coordinator)
        file = output.tmp_path(work["attempt"])
        bogus = [
            lambda: None,
            lambda: file.write_bytes(b"PAR1 not parquet"),
            lambda: (file.unlink(), file.symlink_to(elsewhere)),
            lambda: (file.unlink(), pq.write_table(pa.table({"y": ["other"]}), file)),
        ]
        for make in bogus:
            make()
            response = client.post("/v1/complete", json=ids, headers=AUTH)
            assert response.status_code == 409, response.text
            assert _state(coordinator) == before
        assert "the transform must return one schema" in response.json()["detail"]
        assert client.get("/healthz", headers=AUTH).json()["done"] == 1
        pq.write_table(pa.table({"x": [1]}), file)
        assert client.post("/v1/complete", json=ids, headers=AUTH).json() == {"kept": True}
    assert pq.read_table(output.path / "part-00001.parquet")["x"].to_pylist() == [1]


def test_the_job_ends_right_after_a_completion_without_a_file(tmp_path):
    """A token holder claims a shard and reports it done without a file: refused, the shard
    goes back when its lease runs out, and an honest worker finishes the job."""
    csv = _write_rows(tmp_path / "rows.csv")
    job, thread = remote_preprocess(csv, FEATURES, tmp_path / "out", TOKEN, lease_s=1.5)
    with httpx.Client(base_url=job["url"], headers=AUTH) as attacker:
        work = attacker.post("/v1/claim", json={"worker": "attacker"}).json()
        ids = {"worker": "attacker", "attempt": work["attempt"]}
        response = attacker.post("/v1/complete", json=ids)
        assert response.status_code == 409 and "no readable Parquet file" in response.text
    run_worker(job["url"], TOKEN, FEATURES, tmp_path / "out", worker_id="honest")
    thread.join(30)
    assert "error" not in job, job.get("error")
    assert read_table(tmp_path / "out")["id"].to_pylist() == list(range(ROWS))
    done = [json.loads(line) for line in (tmp_path / "out/_done.jsonl").open()]
    assert all(record["worker"].startswith("honest") for record in done)


def test_leases_run_out_in_a_background_loop_that_survives_a_failing_step(csv_job):
    """No request needed: a silent worker's shard goes back by itself. A step that raises is
    counted and the loop goes on; a loop that stops turns /healthz to 503."""
    output, shards = csv_job
    coordinator = _coordinator(output, shards, lease_s=0.3, speculate_after=0)
    expire = coordinator.queue.expire
    failures = iter([RuntimeError("a bug in one step")])

    def flaky_expire() -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        expire()

    coordinator.queue.expire = flaky_expire
    app = create_coordinator_app(coordinator, TOKEN)
    with TestClient(app) as client:
        work = client.post("/v1/claim", json={"worker": "silent"}, headers=AUTH).json()
        wait_for(lambda: work["attempt"] not in coordinator.queue.running, 10, "the lease to end")
        assert coordinator.queue.pending[0] == work["shard"]["id"]
        assert app.state.loops.errors == {"lease expiry": 1}
        assert client.get("/healthz", headers=AUTH).status_code == 200

        def stopped() -> None:
            raise LoopStopped("the queue is gone")

        coordinator.queue.expire = stopped
        wait_for(lambda: client.get("/healthz", headers=AUTH).status_code == 503, 10, "unhealthy")
        assert "lease expiry" in client.get("/healthz", headers=AUTH).json()["detail"]


# -- the routes -----------------------------------------------------------------------------------


def test_every_route_declares_its_bounded_body_and_refuses_bad_ones_with_4xx(csv_job):
    output, shards = csv_job
    coordinator = _coordinator(output, shards)
    with TestClient(create_coordinator_app(coordinator, TOKEN)) as client:
        doc = client.get("/openapi.json", headers=AUTH).json()
        schemas = doc["components"]["schemas"]
        for path in ("/v1/claim", "/v1/heartbeat", "/v1/complete", "/v1/fail"):
            body = doc["paths"][path]["post"]["requestBody"]
            ref = body["content"]["application/json"]["schema"]["$ref"]
            schema = schemas[ref.rsplit("/", 1)[1]]
            assert body["required"] and schema["additionalProperties"] is False
            assert all("maxLength" in field for field in schema["properties"].values())
        before = _state(coordinator)
        deep = "[" * 5000 + "]" * 5000
        malformed = [
            ("/v1/claim", b"not json"),
            ("/v1/claim", deep.encode()),
            ("/v1/claim", json.dumps({"worker": "w" * 201}).encode()),
            ("/v1/claim", json.dumps({"worker": 10**400}).encode()),
            ("/v1/heartbeat", b"[]"),
            ("/v1/complete", json.dumps({"worker": "w", "attempt": "1" * 60}).encode()),
            ("/v1/complete", json.dumps({"worker": "w", "attempt": "0.1", "x": 1}).encode()),
            (
                "/v1/fail",
                json.dumps({"worker": "w", "attempt": "0.1", "error": "e" * 4001}).encode(),
            ),
            ("/v1/fail", json.dumps({"worker": "w", "attempt": "0.1", "error": None}).encode()),
        ]
        for path, content in malformed:
            response = client.post(path, content=content, headers=AUTH)
            assert 400 <= response.status_code < 500, (path, content[:50], response.status_code)
        assert _state(coordinator) == before and coordinator.workers == {}


def test_the_worker_command_needs_out_and_exits_1_on_a_refused_answer(csv_job, tmp_path):
    output, shards = csv_job
    args = ["preprocess", "worker", "--transform", FEATURES, "--worker-id", "w"]
    env = {TOKEN_ENV: TOKEN}
    missing = CliRunner().invoke(cli, [*args, "--coordinator", "http://127.0.0.1:9"], env=env)
    assert missing.exit_code == 2 and "--out" in missing.output
    answer = _work(_escapes(tmp_path, shards[0])["absolute-elsewhere"], "0.1", tmp_path / "e")
    with BackgroundServer(_fake_coordinator(output.job, [answer])) as server:
        result = CliRunner().invoke(
            cli, [*args, "--coordinator", server.url, "--out", str(output.path)], env=env
        )
    assert result.exit_code == 1 and "answer is refused" in result.output, result.output
    assert "not the job's input" in result.output and not (tmp_path / "e").exists()


def test_a_database_password_never_leaves_the_coordinator(tmp_path, monkeypatch):
    """Shards and the job's record name the database without its password; local workers get it
    in their environment, and a worker elsewhere from its own ``DISTML_SQL_PASSWORD``."""
    import sqlite3

    import sqlalchemy as sa

    from distml.data.preprocess import SqlSource, sources
    from distml.jobs.preprocess import _worker_secrets

    db = tmp_path / "rows.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE rows (id INTEGER PRIMARY KEY, v REAL)")
        conn.executemany("INSERT INTO rows VALUES (?, ?)", [(i, i / 2) for i in range(10)])
    seen: list[str] = []

    def sqlite_instead(url, table, key):  # the URL as it would be connected to, then sqlite
        seen.append(sources.connect_url(url).render_as_string(hide_password=False))
        engine = sa.create_engine(f"sqlite:///{db}")
        return engine, sa.Table(table, sa.MetaData(), autoload_with=engine)

    monkeypatch.setattr(sources, "_sql_table", sqlite_instead)
    monkeypatch.delenv(sources.SQL_PASSWORD_ENV, raising=False)
    source = SqlSource(url="postgresql://me:s3cret@db.local/rows", table="rows", key="id")
    shards = plan(source)
    record = describe_job(source, "m:f", shards)
    assert "s3cret" not in json.dumps(shards) + json.dumps(record)
    assert shards[0]["url"] == "postgresql://me@db.local/rows"
    assert seen == ["postgresql://me:s3cret@db.local/rows"]  # the coordinator used its own
    assert _worker_secrets(source) == {sources.SQL_PASSWORD_ENV: "s3cret"}

    scope = JobScope(tmp_path, record, source)  # a worker accepts the password-less shard
    assert scope.shard({**shards[0], "id": 0})["url"] == "postgresql://me@db.local/rows"
    monkeypatch.setenv(sources.SQL_PASSWORD_ENV, "from-env")
    sources.read_shard({**shards[0], "id": 0})
    assert seen[-1] == "postgresql://me:from-env@db.local/rows"


def test_the_worker_table_forgets_names_silent_for_two_leases(csv_job):
    """A caller that makes up a name a claim does not grow the coordinator for ever."""
    output, shards = csv_job
    coordinator = _coordinator(output, shards, lease_s=30.0)
    app = create_coordinator_app(coordinator, TOKEN)
    with TestClient(app) as client:
        for i in range(50):
            client.post("/v1/heartbeat", json={"worker": f"made-up-{i}"}, headers=AUTH)
        client.post("/v1/claim", json={"worker": "alive"}, headers=AUTH)
        assert len(coordinator.workers) == 51
        long_ago = time.monotonic() - 61.0
        for name in list(coordinator.workers):
            if name != "alive":
                coordinator.workers[name] = long_ago
        coordinator.expire()
        assert list(coordinator.workers) == ["alive"]
        assert coordinator.progress()["workers"] == 1
