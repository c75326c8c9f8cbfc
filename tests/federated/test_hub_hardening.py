"""The contribution hub against a contributor who means harm: numerically broken models refused
with the hub's history unchanged and its growth intact, a refusal log that stays small under a
flood, queries and kinds outside their bounds refused before they reach the hub, a failure of the
hub's own while judging that drops the contribution and not the hub, and a tokens file that
others can read named on stderr."""

from __future__ import annotations

import functools
import inspect
import json
import threading
from contextlib import contextmanager

import httpx
import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import wait_for
from distml.cli.fl_hub import serve
from distml.cli.tokens import read_tokens
from distml.data import digits
from distml.federated.hub import Hub, HubConfig
from distml.federated.hub_app import create_hub_app
from distml.federated.task import build_model, get_params, set_params, train_local
from distml.net import BackgroundServer, encode_tensors

TOKENS = {name: f"{name}-token-0123456789abcdef" for name in ("alice", "mallory")}
VAL, TRAIN = digits("val"), digits("train")
HALF = TensorDataset(*(t[::2] for t in TRAIN.tensors))
V0 = get_params(build_model("digits-mlp", 0))
LAST = "net.3.weight"


@contextmanager
def serving(hub, **options):
    app = create_hub_app(hub, TOKENS, max_body_bytes=2**16, **options)
    with BackgroundServer(app) as server:
        yield server.url


def http(url, name="alice"):
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS[name]}"})


def post(client, delta, base, description="an honest epoch", kind="full"):
    body = encode_tensors(delta, {"description": description})
    return client.post("/v1/contributions", params={"base": base, "kind": kind}, content=body)


def fine_tuned(start, data=TRAIN, lr=0.1):
    model = build_model("digits-mlp")
    set_params(model, start)
    return train_local(model, data, epochs=1, lr=lr, seed=0).delta


@functools.cache
def good_delta():
    return fine_tuned(V0)


def scaled_last_layer(params, factor):
    """The delta that multiplies the last layer by ``factor``: every argmax, and so the
    accuracy, stays as it was."""
    return {LAST: params[LAST] * (factor - 1)}


def history(hub):
    return (hub.directory / "hub.json").read_bytes(), hub.model_body()


# Under the default bound on the norm, the norm refuses both; with the bound lifted, the rules on
# the held-out outputs and loss must refuse them on their own.
@pytest.mark.parametrize(
    "config, huge, scaled",
    [
        (HubConfig(), "is above the bound 100", "is above the bound 100"),
        (HubConfig(max_norm=1e300), "held-out outputs would not be finite",
         "held-out loss would rise from"),
    ],
    ids=["default-norm-bound", "norm-bound-lifted"],
)  # fmt: skip
def test_numerically_broken_models_are_refused_and_honest_ones_still_merge(
    tmp_path, config, huge, scaled
):
    hub = Hub(tmp_path, VAL, config)
    attacks = [
        (0, {n: torch.full_like(p, 3e38) for n, p in V0.items()}, huge),
        (0, scaled_last_layer(V0, 1e30), scaled),
    ]
    with serving(hub) as url:
        mallory, alice = http(url, "mallory"), http(url, "alice")
        for base, delta, reason in attacks:
            before = history(hub)
            response = post(mallory, delta, base, "a better model, trust me")
            assert response.status_code == 422, response.text
            assert reason in response.json()["detail"]
            assert history(hub) == before and hub.latest == 0
        assert post(alice, good_delta(), 0).status_code == 201
        v1 = dict(hub.params)
        before = history(hub)
        response = post(mallory, scaled_last_layer(v1, 1e30), 1, "sharper, same accuracy")
        assert response.status_code == 422 and scaled in response.json()["detail"]
        assert history(hub) == before
        honest = post(alice, fine_tuned(v1, HALF), 1, "half the digits")
        versions = alice.get("/v1/versions")  # the log holds no NaN that JSON cannot carry
    assert honest.status_code == 201, honest.text
    assert honest.json()["version"] == 2 and hub.latest == 2
    assert versions.status_code == 200, versions.text
    log = versions.json()
    assert [r["contributor"] for r in log["refusals"]] == ["mallory"] * 3
    assert [v["contributor"] for v in log["versions"]] == [None, "alice", "alice"]


