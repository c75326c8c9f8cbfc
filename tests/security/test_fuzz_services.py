"""Every network service fuzzed from its own OpenAPI document (schemathesis), over real HTTP on
loopback, with a valid token: no answer is a 5xx, no request breaks the connection, the state
an attacker must not move (parameter versions, rounds, hub versions, committed shards) has not
moved, and an honest request still works afterwards.

Each operation gets ``DISTML_FUZZ_EXAMPLES`` cases (default 25) of valid data and as many of
invalid data. The counts per service are printed (``pytest -s``) and written as JSON to
``fuzz_services.json`` in pytest's base temporary folder, or to ``$DISTML_FUZZ_REPORT``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
import torch
from fastapi import Request
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from safetensors.torch import save_model
from schemathesis import GenerationMode

from conftest import examples, wait_for
from distml.net import (
    BackgroundServer,
    create_app,
    decode_tensors,
    encode_tensors,
    octet_stream_body,
    read_body,
)

pytestmark = pytest.mark.fuzz  # every service, against its OpenAPI document

TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("DISTML_FUZZ_EXAMPLES", examples(25)))
# Long polls answer at once under the fuzzer: a wait of up to a minute per case would spend the
# time budget on waiting, not on inputs.
LONG_POLLS = ("wait", "wait_s")
POLL_S = 0.01
CSV_ROWS_PER_SHARD = 70  # rows of (id, a, b, label) in a block of 1 KiB
REPORTS: dict[str, dict[str, Any]] = {}
PREPROCESS_TESTS = Path(__file__).resolve().parents[1] / "data" / "preprocess"
TRANSFORM = f"{PREPROCESS_TESTS / 'transforms.py'}:features"


@dataclass
class FuzzReport:
    """What the fuzzer sent to one service and what came back."""

    service: str
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    operations: list[str] = field(default_factory=list)
    by_operation: dict[str, Counter] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)  # "<op> -> <status>: <body>"
    crashes: list[str] = field(default_factory=list)  # "<op>: <exception>"
    unsatisfiable: list[str] = field(default_factory=list)  # ops with no case of one kind

    def summary(self) -> dict[str, Any]:
        fives = sum(n for status, n in self.statuses.items() if status >= 500)
        by_operation = {op: dict(sorted(c.items())) for op, c in self.by_operation.items()}
        statuses = dict(sorted(self.statuses.items()))
        return asdict(self) | {"statuses": statuses, "by_operation": by_operation, "5xx": fives}

    def problems(self) -> str:
        lines = [*self.server_errors[:20], *self.crashes[:20]]
        return f"{self.service}: {len(lines)} problems\n" + "\n".join(lines)


def fuzz(service: str, url: str, pinned: dict[str, Any] | None = None) -> FuzzReport:
    """Run every operation of the service at ``url`` with valid and invalid cases; and, where an
    operation has a parameter named in ``pinned`` (the served model's name, the open round),
    valid cases with that parameter set, so that they pass the lookup and reach the handler."""
    document = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    schema = schemathesis.openapi.from_dict(without_security(document))
    report = FuzzReport(service)
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            report.operations.append(operation.label)
            for strategy in _strategies(operation, pinned or {}):
                _fuzz_operation(operation, strategy, url, session, report)
    REPORTS[service] = report.summary()
    print(f"\nfuzz {service}: {report.requests} requests, statuses {dict(report.statuses)}")
    return report


def _strategies(operation, pinned: dict[str, Any]) -> list:
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    inputs = [operation.query, operation.path_parameters, operation.headers, operation.body]
    if any(map(len, inputs)):  # an operation without any has no invalid input to send
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    query = {p.name: pinned[p.name] for p in operation.query if p.name in pinned}
    path = {p.name: pinned[p.name] for p in operation.path_parameters if p.name in pinned}
    if query or path:
        strategies.append(operation.as_strategy(query=query or None, path_parameters=path or None))
    return strategies


def without_security(document: dict[str, Any]) -> dict[str, Any]:
    """The document without its bearer scheme: every case carries the valid token, so that the
    invalid data goes to the handlers (refusing a missing token is tested elsewhere)."""
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict):
                operation.pop("security", None)
    document.get("components", {}).pop("securitySchemes", None)
    return document


def _fuzz_operation(operation, strategy, url: str, session, report: FuzzReport) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case) -> None:
        _answer_long_polls_at_once(case)
        report.requests += 1
        try:
            response = case.call(base_url=url, session=session, headers=AUTH, timeout=30)
        except requests.RequestException as exc:
            report.crashes.append(f"{operation.label}: {exc!r}")
            return
        report.statuses[response.status_code] += 1
        report.by_operation.setdefault(operation.label, Counter())[response.status_code] += 1
        if response.status_code >= 500:
            text = response.content[:200].decode("utf-8", "replace")
            report.server_errors.append(f"{operation.label} -> {response.status_code}: {text}")

    try:
        run()
    except Unsatisfiable:  # e.g. invalid data for a route whose only input is any string
        report.unsatisfiable.append(operation.label)


def _answer_long_polls_at_once(case) -> None:
    """Cap every wait the service would accept (a number, a numeric string, a repeated
    parameter whose last value counts) at POLL_S; keep the ones it must refuse."""
    for name in LONG_POLLS:
        if name in {p.name for p in case.operation.query}:
            value = (case.query or {}).get(name, POLL_S)
            if not _refused_wait(value):
                case.query = {**(case.query or {}), name: POLL_S}


def _refused_wait(value: Any) -> bool:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return True
        return False
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and value < 0


def check(report: FuzzReport) -> None:
    assert report.requests > 0 and len(report.operations) > 0
    assert not report.server_errors and not report.crashes, report.problems()


@pytest.fixture(scope="module", autouse=True)
def _write_reports(tmp_path_factory) -> Iterator[None]:
    yield
    path = os.environ.get("DISTML_FUZZ_REPORT") or tmp_path_factory.getbasetemp() / (
        "fuzz_services.json"
    )
    Path(path).write_text(json.dumps(REPORTS, indent=2, default=str))
    total = sum(r["requests"] for r in REPORTS.values())
    fives = sum(r["5xx"] for r in REPORTS.values())
    print(f"\nfuzz: {total} requests to {len(REPORTS)} services, {fives} answered 5xx; {path}")


@contextmanager
def serving(app) -> Iterator[str]:
    with BackgroundServer(app) as server:
        yield server.url


def honest(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers=AUTH, timeout=30)


def test_the_harness_reports_every_server_error():
    app = create_app("faulty", TOKEN, health=lambda: {})
    pushes: list[bytes] = []

    @app.post("/v1/push", openapi_extra=octet_stream_body(1024))
    async def push(request: Request) -> dict[str, Any]:
        body = await read_body(request, 1024)
        pushes.append(body)
        if len(body) > 3:
            raise RuntimeError("a handler that trusts its input")
        return {"ok": True}

    with serving(app) as url:
        report = fuzz("faulty", url)
    assert pushes and report.requests >= len(pushes)
    assert any(e.startswith("POST /v1/push -> 500") for e in report.server_errors)
    REPORTS.pop("faulty")


# -- the parameter server --------------------------------------------------------------------------


def test_the_parameter_server_survives_fuzzing_unchanged(tmp_path):
    from distml.ps.app import create_shard_app
    from distml.ps.optimizer_spec import describe_optimizer
    from distml.ps.shard import ParameterShard, ShardSettings

    init = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    optimizer = torch.optim.SGD(params.values(), lr=0.5)
    spec = json.dumps(describe_optimizer(optimizer, {id(p): n for n, p in params.items()}))
    shard = ParameterShard(ShardSettings(consistency="asp", heartbeat_timeout_s=30))
    app = create_shard_app(
        shard, TOKEN, snapshot_path=tmp_path / "shard.safetensors", max_body_bytes=4096
    )
    with serving(app) as url, honest(url) as client:
        body = encode_tensors(init, {"optimizer": spec})
        assert client.post("/v1/init", params={"worker": 0}, content=body).json()["accepted"]
        before = decode_tensors(client.get("/v1/state").content)[0]

        report = fuzz("parameter server", url, pinned={"worker": 0, "version": 0})

        assert shard.version == 0  # no gradient was applied
        after = decode_tensors(client.get("/v1/state").content)[0]
        assert all(torch.equal(after[n], t) for n, t in before.items())
        grads = encode_tensors({n: torch.ones_like(t) for n, t in init.items()})
        push = client.post("/v1/push", params={"worker": 0, "step": 0, "version": 0}, content=grads)
        assert push.status_code == 200, push.text
        assert shard.version == 1
    check(report)


# -- the federated server --------------------------------------------------------------------------


def test_the_federated_server_survives_fuzzing_unchanged():
    from distml.data import digits
    from distml.federated.app import create_fl_app
    from distml.federated.server import FederatedServer, ServerConfig
    from distml.federated.strategy import make_strategy
    from distml.federated.task import build_model, get_params

    tokens = {"mallory": TOKEN, "alice": "alice-token-0123456789abcdef"}
    config = ServerConfig(rounds=1, min_available=2, round_timeout_s=600, quorum=1.0)
    strategy = make_strategy("fedavg", fraction_fit=1.0, min_fit_clients=2)
    server = FederatedServer(config, strategy, digits("val"))
    start = {n: t.clone() for n, t in server.params.items()}
    alice = {"Authorization": f"Bearer {tokens['alice']}"}
    with serving(create_fl_app(server, tokens, max_body_bytes=2**20)) as url:
        with honest(url) as mallory, httpx.Client(base_url=url, headers=alice) as client:
            assert mallory.post("/v1/register").status_code == 200
            assert client.post("/v1/register").status_code == 200
            wait_for(lambda: server.status()["open"], timeout=60, what="round 1 to open")

            report = fuzz("federated server", url, pinned={"round": 1})

            assert server.completed == 0 and server.history == []  # no round aggregated
            assert (server.status()["round"], server.status()["attempt"]) == (1, 1)
            assert all(torch.equal(server.params[n], t) for n, t in start.items())
            zero = get_params(build_model("digits-mlp"))
            delta = {n: torch.zeros_like(p) for n, p in zero.items()}
            update = encode_tensors(delta, {"num_examples": "10"})
            answer = client.post("/v1/update", params={"round": 1}, content=update)
            assert answer.status_code == 200, answer.text
    check(report)


# -- the contribution hub --------------------------------------------------------------------------


def test_the_contribution_hub_survives_fuzzing_unchanged(tmp_path):
    from distml.data import digits
    from distml.federated.hub import Hub
    from distml.federated.hub_app import create_hub_app
    from distml.federated.task import build_model, set_params, train_local

    hub = Hub(tmp_path / "hub", digits("val"))
    tokens = {"mallory": TOKEN, "alice": "alice-token-0123456789abcdef"}
    alice = {"Authorization": f"Bearer {tokens['alice']}"}
    with serving(create_hub_app(hub, tokens, max_body_bytes=2**16)) as url, honest(url) as client:
        v0 = client.get("/v1/model").content

        report = fuzz("contribution hub", url, pinned={"base": 0, "version": 0})

        log = client.get("/v1/versions").json()
        assert hub.latest == 0 and len(log["versions"]) == 1  # no version added
        assert client.get("/v1/model").content == v0
        _, start, _ = _decoded_model(v0)
        model = build_model("digits-mlp")
        set_params(model, start)
        delta = train_local(model, digits("train"), epochs=1, lr=0.1, seed=0).delta
        body = encode_tensors(delta, {"description": "one epoch on the digits train set"})
        with httpx.Client(base_url=url, headers=alice, timeout=60) as contributor:
            answer = contributor.post("/v1/contributions", params={"base": 0}, content=body)
        assert answer.status_code == 201, answer.text
    check(report)


def _decoded_model(body: bytes) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta = decode_tensors(body)
    return int(meta["version"]), tensors, meta


# -- serving: a replica, and the router in front of it ---------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from distml.models import DigitsCNN
    from distml.serve.model import load_served_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("serve") / "model.safetensors"
    save_model(DigitsCNN(), str(path))
    return load_served_model(path, "digits-cnn")


def infer_body(x: torch.Tensor) -> dict[str, Any]:
    data = x.flatten().tolist()
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": data}]}


def assert_answers_like_the_model(client: httpx.Client, served) -> None:
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    answer = client.post("/v2/models/digits-cnn/infer", json=infer_body(x))
    assert answer.status_code == 200, answer.text
    out = answer.json()["outputs"][0]
    got = torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])
    torch.testing.assert_close(got, served.predict(x))


def test_a_replica_survives_fuzzing_unchanged(served):
    from distml.serve.replica import create_replica_app

    app = create_replica_app(served, TOKEN, max_batch_size=8, max_body=2**16)
    with serving(app) as url, honest(url) as client:
        report = fuzz("replica", url, pinned={"name": "digits-cnn", "version": "1"})

        assert client.get("/v2/health/ready").status_code == 200
        assert_answers_like_the_model(client, served)
    check(report)


def test_the_router_survives_fuzzing_unchanged(served):
    from distml.serve.replica import create_replica_app
    from distml.serve.router import Router
    from distml.serve.router_app import create_router_app

    replica = create_replica_app(served, TOKEN, max_batch_size=8, max_body=2**16)
    with serving(replica) as replica_url:
        router = Router([replica_url], TOKEN, retry_s=1.0, timeout_s=10.0, health_interval_s=0.2)
        app = create_router_app(router, TOKEN, max_body=2**16)
        with serving(app) as url, honest(url) as client:
            report = fuzz("router", url, pinned={"name": "digits-cnn", "version": "1"})

            assert client.get("/v2/health/ready").status_code == 200
            assert_answers_like_the_model(client, served)
    check(report)


# -- the preprocessing coordinator -----------------------------------------------------------------


def test_the_preprocessing_coordinator_survives_fuzzing_unchanged(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from distml.data.preprocess import CsvSource, plan
    from distml.data.preprocess.coordinator import Coordinator, create_coordinator_app
    from distml.data.preprocess.output import OutputDir
    from distml.data.preprocess.queue import ShardQueue
    from distml.data.preprocess.worker import run_worker
    from distml.jobs.preprocess import describe_job

    # More shards than the fuzzer can claim (a claim with none left is a long poll), on a
    # clock that the test moves: no lease runs out while the fuzzer runs, and all of them have
    # run out (each shard's first lost lease) when the honest worker starts.
    rows = CSV_ROWS_PER_SHARD * (2 * EXAMPLES + 16)
    ids = np.arange(rows)
    table = pa.table({"id": ids, "a": ids * 0.5, "b": ids * 0.25, "label": ids % 3})
    (tmp_path / "input").mkdir()
    pacsv.write_csv(table, tmp_path / "input" / "rows.csv")
    source = CsvSource(path=str(tmp_path / "input" / "rows.csv"), blocksize=1024)
    shards = plan(source)
    output = OutputDir(tmp_path / "out", describe_job(source, TRANSFORM, shards))
    skew = [0.0]
    clock = lambda: time.monotonic() + skew[0]  # noqa: E731
    queue = ShardQueue(shards, output.open(), lease_s=60, speculate_after=0, clock=clock)
    coordinator = Coordinator(queue, output, TRANSFORM)
    parts = _parts(output)
    with serving(create_coordinator_app(coordinator, TOKEN)) as url:
        report = fuzz("preprocessing coordinator", url)

        assert queue.done == {} and queue.error is None  # no shard committed, none failed
        assert _parts(output) == parts
        assert len(queue.pending) > 0, "the fuzzer claimed every shard"
        skew[0] = 3600.0
        kept = run_worker(url, TOKEN, TRANSFORM, output.path, worker_id="honest")
    assert kept == len(shards) and queue.finished
    written = [pq.read_table(output.path / name)["id"] for name in _parts(output)]
    assert sorted(i for part in written for i in part.to_pylist()) == list(range(rows))
    check(report)


def _parts(output) -> list[str]:
    return sorted(p.name for p in output.path.glob("part-*"))
