"""A shard against what a peer holding the token may send: optimizer settings that cannot step,
tensors of dtypes no optimizer takes, malformed metadata, an optimizer step that fails, and the
background loop that watches the workers. Each is refused with 4xx (or, for a failed step, 503
and nothing counted), and the shard goes on for the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from shard_helpers import AUTH, INIT, TOKEN, push, spec, state

from conftest import wait_for
from distml.net import LoopStopped, encode_tensors
from distml.ps.app import create_shard_app
from distml.ps.optimizer_spec import build_optimizer, describe_optimizer
from distml.ps.shard import ParameterShard, ShardSettings

LIMIT = 4096
APPLIED = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam"]


def bare_client(
    snapshot: Path | None = None, shard: ParameterShard | None = None, **settings
) -> TestClient:
    """A shard not yet initialised; server errors come back as answers, not exceptions."""
    shard = shard or ParameterShard(ShardSettings(**settings))
    app = create_shard_app(shard, TOKEN, snapshot_path=snapshot, max_body_bytes=LIMIT)
    client = TestClient(app, headers=AUTH, raise_server_exceptions=False)
    client.__enter__()
    client.shard = shard
    return client


def init(client, optimizer: str | None, tensors=None):
    meta = {} if optimizer is None else {"optimizer": optimizer}
    body = encode_tensors(INIT if tensors is None else tensors, meta)
    return client.post("/v1/init", params={"worker": 0}, content=body)


def sgd(**group) -> str:
    return json.dumps({"name": "SGD", "groups": [{"params": ["w", "b"], "lr": 0.5, **group}]})


def deep(levels: int) -> str:
    return '{"name": "SGD", "groups": ' + "[" * levels + "]" * levels + "}"


BAD_OPTIMIZERS = {
    "lr as a string": sgd(lr="0.5"),
    "negative lr": sgd(lr=-0.5),
    "zero lr": sgd(lr=0),
    "infinite lr": sgd().replace("0.5", "1e999"),
    "401-digit lr": sgd().replace("0.5", "9" * 401),
    "lr a bool": sgd(lr=True),
    "momentum 1": sgd(momentum=1.0),
    "negative weight decay": sgd(weight_decay=-0.1),
    "unknown option": sgd(closure="os.system"),
    "differentiable": sgd(differentiable=True),
    "capturable": spec("Adam").replace('"capturable": false', '"capturable": true'),
    "beta of 1": spec("Adam").replace("0.999", "1.0"),
    "eps of 0": spec("Adam").replace("1e-08", "0"),
    "LBFGS": json.dumps({"name": "LBFGS", "groups": [{"params": ["w", "b"], "lr": 1}]}),
    "SparseAdam": json.dumps({"name": "SparseAdam", "groups": [{"params": ["w", "b"]}]}),
    "no groups": json.dumps({"name": "SGD", "groups": []}),
    "a parameter twice": json.dumps({"name": "SGD", "groups": [{"params": ["w"]}] * 2}),
    "none of the shard's": json.dumps({"name": "SGD", "groups": [{"params": ["x"]}]}),
    "a JSON list": "[1, 2]",
    "a JSON string": '"SGD"',
    "deep nesting": deep(1500),
    "nesting past the bound": deep(8),
    "not JSON": "SGD(lr=0.5)",
    "NaN": sgd().replace("0.5", "NaN"),
    "missing": None,
}


@pytest.mark.parametrize("optimizer", BAD_OPTIMIZERS.values(), ids=BAD_OPTIMIZERS.keys())
def test_init_refuses_optimizer_settings_that_cannot_step_and_writes_nothing(tmp_path, optimizer):
    client = bare_client(tmp_path / "shard.safetensors", consistency="asp")
    answer = init(client, optimizer)
    assert answer.status_code == 400, answer.text
    assert not client.shard.initialized and client.shard.optimizer_spec is None
    assert not (tmp_path / "shard.safetensors").exists()
    assert client.get("/healthz").status_code == 200
    assert init(client, spec()).json()["accepted"]  # the shard still takes a good one
    assert push(client, 0, 0).json()["status"] == "applied"
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.5)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.float8_e4m3fn]
)
def test_init_refuses_tensors_no_optimizer_steps(dtype):
    client = bare_client()
    tensors = {"w": torch.ones(3, 2).to(dtype), "b": torch.zeros(2)}
    answer = init(client, spec(), tensors)
    assert answer.status_code == 400, answer.text
    assert str(dtype) in answer.json()["detail"] and not client.shard.initialized
    not_finite = {"w": torch.full((3, 2), float("inf")), "b": torch.zeros(2)}
    assert init(client, spec(), not_finite).status_code == 400
    assert not client.shard.initialized


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_every_allowed_optimizer_steps_on_every_floating_dtype(dtype):
    tensors = {n: t.to(dtype) for n, t in INIT.items()}
    other = torch.float64 if dtype != torch.float64 else torch.float32
    for name in APPLIED:
        client = bare_client(consistency="asp")
        assert init(client, spec(name), tensors).json()["accepted"], name
        grads = {n: torch.ones_like(t) for n, t in tensors.items()}
        assert push(client, 0, 0, grads).json()["status"] == "applied", name
        after = state(client)
        assert after["w"].dtype == dtype and torch.isfinite(after["w"]).all(), name
        wrong = {n: t.to(other) for n, t in grads.items()}
        assert push(client, 0, 1, wrong).status_code == 400, name
        assert client.shard.version == 1, name


def test_the_worker_refuses_an_optimizer_no_shard_applies_before_sending_it():
    params = {n: torch.nn.Parameter(t.clone()) for n, t in INIT.items()}
    names = {id(p): n for n, p in params.items()}
    for optimizer in (
        torch.optim.LBFGS(params.values()),
        torch.optim.SparseAdam(params.values()),
        torch.optim.Adam(params.values(), capturable=True),
    ):
        with pytest.raises(ValueError):
            describe_optimizer(optimizer, names)
    # A scheduler's note, a user's own tag and a learning rate held as a tensor are not refused.
    adam = torch.optim.Adam(
        [{"params": list(params.values()), "tag": "decay"}], lr=torch.tensor(0.25)
    )
    torch.optim.lr_scheduler.StepLR(adam, 1)
    described = describe_optimizer(adam, names)
    assert described["groups"][0]["lr"] == 0.25 and "tag" not in described["groups"][0]
    assert build_optimizer(described, params).param_groups[0]["lr"] == 0.25


def fail_next_steps(shard: ParameterShard, count: int = 1) -> list[int]:
    """Make the shard's next ``count`` optimizer steps raise as they start; the calls made."""
    real, calls = shard.optimizer.step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) <= count:
            raise RuntimeError("out of memory (injected)")
        return real(*args, **kwargs)

    shard.optimizer.step = step
    return calls