def test_a_loss_that_rises_at_unchanged_accuracy_is_refused(tmp_path):
    hub = Hub(tmp_path, VAL)
    hub.contribute("alice", encode_tensors(good_delta(), {"description": "d"}), base=0,
                   kind="full")  # fmt: skip
    ten_times = encode_tensors(scaled_last_layer(hub.params, 10.0), {"description": "x10"})
    before = history(hub)
    with pytest.raises(ValueError, match="held-out loss would rise from 0.8979 to 1.16"):
        hub.contribute("mallory", ten_times, base=1, kind="full")
    refusal = hub.refusals[-1]
    assert refusal["accuracy_after"] == refusal["accuracy_before"]
    assert refusal["loss_after"] > refusal["loss_before"] + 0.1
    assert history(hub) == before

    lenient = Hub(tmp_path / "lenient", VAL, HubConfig(max_loss_rise=0.5))
    lenient.contribute("alice", encode_tensors(good_delta(), {"description": "d"}), base=0,
                       kind="full")  # fmt: skip
    assert lenient.contribute("bob", ten_times, base=1, kind="full")["version"] == 2


def test_a_model_whose_outputs_are_not_finite_is_not_a_version_0(tmp_path):
    broken = tmp_path / "broken.safetensors"
    # Finite weights whose logits overflow: every hidden unit near float32's largest, summed.
    overflow = {"net.1.bias": torch.full((32,), 3e38), LAST: torch.ones_like(V0[LAST])}
    broken.write_bytes(encode_tensors(V0 | overflow))
    with pytest.raises(ValueError, match="held-out outputs are not finite"):
        Hub(tmp_path / "hub", VAL, initial=broken)
    assert not (tmp_path / "hub" / "hub.json").exists()


def test_many_refusals_keep_the_log_bounded_and_counted(tmp_path):
    hub = Hub(tmp_path, VAL, HubConfig(refusals_kept=10))
    history = (tmp_path / "hub.json").read_bytes()
    long = "x" * 4000
    names = {f"{i:05d}-{long[:200]}": torch.zeros(1) for i in range(100)}
    for i in range(60):
        body = encode_tensors(names, {"description": f"{i} {long[:3990]}"})
        with pytest.raises(ValueError, match=r"unknown parameters \[.*\] and 92 more"):
            hub.contribute("mallory", body, base=0, kind="full")
    with pytest.raises(ValueError, match="unknown base version 9"):
        hub.contribute("alice", encode_tensors(V0, {"description": "late"}), base=9, kind="full")

    log = hub.log()
    assert (tmp_path / "hub.json").read_bytes() == history
    assert len(log["refusals"]) == 10 and log["refusals"][-1]["base"] == 9
    assert log["refusals"][0]["description"].startswith("51 x")
    assert log["refused"] == {"total": 61, "by_status": {"422": 60, "409": 1},
                              "by_contributor": {"mallory": 60, "alice": 1}}  # fmt: skip
    assert all(len(json.dumps(r)) < 2000 for r in log["refusals"])
    assert (tmp_path / "refusals.json").stat().st_size < 10 * 2000
    again = Hub(tmp_path, VAL, HubConfig(refusals_kept=10))
    assert again.log() == log and again.health()["refused"] == 61


def test_a_refusal_log_of_an_older_hub_is_counted_and_cut(tmp_path):
    hub = Hub(tmp_path, VAL)
    old = json.loads((tmp_path / "hub.json").read_text())
    refusals = [{"contributor": "mallory", "status": 422, "reason": f"no {i}"} for i in range(30)]
    (tmp_path / "hub.json").write_text(json.dumps(old | {"format": 1, "refusals": refusals}))
    (tmp_path / "refusals.json").unlink()
    again = Hub(tmp_path, VAL, HubConfig(refusals_kept=5))
    assert again.refusals == refusals[-5:] and again.refused["total"] == 30
    assert again.latest == hub.latest == 0


@pytest.mark.parametrize(
    "path, query",
    [
        ("/v1/contributions", {"base": 0, "kind": "diff"}),
        ("/v1/contributions", {"base": 0, "kind": "k" * 12_000}),
        ("/v1/contributions", {"base": -1}),
        ("/v1/contributions", {"base": "1" * 401}),
        ("/v1/contributions", {"base": "1e3"}),
        ("/v1/model", {"version": -1}),
        ("/v1/model", {"version": "9" * 401}),
        ("/v1/model", {"version": "NaN"}),
    ],
    ids=["kind", "long-kind", "negative-base", "huge-base", "float-base", "negative-version",
         "huge-version", "nan-version"],
)  # fmt: skip
def test_queries_out_of_bounds_are_422_and_log_nothing(tmp_path, path, query):
    hub = Hub(tmp_path, VAL)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    body = encode_tensors(good_delta(), {"description": "fine"})
    with serving(hub) as url:
        client = http(url)
        if path == "/v1/contributions":
            response = client.post(path, params=query, content=body)
        else:
            response = client.get(path, params=query)
        healthy = client.get("/healthz")
    assert response.status_code == 422, response.text
    assert healthy.status_code == 200 and healthy.json()["refused"] == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    assert hub.refusals == [] and hub.latest == 0


