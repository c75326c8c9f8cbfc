"""One shard in this process, as the shard tests drive it: its token, its first parameters, an
optimizer's description, and a push and a read of its state."""

from __future__ import annotations

import json

import torch
from fastapi.testclient import TestClient

from distml.net import decode_tensors, encode_tensors
from distml.ps.app import create_shard_app
from distml.ps.optimizer_spec import describe_optimizer
from distml.ps.shard import ParameterShard, ShardSettings

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INIT = {"w": torch.ones(3, 2), "b": torch.zeros(2)}


def spec(name: str = "SGD", **options) -> str:
    params = {n: torch.nn.Parameter(t.clone()) for n, t in INIT.items()}
    optimizer = getattr(torch.optim, name)(params.values(), **({"lr": 0.5} | options))
    return json.dumps(describe_optimizer(optimizer, {id(p): n for n, p in params.items()}))


def client_for(tmp_path=None, optimizer: str | None = None, **settings) -> TestClient:
    shard = ParameterShard(ShardSettings(**settings))
    snapshot = tmp_path / "shard.safetensors" if tmp_path else None
    app = create_shard_app(shard, TOKEN, snapshot_path=snapshot, max_body_bytes=4096)
    client = TestClient(app, headers=AUTH)
    client.__enter__()
    body = encode_tensors(INIT, {"optimizer": optimizer or spec()})
    assert client.post("/v1/init", params={"worker": 0}, content=body).json()["accepted"]
    client.shard = shard
    return client


def push(client, worker, step, grads=None, version=0, **kw):
    grads = grads if grads is not None else {n: torch.ones_like(t) for n, t in INIT.items()}
    body = encode_tensors(grads) if isinstance(grads, dict) else grads
    params = {"worker": worker, "step": step, "version": version}
    return client.post("/v1/push", params=params, content=body, **kw)


def state(client) -> dict[str, torch.Tensor]:
    return decode_tensors(client.get("/v1/state").content)[0]
