"""The shard's rules and its web API, in one process: auth, bad input, idempotent pushes, the
three consistency rules, backup workers, heartbeats and snapshots."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fastapi.testclient import TestClient
from shard_helpers import AUTH, INIT, TOKEN, client_for, push, spec, state

from conftest import wait_for
from distml.net import decode_tensors, encode_tensors
from distml.ps.app import create_shard_app
from distml.ps.shard import ParameterShard, ShardSettings
from distml.ps.snapshot import load_snapshot, save_snapshot


def pull(client, worker, **query):
    return client.get("/v1/params", params={"worker": worker, "wait_s": 0.2, **query})


def test_every_route_needs_the_token():
    client = client_for()
    routes = [
        ("get", "/healthz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
        ("get", "/v1/status"),
        ("get", "/v1/state"),
        ("post", "/v1/register?worker=1"),
    ]
    for method, path in routes:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token-xxxxxxxx"}):
            assert getattr(client, method)(path, headers=headers).status_code == 401, path
        assert getattr(client, method)(path).status_code == 200, path
    assert client.get("/docs").status_code == 404
    assert b"distml_ps_pushes" in client.get("/metrics").content


@pytest.mark.parametrize(
    "grads, status",
    [
        ({"w": torch.ones(3, 2), "b": torch.ones(2), "extra": torch.ones(1)}, 400),  # unknown name
        ({"w": torch.ones(3, 2)}, 400),  # a parameter missing
        ({"w": torch.ones(2, 3), "b": torch.ones(2)}, 400),  # wrong shape
        ({"w": torch.ones(3, 2, dtype=torch.float64), "b": torch.ones(2)}, 400),  # wrong dtype
        ({"w": torch.full((3, 2), float("nan")), "b": torch.ones(2)}, 400),  # not finite
        ({"w": torch.full((3, 2), float("inf")), "b": torch.ones(2)}, 400),
        (b"not safetensors at all", 400),
        ({"w": torch.ones(3, 2), "b": torch.ones(2000)}, 413),  # over the 4 KiB limit
    ],
)
def test_bad_pushes_get_4xx_and_change_nothing(grads, status):
    client = client_for(consistency="asp")
    before = state(client)
    assert push(client, 0, 0, grads).status_code == status
    assert push(client, 0, -1).status_code == 422  # query validation
    after = state(client)
    assert all(torch.equal(before[n], after[n]) for n in INIT)
    assert client.shard.version == 0 and client.get("/healthz").status_code == 200
    assert push(client, 0, 0).json()["status"] == "applied"  # the shard still works


def test_initialisation_refuses_a_foreign_optimizer_and_keeps_the_first():
    shard = ParameterShard(ShardSettings())
    with TestClient(create_shard_app(shard, TOKEN), headers=AUTH) as client:
        bad = encode_tensors(INIT, {"optimizer": '{"name": "os.system", "groups": []}'})
        assert client.post("/v1/init", params={"worker": 0}, content=bad).status_code == 400
        good = encode_tensors(INIT, {"optimizer": spec()})
        assert client.post("/v1/init", params={"worker": 0}, content=good).json()["accepted"]
        other = encode_tensors({n: t + 1 for n, t in INIT.items()}, {"optimizer": spec()})
        assert not client.post("/v1/init", params={"worker": 1}, content=other).json()["accepted"]
        assert torch.equal(state(client)["w"], INIT["w"])


def test_a_retried_push_is_applied_once():
    client = client_for(consistency="asp")
    first = push(client, 0, 0).json()
    again = push(client, 0, 0).json()
    assert first["status"] == "applied" and again["status"] == "duplicate"
    assert again["read_version"] == first["read_version"] == 1
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.5)  # one step of lr 0.5, not two
    # Under BSP a retry does not count twice toward the barrier either.
    client = client_for(consistency="bsp", workers=2)
    for _ in range(2):
        assert push(client, 0, 0).json()["status"] in ("accepted", "duplicate")
    assert client.shard.version == 0
    assert push(client, 1, 0).json()["status"] == "accepted"
    assert client.shard.version == 1


def test_bsp_averages_a_step_and_readers_wait_for_it():
    client = client_for(consistency="bsp", workers=2)
    for w in (0, 1):
        client.post("/v1/register", params={"worker": w})
    answer = push(client, 0, 0, {n: torch.full_like(t, 2.0) for n, t in INIT.items()}).json()
    assert answer == {**answer, "status": "accepted", "read_version": 1}
    assert pull(client, 0, min_version=1).status_code == 425  # worker 1 has not pushed
    push(client, 1, 0, {n: torch.zeros_like(t) for n, t in INIT.items()})
    got = pull(client, 0, min_version=1)
    assert got.status_code == 200 and got.headers["X-Version"] == "1"
    assert torch.allclose(decode_tensors(got.content)[0]["w"], INIT["w"] - 0.5 * 1.0)  # mean 1


def test_bsp_backup_worker_late_gradient_is_dropped():
    client = client_for(consistency="bsp", workers=3, backup_workers=1)
    for w in range(3):
        client.post("/v1/register", params={"worker": w})
    assert push(client, 0, 0).json()["status"] == "accepted"
    assert push(client, 2, 0).json()["status"] == "accepted"  # the first two complete the step
    assert client.shard.version == 1
    assert push(client, 1, 0, version=0).json() == {
        "status": "dropped",
        "read_version": 1,
        "generation": client.shard.generation,
    }
    assert client.get("/v1/stats").json()["pushes"] == {"accepted": 2, "dropped": 1}


def test_a_departing_worker_uses_up_the_backup_before_the_quorum_shrinks():
    client = client_for(consistency="bsp", workers=3, backup_workers=1)
    for w in range(3):
        client.post("/v1/register", params={"worker": w})
    assert client.shard.quorum() == 2
    client.post("/v1/done", params={"worker": 2})
    assert client.shard.quorum() == 2  # N = 2 still live: the step keeps its batch
    client.post("/v1/done", params={"worker": 1})
    assert client.shard.quorum() == 1


def test_ssp_reader_waits_for_the_slowest_within_the_bound():
    client = client_for(consistency="ssp", staleness=1, workers=2)
    for w in (0, 1):
        client.post("/v1/register", params={"worker": w})
    push(client, 0, 0)
    assert pull(client, 0).status_code == 200  # clock 1, slowest at 0: within s = 1
    push(client, 0, 1, version=1)
    assert pull(client, 0).status_code == 425  # clock 2, slowest at 0: 2 steps ahead
    push(client, 1, 0)
    assert pull(client, 0).status_code == 200
    staleness = client.get("/v1/stats").json()["staleness"]
    assert staleness == {"0": 2, "2": 1}  # worker 1's push was computed on version 0 of 2


def test_staleness_aware_learning_rate_divides_by_one_plus_staleness():
    client = client_for(consistency="asp", workers=1, staleness_lr=True)
    push(client, 0, 0)  # fresh: lr 0.5
    push(client, 0, 1, version=0)  # one version stale: lr 0.25
    assert torch.allclose(state(client)["w"], INIT["w"] - 0.75)


def test_a_silent_bsp_worker_leaves_the_barrier_and_is_readmitted():
    # The watcher looks every 50 ms, a quarter of the timeout the shard started with; the timeout
    # is then made long, so that no beat has to come in time on a busy machine, and the workers'
    # silences are their last beats moved back: no test waits for a clock.
    client = client_for(consistency="bsp", workers=2, heartbeat_timeout_s=0.2)
    workers = client.shard.workers
    client.shard.settings.heartbeat_timeout_s = 600.0
    for w in (0, 1):
        client.post("/v1/register", params={"worker": w})
    push(client, 0, 0)
    assert client.shard.version == 0 and client.shard.quorum() == 2
    workers[0].last_seen -= 300.0  # half the timeout: still live, and its beat renews it
    workers[1].last_seen -= 600.0  # silent for the timeout
    aged = workers[0].last_seen
    assert client.post("/v1/heartbeat", params={"worker": 0}).status_code == 200
    assert workers[0].last_seen > aged
    wait_for(lambda: client.shard.version == 1, 60, "the watcher to complete the step")
    # The watcher has completed the step without worker 1.
    assert client.shard.version == 1 and client.shard.quorum() == 1
    live = {w: s["live"] for w, s in client.get("/v1/status").json()["workers"].items()}
    assert live == {"0": True, "1": False}
    client.post("/v1/register", params={"worker": 1})  # back: the barrier waits for it again
    assert client.shard.quorum() == 2
    push(client, 0, 1, version=1)
    assert client.shard.version == 1
    push(client, 1, 1, version=1)
    assert client.shard.version == 2


def test_snapshot_round_trip_keeps_parameters_optimizer_state_and_clocks(tmp_path):
    client = client_for(tmp_path, optimizer=spec("AdamW", weight_decay=0.1), consistency="asp")
    for step in range(3):
        push(client, 0, step, {n: torch.randn_like(t) for n, t in INIT.items()})
    shard = client.shard
    path = save_snapshot(shard, tmp_path / "copy.safetensors")
    restored = ParameterShard(ShardSettings(consistency="asp"))
    load_snapshot(restored, path)
    assert restored.version == 3 and restored.workers[0].clock == 3
    for name in INIT:
        assert torch.equal(restored.params[name], shard.params[name])
    a, b = shard.optimizer.state_dict(), restored.optimizer.state_dict()
    for index, entries in a["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, b["state"][index][key]), key
    # The restored shard takes the next push as the original would.
    grads = {n: torch.ones_like(t) for n, t in INIT.items()}
    for s in (shard, restored):
        for n, p in s.params.items():
            p.grad = grads[n].clone()
        s.optimizer.step()
    assert all(torch.equal(shard.params[n], restored.params[n]) for n in INIT)


def claim(client, worker, epoch, batches=5, position=None):
    """Worker ``worker``'s next claim of ``epoch`` (or its claim number ``position`` again)."""
    positions = client.__dict__.setdefault("positions", {})
    if position is None:
        position = positions.get((worker, epoch), 0)
        positions[worker, epoch] = position + 1
    params = {"worker": worker, "epoch": epoch, "position": position, "batches": batches}
    return client.post("/v1/claim", params=params)