def test_the_openapi_document_declares_the_contribution_and_its_bounds(tmp_path):
    with serving(Hub(tmp_path, VAL)) as url:
        document = http(url).get("/openapi.json").json()
    route = document["paths"]["/v1/contributions"]["post"]
    body = route["requestBody"]["content"]["application/octet-stream"]["schema"]
    assert body == {"type": "string", "format": "binary", "maxLength": 2**16}
    query = {p["name"]: p["schema"] for p in route["parameters"]}
    assert query["kind"]["enum"] == ["full", "lora"]
    assert query["base"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}


@pytest.mark.parametrize("failing", ["_write_log", "_evaluate"])
def test_a_failure_while_judging_drops_the_contribution_and_the_hub_goes_on(
    tmp_path, monkeypatch, failing
):
    hub = Hub(tmp_path, VAL)
    real = getattr(Hub, failing)
    calls = []

    def fail_once(self, *args):
        calls.append(failing)
        if len(calls) == 1:
            raise OSError("no space left on device")
        return real(self, *args)

    monkeypatch.setattr(Hub, failing, fail_once)
    before = history(hub)
    with serving(hub) as url:
        alice = http(url)
        failed = post(alice, good_delta(), 0)
        after = history(hub), alice.get("/healthz")
        accepted = post(alice, good_delta(), 0)
    assert failed.status_code == 500 and "OSError" in failed.json()["detail"]
    assert after[0] == before and after[1].status_code == 200
    assert hub.refusals[0]["status"] == 500 and hub.refused["total"] == 1
    assert accepted.status_code == 201 and accepted.json()["version"] == 1
    assert Hub(tmp_path, VAL).log()["versions"] == hub.log()["versions"]


def test_contributions_past_the_pending_bound_wait_for_their_turn(tmp_path, monkeypatch):
    hub = Hub(tmp_path, VAL)
    entered, release = threading.Event(), threading.Event()
    calls = []
    real = Hub.contribute

    def held(self, *args, **kwargs):
        calls.append(kwargs["base"])
        entered.set()
        release.wait(60)
        return real(self, *args, **kwargs)

    def waiting(url):
        metrics = http(url).get("/metrics").text
        return "distml_hub_contributions_waiting 1.0" in metrics

    monkeypatch.setattr(Hub, "contribute", held)
    answers: dict[str, httpx.Response] = {}

    def send(url, name, delta):
        answers[name] = post(http(url, name), delta, 0, f"from {name}")

    with serving(hub, max_pending=1) as url:
        first = threading.Thread(target=send, args=(url, "alice", good_delta()))
        first.start()
        wait_for(entered.is_set, 30, "the first contribution to be judged")
        late = fine_tuned(V0, HALF, lr=0.01)
        second = threading.Thread(target=send, args=(url, "mallory", late))
        second.start()
        wait_for(lambda: waiting(url), 30, "the second contribution to wait for its turn")
        assert calls == [0]
        release.set()
        first.join(60)
        second.join(60)
    assert answers["alice"].status_code == 201, answers["alice"].text
    assert answers["mallory"].status_code == 201, answers["mallory"].text
    assert calls == [0, 0] and hub.latest == 2 and hub.refusals == []


def test_a_tokens_file_that_others_can_read_is_named_on_stderr(tmp_path, capsys):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    tokens.chmod(0o640)
    assert read_tokens(tokens) == TOKENS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tokens) in err and "0640" in err
    assert not any(token in err for token in TOKENS.values())
    tokens.chmod(0o600)
    assert read_tokens(tokens) == TOKENS
    assert capsys.readouterr().err == ""


def test_the_command_line_defaults_are_the_hubs():
    options = inspect.signature(serve).parameters
    defaults = HubConfig()
    for name in ("threshold", "max_norm", "max_loss_rise"):
        assert options[name].default == getattr(defaults, name)


def test_a_client_refuses_what_a_hub_should_never_send(tmp_path):
    from fastapi import FastAPI
    from starlette.responses import Response

    from distml.federated.hub_app import HubClient
    from distml.net import ServiceError

    liar = FastAPI()
    liar.get("/v1/model")(lambda: Response(encode_tensors(V0, {"model": "../../x"})))
    liar.get("/v1/versions")(lambda: Response("[" * 100_000 + "]" * 100_000))
    with BackgroundServer(liar) as server:
        client = HubClient(server.url, TOKENS["alice"], retry_s=0)
        with pytest.raises(ServiceError, match="not a model of a hub"):
            client.model()
        with pytest.raises(ServiceError, match="nested deeper than 16"):
            client.versions()
        client.close()
