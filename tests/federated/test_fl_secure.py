"""Secure aggregation inside real rounds over HTTP: the model it gives is the plain round's (to
the quantisation step), a client that drops out after sharing its keys leaves exactly the
survivors' mean, and the server never holds a client's update."""

import base64
import json
import threading

import httpx
import torch
from torch.utils.data import TensorDataset

from conftest import wait_for
from distml.data import digits
from distml.federated.app import create_fl_app
from distml.federated.client import FederatedClient, run_clients
from distml.federated.secagg import SecAggClient, SecAggParams
from distml.federated.secure_aggregation import SecureAggregation
from distml.federated.server import FederatedServer, ServerConfig
from distml.federated.strategy import LocalConfig, make_strategy
from distml.net import BackgroundServer
from distml.net.ports import free_port

NAMES = ("a", "b", "c", "d")
TOKENS = {name: f"{name}-secure-token-0123456789" for name in NAMES}
TRAIN = digits("train")
DATA = {n: TensorDataset(*(t[i * 70 : i * 70 + 40 + 10 * i] for t in TRAIN.tensors))
        for i, n in enumerate(NAMES)}  # fmt: skip


def run_round(names, *, secure, silent=(), timeout=30.0, on_url=None):
    """One FedSGD round; clients in ``silent`` are selected but never send their update."""
    config = ServerConfig(rounds=1, min_available=len(names), round_timeout_s=timeout)
    local = LocalConfig(epochs=1, batch_size=0, lr=0.5)
    strategy = make_strategy("fedavg", fraction_fit=1.0, local=local)
    if secure:
        strategy = SecureAggregation(strategy, threshold=0.5, stage_timeout_s=timeout)
    server = FederatedServer(config, strategy, digits("val"))
    tokens = {n: TOKENS[n] for n in names}
    with BackgroundServer(create_fl_app(server, tokens)) as bg:
        for n in silent:
            httpx.post(bg.url + "/v1/register", headers=auth(n)).raise_for_status()
        if on_url is not None:
            side = threading.Thread(target=on_url, args=(bg.url, server), daemon=True)
            side.start()
        clients = [FederatedClient(bg.url, TOKENS[n], DATA[n]) for n in names if n not in silent]
        run_clients(clients)
    return server


def auth(name):
    return {"Authorization": f"Bearer {TOKENS[name]}"}


def test_a_secure_round_gives_the_plain_rounds_model_and_never_holds_an_update():
    plain = run_round(NAMES[:3], secure=False)
    secure = run_round(NAMES[:3], secure=True)
    assert secure.history[0]["secure"] and secure.history[0]["participants"] == 3
    assert secure.round.updates == {}  # only masked vectors reached the server
    for name, want in plain.params.items():
        # Each coordinate is quantised to 2^-20: three clients, weights > 0.4 each.
        torch.testing.assert_close(secure.params[name], want, rtol=0, atol=1e-5)


def drop_after_sharing_keys(url, server):
    """Client d advertises its keys and sends its shares, then leaves before masking."""
    task = None
    while task is None:
        response = httpx.get(url + "/v1/task", headers=auth("d"))
        task = response.json() if response.status_code == 200 else None
    info, r = task["secagg"], task["round"]
    protocol = SecAggClient(info["id"], SecAggParams(**info["params"]))
    post = {"headers": auth("d"), "params": {"round": r}}
    httpx.post(url + "/v1/secagg/advertise", content=json.dumps(protocol.advertise()), **post)
    while True:
        keys = httpx.get(url + "/v1/secagg/share_keys", timeout=60,
                         params={"round": r, "wait": 20}, headers=auth("d"))  # fmt: skip
        if keys.status_code == 200:
            break
    shares = protocol.share_keys(keys.json())
    httpx.post(url + "/v1/secagg/share_keys", content=json.dumps(shares), **post).raise_for_status()
    httpx.post(url + "/v1/leave", headers=auth("d")).raise_for_status()