def test_asynchronous_shards_hand_out_each_batch_of_an_epoch_once(tmp_path):
    client = client_for(tmp_path, consistency="asp")
    got = {0: [], 1: []}
    for worker in (0, 0, 1, 0, 1):
        got[worker].append(claim(client, worker, epoch=0).json()["batch"])
    assert got == {0: [0, 1, 3], 1: [2, 4]}  # whoever asks first takes the next one
    assert claim(client, 1, epoch=0).json() == {"batch": None}  # the epoch is used up
    assert claim(client, 1, epoch=1).json() == {"batch": 0}  # the next one starts afresh
    assert client.get("/v1/stats").json()["batches_claimed"] == {"0": 3, "1": 3}
    # A retried claim (its answer lost on the way) gets the same batch, not the next one.
    assert claim(client, 1, epoch=1, position=0).json() == {"batch": 0}
    assert claim(client, 0, epoch=1).json() == {"batch": 1}
    # Another epoch length means another dataset or batch size: refused, nothing handed out.
    assert claim(client, 0, epoch=1, batches=6, position=7).status_code == 409
    for bad in ({"epoch": -1}, {"batches": 0}, {"position": -1}, {"epoch": 2**40}):
        query = {"worker": 0, "epoch": 0, "position": 9, "batches": 5} | bad
        assert client.post("/v1/claim", params=query).status_code == 422
    query = "/v1/claim?worker=0&epoch=0&position=9&batches=5"
    assert client.post(query, headers={"Authorization": ""}).status_code == 401
    assert claim(client, 0, epoch=1).json() == {"batch": 2}
    # A restarted shard goes on from its snapshot's counters.
    path = save_snapshot(client.shard, tmp_path / "copy.safetensors")
    restored = ParameterShard(ShardSettings(consistency="asp"))
    load_snapshot(restored, path)
    assert restored.claims == {0: 5, 1: 3} and restored.claimed == client.shard.claimed
    assert asyncio.run(restored.claim(3, 1, 0, 5)) == 3


def test_bsp_shards_hand_out_no_batches():
    client = client_for(consistency="bsp")
    assert claim(client, 0, epoch=0).status_code == 409
