"""The federated server over real HTTP on loopback: rounds against their oracle, refusals of bad
input, dropouts, late updates, quorums and resumption after a restart."""

import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distml.data import digits
from distml.federated.app import create_fl_app
from distml.federated.client import FederatedClient, run_clients
from distml.federated.server import MAX_ROUND_ERRORS, FederatedServer, ServerConfig
from distml.federated.strategy import LocalConfig, make_strategy
from distml.federated.task import build_model, get_params, set_params
from distml.net import BackgroundServer, ServiceError, encode_tensors

TOKENS = {name: f"{name}-token-0123456789abcdef" for name in ("a", "b", "c")}
VAL = digits("val")


def make_server(tmp_path=None, *, strategy="fedavg", local=None, server_lr=None, **config):
    settings = {"rounds": 1, "min_available": 3, "round_timeout_s": 30.0, **config}
    extra = {} if server_lr is None else {"server_lr": server_lr}
    strat = make_strategy(strategy, fraction_fit=1.0, min_fit_clients=1, local=local, **extra)
    return FederatedServer(ServerConfig(**settings), strat, VAL, checkpoint_dir=tmp_path)


@contextmanager
def serving(server):
    with BackgroundServer(create_fl_app(server, TOKENS, max_body_bytes=2**20)) as bg:
        yield bg.url


def http(url, name):
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS[name]}"})


def zeros_like_model(**changes):
    delta = {n: torch.zeros_like(p) for n, p in get_params(build_model("digits-mlp")).items()}
    return delta | changes


def post(client, delta, round_number=1, examples="10"):
    meta = {"num_examples": examples} if examples is not None else {}
    return client.post("/v1/update", params={"round": round_number},
                       content=encode_tensors(delta, meta))  # fmt: skip


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def register_all(url):
    for name in TOKENS:
        assert http(url, name).post("/v1/register").status_code == 200


def test_fedsgd_rounds_over_http_equal_full_batch_gradient_descent_on_the_union():
    train = digits("train")
    parts = [range(0, 90), range(90, 130), range(130, 300)]
    datasets = [TensorDataset(*(t[list(p)] for t in train.tensors)) for p in parts]
    local = LocalConfig(epochs=1, batch_size=0, lr=0.5)
    server = make_server(rounds=2, local=local)
    start = get_params(server.model)
    with serving(server) as url:
        clients = [
            FederatedClient(url, TOKENS[n], d) for n, d in zip(TOKENS, datasets, strict=True)
        ]
        thread = threading.Thread(target=run_clients, args=(clients,), daemon=True)
        thread.start()
        thread.join(120)
    assert server.finished and [h["participants"] for h in server.history] == [3, 3]
    model = build_model("digits-mlp")
    set_params(model, start)
    x, y = (t[:300] for t in train.tensors)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for name, want in get_params(model).items():
        torch.testing.assert_close(server.params[name], want, rtol=1e-5, atol=1e-6)
    assert server.history[-1]["bytes_up"] > 0 and server.history[-1]["bytes_down"] > 0


@pytest.mark.parametrize(
    "body, status, message",
    [
        (lambda d: b"not safetensors", 400, ""),
        (lambda d: encode_tensors(d), 422, "num_examples is missing"),
        (lambda d: encode_tensors(d | {"evil": torch.zeros(1)}, {"num_examples": "1"}), 422,
         "unknown ['evil']"),
        (lambda d: encode_tensors(d | {"net.1.weight": torch.zeros(3, 3)}, {"num_examples": "1"}),
         422, "expected torch.float32 (32, 64)"),
        (lambda d: encode_tensors(d | {"net.1.bias": torch.zeros(32, dtype=torch.float64)},
                                  {"num_examples": "1"}), 422, "got torch.float64"),
        (lambda d: encode_tensors(d | {"net.1.bias": torch.full((32,), float("nan"))},
                                  {"num_examples": "1"}), 422, "non-finite"),
        (lambda d: encode_tensors(d | {"net.1.bias": torch.full((32,), 10.0)},
                                  {"num_examples": "1"}), 422, "above the bound 1"),
        (lambda d: encode_tensors(d, {"num_examples": "0"}), 422, "num_examples must be >= 1"),
        (lambda d: b"\0" * (2**20 + 1), 413, "over the limit"),
        (lambda d: encode_tensors(d, {"num_examples": "9" * 400}), 422, "num_examples"),
        (lambda d: encode_tensors(d, {"num_examples": "1e400"}), 422, "num_examples"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": '{"accuracy": 0.5}'}),
         422, "needs both"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": "[" * 2000 + "]" * 2000}),
         422, "nested deeper"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": '{"x": {"y": 1}}'}),
         422, "nested deeper"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": '{"x": NaN}'}),
         422, "not a JSON number"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": f'{{"x": 1{"0" * 400}}}'}),
         422, "too large"),
        (lambda d: encode_tensors(d, {"num_examples": "10", "metrics": '[1, 2]'}), 422,
         "JSON object"),
        (lambda d: encode_tensors(d, {"num_examples": "10",
                                      "metrics": '{"loss": 1.0, "accuracy": 7.0}'}),
         422, "accuracy in [0, 1]"),
    ],
)  # fmt: skip
def test_bad_updates_are_refused_and_change_nothing(body, status, message):
    server = make_server(max_update_norm=1.0)
    before = {n: t.clone() for n, t in server.params.items()}
    with serving(server) as url:
        register_all(url)
        wait_until(lambda: server.round is not None)
        a = http(url, "a")
        response = a.post("/v1/update", params={"round": 1}, content=body(zeros_like_model()))
        assert response.status_code == status and message in response.text
        assert all(torch.equal(server.params[n], before[n]) for n in before)
        assert server.round.updates == {} and server.round.open
        # The refused client may still answer properly.
        assert post(a, zeros_like_model()).status_code == 200


