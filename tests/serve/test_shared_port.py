"""Replicas sharing one port (``SO_REUSEPORT``): the kernel spreads new connections over every
replica, the answers are the model's, and a replica killed under load takes its own requests
with it but no later one: the kernel stops sending it connections, and it comes back on the
same port."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
import torch

from conftest import wait_for
from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.serve.model import load_served_model

TOKEN = "shared-port-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = "/v2/models/digits-cnn/infer"


def _infer(url: str, x: torch.Tensor) -> httpx.Response:
    """One request on a connection of its own: the kernel places each one anew."""
    item = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    payload = {"inputs": [{**item, "data": x.flatten().tolist()}]}
    return httpx.post(url + INFER, json=payload, headers=AUTH, timeout=60)


def _served(replica_url: str) -> float:
    """Requests a replica answered with 200, from its own port's metrics."""
    try:
        text = httpx.get(replica_url + "/metrics", headers=AUTH).text
    except httpx.TransportError:
        return 0.0  # not listening yet: it has served nothing since its start
    found = re.search(r'^distml_replica_requests_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _logits(response: httpx.Response) -> torch.Tensor:
    out = response.json()["outputs"][0]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


@pytest.mark.distributed
def test_replicas_on_one_port_share_its_connections_and_outlive_a_kill(
    digits_cnn_checkpoint, tmp_path
):
    oracle = load_served_model(digits_cnn_checkpoint, "digits-cnn").predict
    command = ReplicaCommand(str(digits_cnn_checkpoint), "digits-cnn", shared=("127.0.0.1", 0))
    with ReplicaSet(command, 2, TOKEN, log_dir=tmp_path) as replicas:
        replicas.wait_ready(120)
        url = replicas.shared_url
        assert url is not None and not url.endswith(":0")
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(1 + i % 3, 1, 8, 8, generator=gen) for i in range(48)]
        for x in xs:
            r = _infer(url, x)
            assert r.status_code == 200, r.text
            torch.testing.assert_close(_logits(r), oracle(x))
        # 48 connections hashed over 2 sockets: each replica took some of them.
        before = [_served(u) for u in replicas.urls]
        assert all(n > 0 for n in before) and sum(before) == len(xs), before

        victim = replicas.processes[0]
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
        # Its socket died with it: every new connection reaches a live replica.
        for x in xs[:16]:
            assert _infer(url, x).status_code == 200
        wait_for(lambda: victim.restarts == 1, 60, "the supervisor's restart")
        replicas.wait_ready(120)  # the restarted one answers on its own port again...
        assert victim.exits == [-signal.SIGKILL]
        for x in xs:
            assert _infer(url, x).status_code == 200
        # ...and has bound the shared port again: new connections reach it.
        assert _served(victim.url) > 0, victim.log_tail()