def test_a_push_whose_step_fails_counts_nowhere_and_its_retry_is_applied():
    client = bare_client(consistency="asp", staleness_lr=True)
    assert init(client, spec("SGD", momentum=0.9)).json()["accepted"]
    shard = client.shard
    fail_next_steps(shard)
    failed = push(client, 0, 0)
    assert failed.status_code == 503 and "send the push again" in failed.json()["detail"]
    assert shard.version == 0 and shard.workers[0].clock == 0
    assert torch.equal(state(client)["w"], INIT["w"])
    assert shard.optimizer.state_dict()["state"] == {}  # no momentum buffer made
    assert [g["lr"] for g in shard.optimizer.param_groups] == [0.5]
    assert all(p.grad is None for p in shard.params.values())
    assert client.get("/v1/stats").json()["pushes"] == {}
    again = push(client, 0, 0)  # the same push, sent again: applied, not a duplicate
    assert again.json()["status"] == "applied" and shard.version == 1
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.5)
    assert push(client, 0, 0).json()["status"] == "duplicate"
    assert client.get("/healthz").status_code == 200


def test_a_bsp_step_that_fails_keeps_the_barrier_and_the_retry_completes_it():
    client = bare_client(consistency="bsp", workers=2)
    assert init(client, spec()).json()["accepted"]
    shard = client.shard
    for w in (0, 1):
        client.post("/v1/register", params={"worker": w})
    assert push(client, 0, 0).json()["status"] == "accepted"
    fail_next_steps(shard)
    twos = {n: torch.full_like(t, 3.0) for n, t in INIT.items()}
    assert push(client, 1, 0, twos).status_code == 503
    assert shard.version == 0 and shard.workers[1].clock == 0 and list(shard._pending) == [0]
    assert push(client, 1, 0, twos).json()["status"] == "accepted"
    assert shard.version == 1
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.5 * 2.0)  # the mean of 1 and 3