def test_tokens_say_who_calls_and_gate_every_route():
    server = make_server()
    with serving(server) as url:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            for path in ("/healthz", "/metrics", "/v1/status", "/v1/model", "/openapi.json"):
                assert httpx.get(url + path, headers=headers).status_code == 401
        register_all(url)
        wait_until(lambda: server.round is not None)
        a = http(url, "a")
        assert post(a, zeros_like_model()).status_code == 200
        again = post(a, zeros_like_model())
        assert again.status_code == 409 and "already answered" in again.text
        assert post(a, zeros_like_model(), round_number=2).status_code == 409
        assert set(server.round.updates) == {"a"}  # "a" cannot answer for "b"
        assert "distml_fl_updates" in a.get("/metrics").text


def test_dropouts_are_left_out_and_late_updates_refused():
    server = make_server(round_timeout_s=1.5, quorum=0.5, max_update_norm=1.0)
    one = zeros_like_model(**{"net.1.bias": torch.full((32,), 0.1)})
    with serving(server) as url:
        register_all(url)
        wait_until(lambda: server.round is not None)
        assert post(http(url, "a"), one, examples="30").status_code == 200
        assert post(http(url, "b"), zeros_like_model(), examples="10").status_code == 200
        wait_until(lambda: server.finished)  # "c" never answers: the deadline closes the round
        late = post(http(url, "c"), zeros_like_model())
        assert late.status_code == 409 and "late" in late.text
        history = http(url, "a").get("/v1/history").json()
    record = history["history"][0]
    assert (record["participants"], record["dropped"], record["status"]) == (2, 1, "completed")
    assert history["summary"]["late_updates"] == 1
    start = get_params(build_model("digits-mlp"))
    torch.testing.assert_close(server.params["net.1.bias"], start["net.1.bias"] + 0.075)


def test_a_client_that_leaves_is_not_waited_for_and_may_not_answer_after():
    server = make_server(round_timeout_s=600, quorum=0.5)  # only the leave can end this round
    with serving(server) as url:
        register_all(url)
        wait_until(lambda: server.round is not None)
        assert post(http(url, "a"), zeros_like_model()).status_code == 200
        assert post(http(url, "b"), zeros_like_model()).status_code == 200
        assert http(url, "c").post("/v1/leave").status_code == 200
        wait_until(lambda: server.finished)
        assert "c" not in server.available()
        after = post(http(url, "c"), zeros_like_model())
        assert after.status_code == 409
        assert http(url, "c").get("/v1/task").status_code == 204  # and asking again is presence
    record = server.history[0]
    assert (record["status"], record["participants"], record["dropped"]) == ("completed", 2, 1)


def test_a_round_short_of_its_quorum_is_run_again_with_a_fresh_sample():
    server = make_server(round_timeout_s=1.0, quorum=1.0)
    with serving(server) as url:
        register_all(url)
        wait_until(lambda: server.round is not None)
        assert post(http(url, "a"), zeros_like_model()).status_code == 200
        wait_until(lambda: server.round.attempt == 2)  # "b" and "c" were silent: failed
        assert server.completed == 0 and server.round.number == 1
        for name in TOKENS:
            assert post(http(url, name), zeros_like_model()).status_code == 200
        wait_until(lambda: server.finished)
    assert [h["status"] for h in server.history] == ["failed", "completed"]