def test_a_client_leaving_after_sharing_keys_leaves_exactly_the_survivors_mean():
    # d's pairwise masks are in the survivors' inputs: the server rebuilds them from t shares.
    # d says it leaves, so no stage waits for it: no deadline decides this round.
    secure = run_round(NAMES, secure=True, silent=("d",), on_url=drop_after_sharing_keys)
    record = secure.history[0]
    assert (record["status"], record["participants"], record["dropped"]) == ("completed", 3, 1)
    plain = run_round(NAMES[:3], secure=False)
    for name, want in plain.params.items():
        torch.testing.assert_close(secure.params[name], want, rtol=0, atol=1e-5)


def advertise_a_low_order_key(seen):
    """Client d advertises the all-zero X25519 key and is refused; once the others have
    advertised, ``seen`` records what the advertising stage still waits for (d alone: the refused
    key counts for nothing), and d leaves, so that no deadline decides the round."""

    def client_d(url, server):
        task = None
        while task is None:
            response = httpx.get(url + "/v1/task", headers=auth("d"))
            task = response.json() if response.status_code == 200 else None
        keys = {
            "c_pk": base64.b64encode(bytes(32)).decode(),
            "s_pk": base64.b64encode(bytes(32)).decode(),
        }
        refused = httpx.post(url + "/v1/secagg/advertise", content=json.dumps(keys),
                             headers=auth("d"), params={"round": task["round"]})  # fmt: skip
        seen["refusal"] = (refused.status_code, refused.text)
        stages = server.round.secure
        try:
            wait_for(lambda: len(stages.server.waiting_for()) < 2, 30, "a and b to advertise")
            seen["waiting"] = (stages.open_stage(), stages.server.waiting_for(), stages.ids["d"])
        finally:
            httpx.post(url + "/v1/leave", headers=auth("d")).raise_for_status()

    return client_d


def test_a_client_advertising_a_low_order_key_is_refused_and_the_honest_ones_finish():
    seen = {}
    secure = run_round(NAMES[:2] + ("d",), secure=True, silent=("d",),
                       on_url=advertise_a_low_order_key(seen))  # fmt: skip
    status, text = seen["refusal"]
    assert status == 422 and "low-order" in text
    stage, waiting, d = seen["waiting"]
    assert (stage, waiting) == ("advertise", {d})
    record = secure.history[0]
    assert (record["status"], record["participants"], record["dropped"]) == ("completed", 2, 1)
    plain = run_round(NAMES[:2], secure=False)
    for name, want in plain.params.items():
        # Each coordinate is quantised to 2^-20: two clients, weights > 0.4 each.
        torch.testing.assert_close(secure.params[name], want, rtol=0, atol=1e-5)


def test_malformed_secure_aggregation_messages_are_answered_4xx():
    config = ServerConfig(rounds=1, min_available=2)
    strategy = SecureAggregation(make_strategy("fedavg", fraction_fit=1.0), threshold=0.5)
    server = FederatedServer(config, strategy, digits("val"))
    with BackgroundServer(
        create_fl_app(server, {n: TOKENS[n] for n in NAMES[:2]}), free_port()
    ) as bg:
        for n in NAMES[:2]:
            httpx.post(bg.url + "/v1/register", headers=auth(n)).raise_for_status()
        while server.round is None:
            httpx.get(bg.url + "/v1/status", params={"wait": 1}, headers=auth("a"))
        for stage, body in [("advertise", "[" * 3000 + "]" * 3000), ("advertise", "x" * 10**6),
                            ("advertise", '{"c_pk": 1, "s_pk": [2]}'), ("masked_input", b"junk"),
                            ("share_keys", "NaN")]:  # fmt: skip
            response = httpx.post(bg.url + f"/v1/secagg/{stage}", content=body,
                                  params={"round": 1}, headers=auth("a"))  # fmt: skip
            assert 400 <= response.status_code < 500, (stage, response.text)
        assert server.round.secure.server.waiting_for() == {0, 1}
        assert httpx.get(bg.url + "/healthz", headers=auth("a")).status_code == 200