def test_a_failing_liveness_step_is_logged_and_the_watcher_goes_on():
    """The watcher completes a BSP step whose other worker went silent; its first try fails."""
    client = bare_client(consistency="bsp", workers=2, heartbeat_timeout_s=0.2)
    assert init(client, spec()).json()["accepted"]
    shard = client.shard
    assert push(client, 0, 0).json()["status"] == "accepted"
    calls = fail_next_steps(shard)
    loops = client.app.state.loops
    wait_for(lambda: shard.version == 1, 30, "the watcher to complete the step")
    assert len(calls) == 2 and loops.errors == {"liveness": 1}
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.5)  # applied once
    assert client.get("/healthz").status_code == 200


def test_a_stopped_liveness_watcher_makes_the_shard_unhealthy():
    shard = ParameterShard(ShardSettings(heartbeat_timeout_s=0.2))
    calls = []

    async def stopped() -> None:
        calls.append(1)
        if len(calls) > 2:
            raise LoopStopped("the watcher cannot go on")

    shard.check_liveness = stopped
    client = bare_client(shard=shard)
    wait_for(lambda: client.get("/healthz").status_code == 503, 30, "/healthz to answer 503")
    assert "liveness" in client.get("/healthz").json()["detail"]


def test_snapshot_before_initialisation_is_refused_and_writes_nothing(tmp_path):
    client = bare_client(tmp_path / "shard.safetensors")
    assert client.post("/v1/snapshot").status_code == 409
    assert not (tmp_path / "shard.safetensors").exists()
    assert init(client, spec()).json()["accepted"]
    assert client.post("/v1/snapshot").json()["version"] == 0


def test_an_unwritable_snapshot_fails_no_push(tmp_path):
    (tmp_path / "file").write_text("")
    client = bare_client(tmp_path / "file" / "shard.safetensors", consistency="asp")
    assert init(client, spec()).json()["accepted"]
    assert push(client, 0, 0).json()["status"] == "applied"
    assert client.post("/v1/snapshot").status_code == 503
    assert client.shard.version == 1 and client.get("/healthz").status_code == 200


def test_counters_in_the_query_are_bounded():
    client = bare_client(consistency="asp")
    assert init(client, spec()).json()["accepted"]
    for query in ({"step": "9" * 401}, {"version": 2**63}, {"step": -1}, {"worker": "x"}):
        params = {"worker": 0, "step": 0, "version": 0, **query}
        body = encode_tensors({n: torch.ones_like(t) for n, t in INIT.items()})
        assert client.post("/v1/push", params=params, content=body).status_code == 422
    assert client.shard.version == 0


def test_raw_bodies_are_declared_in_the_openapi_document():
    client = bare_client()
    paths = client.get("/openapi.json").json()["paths"]
    for route in ("/v1/init", "/v1/push"):
        body = paths[route]["post"]["requestBody"]
        schema = body["content"]["application/octet-stream"]["schema"]
        assert body["required"] and schema == {
            "type": "string",
            "format": "binary",
            "maxLength": LIMIT,
        }