def test_a_restarted_server_resumes_after_its_last_completed_round(tmp_path):
    local = LocalConfig(epochs=1, batch_size=0, lr=0.5)
    datasets = [TensorDataset(*(t[i::3][:60] for t in digits("train").tensors)) for i in range(3)]

    def run(server):
        with serving(server) as url:
            clients = [
                FederatedClient(url, TOKENS[n], d) for n, d in zip(TOKENS, datasets, strict=True)
            ]
            run_clients(clients)

    first = make_server(tmp_path, strategy="fedadam", local=local, rounds=2, server_lr=0.05)
    run(first)
    resumed = make_server(tmp_path, strategy="fedadam", local=local, rounds=4, server_lr=0.05)
    assert resumed.completed == 2 and len(resumed.history) == 2
    assert all(torch.equal(resumed.params[n], first.params[n]) for n in first.params)
    assert all(torch.equal(resumed.strategy.v[n], first.strategy.v[n]) for n in first.params)
    run(resumed)
    assert [h["round"] for h in resumed.history] == [1, 2, 3, 4]
    # Four rounds in one go end where the interrupted run ended.
    straight = make_server(tmp_path / "straight", strategy="fedadam", local=local, rounds=4,
                           server_lr=0.05)  # fmt: skip
    run(straight)
    for n in straight.params:
        torch.testing.assert_close(resumed.params[n], straight.params[n])
    with pytest.raises(ValueError, match="not of 'digits-cnn'"):
        make_server(tmp_path, model="digits-cnn")


class NoLossClient(FederatedClient):
    """A client whose metrics carry an accuracy without its loss."""

    def train(self, task):
        delta, examples, metrics = super().train(task)
        return delta, examples, {"accuracy": metrics["accuracy"]}


def test_a_federation_with_a_malformed_client_completes_its_rounds_with_the_honest_ones():
    # Each round the malformed client's update is refused; it then leaves, so that the round
    # closes on the honest ones' updates (no deadline), and comes back for the next round.
    server = make_server(rounds=2, round_timeout_s=600, quorum=0.5)
    data = TensorDataset(*(t[:60] for t in digits("train").tensors))
    with serving(server) as url:
        honest = [FederatedClient(url, TOKENS[n], data) for n in ("a", "b")]
        refused = []

        def attack():
            for _ in range(server.config.rounds):
                bad = NoLossClient(url, TOKENS["c"], data)
                try:
                    run_clients([bad])
                    return  # the server finished without refusing it
                except ServiceError as exc:
                    refused.append((exc.status, str(exc)))
                    bad.leave()

        threads = [threading.Thread(target=attack, daemon=True),
                   threading.Thread(target=run_clients, args=(honest,), daemon=True)]  # fmt: skip
        for thread in threads:
            thread.start()
        wait_until(lambda: server.finished, timeout=60)
        health = http(url, "a").get("/healthz")
    assert [status for status, _ in refused] == [422, 422], refused
    assert all("an evaluation needs both" in message for _, message in refused), refused
    assert [(h["status"], h["participants"], h["dropped"]) for h in server.history] == [
        ("completed", 2, 1)
    ] * 2
    assert server.late == 0 and health.status_code == 200


def answer_round(url, attempt):
    wait_until(lambda: server_attempt(url) == attempt)
    for name in TOKENS:
        assert post(http(url, name), zeros_like_model()).status_code == 200


def server_attempt(url):
    status = http(url, "a").get("/v1/status").json()
    return status["attempt"] if status["open"] else None


def test_an_error_inside_a_round_fails_that_round_only_and_the_next_one_runs(monkeypatch):
    server = make_server()
    before = {n: t.clone() for n, t in server.params.items()}
    evaluate = server._evaluate
    calls = []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("evaluation broke")
        return evaluate()

    monkeypatch.setattr(server, "_evaluate", fails_once)
    with serving(server) as url:
        register_all(url)
        answer_round(url, 1)
        answer_round(url, 2)  # the failed round is opened again
        wait_until(lambda: server.finished)
        assert http(url, "a").get("/healthz").status_code == 200
    first, second = server.history
    assert first["status"] == "failed" and "evaluation broke" in first["reason"]
    assert second["status"] == "completed" and server.completed == 1
    assert all(torch.equal(server.params[n], before[n]) for n in before)  # zero updates


def test_a_round_loop_that_keeps_failing_turns_the_service_unhealthy(monkeypatch):
    server = make_server()

    def broken():
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(server, "_evaluate", broken)
    with serving(server) as url:
        register_all(url)
        for attempt in range(1, MAX_ROUND_ERRORS + 1):
            answer_round(url, attempt)
        a = http(url, "a")
        wait_until(lambda: a.get("/healthz").status_code == 503)
        assert "rounds in a row ended in an error" in a.get("/healthz").text
    assert [h["status"] for h in server.history] == ["failed"] * MAX_ROUND_ERRORS
    assert server.completed == 0
