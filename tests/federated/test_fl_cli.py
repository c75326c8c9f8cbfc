"""A federation of real processes on loopback: `distml fl server` over TLS and three
`distml fl client` processes, each holding its own data. One client is killed; later the server
is killed too and restarted from its checkpoint; the rounds still complete."""

import json
import os
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from conftest import self_signed
from distml.net.ports import free_port

pytestmark = pytest.mark.distributed  # every test starts processes


def distml(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "distml", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip


def test_a_federation_of_processes_survives_a_killed_client_and_a_restarted_server(tmp_path):
    cert, key = self_signed(tmp_path)
    tokens_file = tmp_path / "tokens.json"
    subprocess.run([sys.executable, "-m", "distml", "fl", "tokens", "3", "--out", str(tokens_file)],
                   check=True)  # fmt: skip
    tokens = json.loads(tokens_file.read_text())
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    server_args = (
        "fl", "server", "--tokens", str(tokens_file), "--port", str(port), "--rounds", "3",
        "--min-available", "3", "--round-timeout", "10", "--quorum", "0.5",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--lr", "0.3",
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
    )  # fmt: skip
    ca = ssl.create_default_context(cafile=str(cert))
    watch = httpx.Client(base_url=url, verify=ca, timeout=30,
                         headers={"Authorization": f"Bearer {tokens['client-0000']}"})  # fmt: skip

    def status():
        try:
            return watch.get("/v1/status").json()
        except httpx.TransportError:
            return None

    def wait_for(predicate, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = status()
            if s is not None and predicate(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"timed out; last status {status()}")

    # --round-timeout counts from a round's first update: the others must train and answer in
    # that time on a machine that may be busy, and a round that waits on the killed client
    # lasts that long.
    server = distml(*server_args)
    clients = []
    try:
        for k, token in enumerate(tokens.values()):
            env = os.environ | {"DISTML_TOKEN": token}
            clients.append(distml("fl", "client", "--server", url, "--data", f"digits:{k}/3",
                                  "--ca-cert", str(cert), env=env))  # fmt: skip
        wait_for(lambda s: s["completed"] >= 1)
        clients[2].send_signal(signal.SIGKILL)
        clients[2].wait(10)
        wait_for(lambda s: s["completed"] >= 2)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        server = distml(*server_args)  # the same checkpoint directory: it resumes at round 3
        resumed = wait_for(lambda s: s["generation"] is not None)
        assert resumed["completed"] >= 2
        wait_for(lambda s: s["finished"])
        history = watch.get("/v1/history").json()["history"]
        for c in clients[:2]:
            out, err = c.communicate(timeout=60)
            assert c.returncode == 0, err[-2000:]
            assert json.loads(out)["rounds_trained"] >= 3
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    done = [h for h in history if h["status"] == "completed"]
    assert [h["round"] for h in done] == [1, 2, 3]
    assert done[0]["participants"] == 3
    # The restarted server remembers the killed client: asked, it is left out at the deadline.
    assert all(h["participants"] == 2 and h["dropped"] == 1 for h in done[2:]), history
    assert done[-1]["accuracy"] > 0.5
