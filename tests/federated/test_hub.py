"""The contribution hub over real HTTP on loopback: good deltas (full and LoRA) merged exactly as
their oracles say, harmful and malformed ones refused with their reason and nothing changed,
provenance that survives a restart byte for byte, and the command line end to end."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import torch
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from conftest import wait_for
from distml.data import digits
from distml.federated.hub import Hub, HubConfig
from distml.federated.hub_app import adapters_of, create_hub_app
from distml.federated.task import build_model, evaluate, get_params, set_params, train_local
from distml.net import BackgroundServer, decode_tensors, encode_tensors
from distml.net.ports import free_port

TOKENS = {name: f"{name}-token-0123456789abcdef" for name in ("alice", "bob", "mallory")}
VAL, TRAIN = digits("val"), digits("train")
V0 = get_params(build_model("digits-mlp", 0))
MAX_BODY = 2**16


@contextmanager
def serving(hub):
    app = create_hub_app(hub, TOKENS, max_body_bytes=MAX_BODY)
    with BackgroundServer(app) as server:
        yield server.url


def http(url, name):
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS[name]}"})


def post(client, body, base=0, kind="full"):
    return client.post("/v1/contributions", params={"base": base, "kind": kind}, content=body)


def fine_tuned(start, data=TRAIN, lr=0.1, seed=0):
    """The delta of one epoch of SGD from ``start``: what an honest contributor submits."""
    model = build_model("digits-mlp")
    set_params(model, start)
    return train_local(model, data, epochs=1, lr=lr, seed=seed).delta


@functools.cache
def good_delta():
    return fine_tuned(V0)


def body_of(delta, description="one epoch on the digits train set", **meta):
    return encode_tensors(delta, {"description": description, **meta})


def served(client, version=None):
    response = client.get("/v1/model", params={} if version is None else {"version": version})
    assert response.status_code == 200, response.text
    return decode_tensors(response.content)


def test_a_good_delta_becomes_version_1_with_its_provenance(tmp_path):
    hub = Hub(tmp_path, VAL)
    delta = good_delta()
    body = body_of(delta, contributor="bob")  # a claimed identity the hub must ignore
    with serving(hub) as url:
        alice = http(url, "alice")
        response = post(alice, body)
        assert response.status_code == 201, response.text
        record = response.json()
        params, meta = served(alice)
        log = alice.get("/v1/versions").json()
        replay = post(alice, body)
        missing = alice.get("/v1/model", params={"version": 2})
        v0, _ = served(alice, 0)

    assert record["version"] == 1 and meta["version"] == "1"
    assert record["contributor"] == "alice"  # from the token, not the payload
    assert (record["base"], record["parent"], record["stale"]) == (0, 0, False)
    assert record["kind"] == "full"
    assert record["sha256"] == hashlib.sha256(body).hexdigest()
    assert record["description"] == "one epoch on the digits train set"
    when = datetime.fromisoformat(record["time"])
    assert timedelta(0) <= datetime.now(UTC) - when < timedelta(minutes=5)
    for name, p in V0.items():
        assert torch.equal(v0[name], p)
        assert torch.equal(params[name], p + delta[name])  # exactly version 0 + delta
    model = build_model("digits-mlp")
    set_params(model, params)
    assert record["accuracy_after"] == evaluate(model, VAL)["accuracy"]
    assert record["accuracy_before"] == log["versions"][0]["accuracy_after"] < 0.2
    assert record["accuracy_after"] > 0.7
    assert log["versions"][1] == record and log["latest"] == 1
    assert json.loads(meta["provenance"])["sha256"] == record["sha256"]
    assert replay.status_code == 409 and "already merged as version 1" in replay.text
    assert missing.status_code == 404 and "no version 2" in missing.text
    assert hub.latest == 1 and [r["status"] for r in log["refusals"]] == []


def test_a_stale_base_is_judged_on_the_latest_version(tmp_path):
    hub = Hub(tmp_path, VAL, HubConfig(threshold=0.05))
    late = fine_tuned(V0, TensorDataset(*(t[700:] for t in TRAIN.tensors)), lr=0.01, seed=1)
    with serving(hub) as url:
        assert post(http(url, "alice"), body_of(good_delta())).status_code == 201
        v1, _ = served(http(url, "alice"))
        response = post(http(url, "bob"), body_of(late, "trained on version 0"), base=0)
        assert response.status_code == 201, response.text
        v2, _ = served(http(url, "bob"))
    record = response.json()
    assert (record["version"], record["base"], record["parent"], record["stale"]) == (2, 0, 1, True)
    assert record["accuracy_before"] == hub.versions[1]["accuracy_after"]
    assert all(torch.equal(v2[n], v1[n] + late[n]) for n in V0)


def test_a_harmful_delta_is_refused_for_the_accuracy_it_costs(tmp_path):
    hub = Hub(tmp_path, VAL)
    harmful = {n: -3.0 * d for n, d in good_delta().items()}
    with serving(hub) as url:
        assert post(http(url, "alice"), body_of(good_delta())).status_code == 201
        mallory = http(url, "mallory")
        before = mallory.get("/v1/model").content
        response = post(mallory, body_of(harmful, "better, trust me"), base=1)
        after = mallory.get("/v1/model").content
    assert response.status_code == 422
    refusal = hub.refusals[-1]
    reason = response.json()["detail"]
    assert reason == refusal["reason"]
    a, b = refusal["accuracy_before"], refusal["accuracy_after"]
    assert b < a - 0.01 and f"from {a:.4f} to {b:.4f}" in reason and "threshold 0.01" in reason
    assert refusal["contributor"] == "mallory" and refusal["description"] == "better, trust me"
    assert before == after and hub.latest == 1


ZEROS = {n: torch.zeros_like(p) for n, p in V0.items()}
LORA = {"net.1.lora_A": torch.zeros(4, 64), "net.1.lora_B": torch.zeros(32, 4)}
R4 = {"r": "4", "alpha": "8"}


@pytest.mark.parametrize(
    "body, base, kind, status, message",
    [
        (body_of(ZEROS | {"evil": torch.zeros(1)}), 0, "full", 422, "unknown parameters ['evil']"),
        (body_of({"net.1.weight": torch.zeros(3, 3)}), 0, "full", 422,
         "net.1.weight: got torch.float32 (3, 3), expected torch.float32 (32, 64)"),
        (body_of({"net.1.bias": torch.zeros(32, dtype=torch.float64)}), 0, "full", 422,
         "got torch.float64"),
        (body_of({"net.1.bias": torch.full((32,), float("inf"))}), 0, "full", 422, "non-finite"),
        (body_of({"net.1.bias": torch.full((32,), 10.0)}), 0, "full", 422,
         "delta norm 56.57 is above the bound 5"),
        (body_of({"net.1.bias": torch.zeros(MAX_BODY // 4)}), 0, "full", 413, "over the limit"),
        ((5).to_bytes(8, "little") + b"{nope", 0, "full", 400, "header is not JSON"),
        (encode_tensors(ZEROS), 0, "full", 422, "needs a description"),
        (body_of(ZEROS), 3, "full", 409, "unknown base version 3: this hub holds versions 0..0"),
        (body_of(ZEROS), None, "full", 422, "?base=V"),
        (body_of({"net.2.lora_A": torch.zeros(4, 32), "net.2.lora_B": torch.zeros(32, 4)}, **R4),
         0, "lora", 422, "'net.2' is not a Linear layer of the model; those are ['net.1', 'net.3"),
        (body_of(LORA | {"net.1.lora_A": torch.zeros(3, 64)}, **R4), 0, "lora", 422,
         "net.1.lora_A: got torch.float32 (3, 64), expected torch.float32 (4, 64) for rank r=4"),
        (body_of({"net.1.lora_A": torch.zeros(4, 64)}, **R4), 0, "lora", 422, "come in pairs"),
        (body_of(LORA), 0, "lora", 422, "needs integer r and alpha"),
        (body_of({"net.1.weight.lora_A": torch.zeros(4, 64)}, **R4), 0, "lora", 422,
         "'net.1.weight' is not a Linear layer"),
    ],
    ids=["unknown-name", "shape", "dtype", "non-finite", "norm", "oversized", "not-safetensors",
         "no-description", "unknown-base", "no-base", "lora-not-linear",
         "lora-rank", "lora-unpaired", "lora-no-rank", "lora-on-a-weight"],
)  # fmt: skip
def test_bad_contributions_are_refused_with_the_reason_and_change_nothing(
    tmp_path, body, base, kind, status, message
):
    hub = Hub(tmp_path, VAL, HubConfig(max_norm=5.0))
    files = sorted(p.name for p in tmp_path.iterdir())
    history = (tmp_path / "hub.json").read_bytes()
    with serving(hub) as url:
        alice = http(url, "alice")
        before = alice.get("/v1/model").content
        query = {"kind": kind} | ({} if base is None else {"base": base})
        response = alice.post("/v1/contributions", params=query, content=body)
        after = alice.get("/v1/model").content
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert before == after and hub.latest == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    assert (tmp_path / "hub.json").read_bytes() == history
    (refusal,) = hub.refusals
    assert refusal["reason"] == response.json()["detail"] and refusal["contributor"] == "alice"
    assert refusal["status"] == status and refusal["kind"] == kind and refusal["base"] == base


def test_every_route_needs_a_contributors_token(tmp_path):
    hub = Hub(tmp_path, VAL)
    with serving(hub) as url:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}):
            for path in ("/healthz", "/metrics", "/openapi.json", "/v1/model", "/v1/versions"):
                assert httpx.get(url + path, headers=headers).status_code == 401
            response = httpx.post(url + "/v1/contributions", params={"base": 0},
                                  content=body_of(good_delta()), headers=headers)  # fmt: skip
            assert response.status_code == 401 and "bearer token" in response.text
        assert http(url, "bob").get("/healthz").json()["latest"] == 0
    assert hub.latest == 0 and hub.refusals == []


def test_lora_adapters_merge_as_peft_merges_them(tmp_path):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    hub = Hub(tmp_path, VAL)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["net.1", "net.3"], lora_dropout=0.0)
    peft_model = get_peft_model(build_model("digits-mlp", 0), config)
    train_local(peft_model, TRAIN, epochs=1, lr=0.1)
    state = get_peft_model_state_dict(peft_model)
    formula = {
        f"{m}.weight": V0[f"{m}.weight"]
        + (8 / 4)
        * state[f"base_model.model.{m}.lora_B.weight"]
        @ state[f"base_model.model.{m}.lora_A.weight"]
        for m in ("net.1", "net.3")
    }
    tensors, meta = adapters_of(peft_model)
    body = body_of(tensors, "LoRA r=4 on both layers", **meta)
    oracle = get_params(peft_model.merge_and_unload())
    with serving(hub) as url:
        response = post(http(url, "alice"), body, kind="lora")
        assert response.status_code == 201, response.text
        params, _ = served(http(url, "alice"))
    record = response.json()
    assert (record["kind"], record["r"], record["alpha"]) == ("lora", 4, 8.0)
    assert record["accuracy_after"] > record["accuracy_before"]
    for name in V0:
        torch.testing.assert_close(params[name], oracle[name], rtol=0, atol=1e-6)
    for name, want in formula.items():
        torch.testing.assert_close(params[name], want, rtol=0, atol=1e-6)
    assert torch.equal(params["net.1.bias"], V0["net.1.bias"])


def test_a_restarted_hub_has_every_version_and_the_log(tmp_path):
    hub = Hub(tmp_path, VAL)
    hub.contribute("alice", body_of(good_delta()), base=0, kind="full")
    with pytest.raises(ValueError, match="unknown base"):
        hub.contribute("bob", body_of(ZEROS), base=7, kind="full")
    # What a crash between writing a version's file and the log leaves: files the log never named.
    (tmp_path / "v000002.safetensors").write_bytes(b"half a file")
    (tmp_path / "hub.json.tmp").write_text("{")

    again = Hub(tmp_path, VAL)
    assert again.log() == hub.log() and again.latest == 1
    for version in (0, 1):
        assert again.model_body(version) == hub.model_body(version)
    assert all(torch.equal(again.params[n], hub.params[n]) for n in V0)
    nudge = fine_tuned(again.params, lr=0.01)
    record = again.contribute("bob", body_of(nudge, "after the restart"), base=1, kind="full")
    assert (record["version"], record["parent"]) == (2, 1)
    assert decode_tensors(again.model_body(2)[1])[1]["version"] == "2"

    with pytest.raises(ValueError, match="holds a hub of 'digits-mlp', not 'digits-cnn'"):
        Hub(tmp_path, VAL, HubConfig(model="digits-cnn"))
    (tmp_path / "v000001.safetensors").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="its SHA-256 is not the one in hub.json"):
        Hub(tmp_path, VAL)


def test_version_0_can_be_a_safetensors_file(tmp_path):
    trained = {n: p + good_delta()[n] for n, p in V0.items()}
    initial = tmp_path / "trained.safetensors"
    initial.write_bytes(encode_tensors(trained))
    hub = Hub(tmp_path / "hub", VAL, initial=initial)
    assert all(torch.equal(hub.params[n], trained[n]) for n in V0)
    assert hub.versions[0]["sha256"] == hashlib.sha256(initial.read_bytes()).hexdigest()
    assert Hub(tmp_path / "hub", VAL, initial=initial).latest == 0  # the same file resumes
    assert Hub(tmp_path / "hub", VAL).latest == 0  # and so does no file
    other = tmp_path / "other.safetensors"
    other.write_bytes(encode_tensors(V0))
    with pytest.raises(ValueError, match="whose version 0 is not"):
        Hub(tmp_path / "hub", VAL, initial=other)
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(encode_tensors({"net.1.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match="not parameters of digits-mlp"):
        Hub(tmp_path / "new", VAL, initial=wrong)


@pytest.mark.distributed
def test_the_command_line_serves_contributes_and_prints_the_log(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": TOKENS["alice"]}))
    tokens.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DISTML_TOKEN": TOKENS["alice"], "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "distml", "fl", "hub"]

    def run(*args):
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=60)

    def listening():
        try:
            return http(url, "alice").get("/healthz").status_code == 200
        except httpx.TransportError:
            return server.poll() is not None  # a server that died: fail below, not by timeout

    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [*cli, "serve", "--tokens", str(tokens), "--dir", str(tmp_path / "hub"), "--port",
             str(port), "--threshold", "0.02"], env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for(listening, 60, "the hub to listen")
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            contribute = run("contribute", "--hub", url, "--data", "digits:0/2",
                             "--description", "half the digits")  # fmt: skip
            versions = run("versions", "--hub", url)
        finally:
            server.terminate()
            server.wait(30)
    assert contribute.returncode == 0, contribute.stderr
    assert versions.returncode == 0, versions.stderr
    record = json.loads(contribute.stdout)
    assert (record["version"], record["contributor"], record["base"]) == (1, "alice", 0)
    assert record["description"] == "half the digits"
    printed = json.loads(versions.stdout)
    assert printed["latest"] == 1 and printed["versions"][1] == record
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == [
        "hub.json", "refusals.json", "v000000.safetensors", "v000001.safetensors"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["serve", "--tokens", "{short}", "--dir", "{dir}"], {}, "not strings of >= 16"),
        (["serve", "--tokens", "{tokens}", "--dir", "{dir}", "--threshold", "2"], {},
         "threshold"),
        (["serve", "--tokens", "{tokens}", "--dir", "{dir}", "--model", "gpt"], {},
         "unknown model 'gpt'"),
        (["serve", "--tokens", "{tokens}", "--dir", "{dir}", "--max-norm", "inf"], {},
         "max_norm"),
        (["serve", "--tokens", "{tokens}", "--dir", "{dir}", "--max-loss-rise", "nan"], {},
         "max_loss_rise"),
        (["serve", "--tokens", "{tokens}", "--dir", "{dir}", "--max-body-mb", "inf"], {},
         "--max-body-mb must be a finite number > 0"),
        (["contribute", "--hub", "http://127.0.0.1:9", "--data", "digits:0/2",
          "--description", "x"], {"DISTML_TOKEN": ""}, "DISTML_TOKEN"),
        (["contribute", "--hub", "http://127.0.0.1:9", "--data", "digits:3/2",
          "--description", "x"], {}, "expected digits:K/N"),
        (["contribute", "--hub", "http://127.0.0.1:9", "--data", "{bad}", "--description", "x"],
         {}, "bad.safetensors: not a safetensors file"),
        (["contribute", "--hub", "http://127.0.0.1:9", "--data", "digits:0/2", "--lora", "0",
          "--description", "x"], {}, "--lora >= 1"),
        (["versions", "--hub", "http://127.0.0.1:9"], {"DISTML_TOKEN": "short"}, "DISTML_TOKEN"),
    ],
)  # fmt: skip
def test_bad_usage_exits_2_with_one_message(tmp_path, args, env, message):
    from distml.cli.main import app

    (tmp_path / "short.json").write_text(json.dumps({"alice": "short"}))
    (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
    (tmp_path / "bad.safetensors").write_text("not tensors")
    paths = {"short": tmp_path / "short.json", "tokens": tmp_path / "tokens.json",
             "bad": tmp_path / "bad.safetensors", "dir": tmp_path / "hub"}  # fmt: skip
    argv = ["fl", "hub", *(a.format(**paths) for a in args)]
    result = CliRunner().invoke(app, argv, env={"DISTML_TOKEN": TOKENS["alice"], **env})
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "hub").exists()
