"""Strategies against their definitions: FedAvg against large-batch SGD, the server optimizers
against Reddi et al.'s update, and the robust rules against hand-checked answers."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distml.data import digits
from distml.federated.strategy import ClientUpdate, LocalConfig, make_strategy
from distml.federated.task import build_model, get_params, set_params, train_local


def union_sgd_step(params, data, lr):
    """One step of plain SGD on the mean loss over all of ``data``."""
    model = build_model("digits-mlp")
    set_params(model, params)
    x, y = data.tensors
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {
        n: p.detach() - lr * g for (n, p), g in zip(model.named_parameters(), grads, strict=True)
    }


def test_fedavg_one_full_batch_step_equals_large_batch_sgd():
    train = digits("train")
    x, y = train.tensors
    sizes = [50, 120, 31, 200]  # unequal: the example weights matter
    cuts = torch.tensor(sizes).cumsum(0).tolist()[:-1]
    xs, ys = x[: sum(sizes)].tensor_split(cuts), y[: sum(sizes)].tensor_split(cuts)
    clients = [TensorDataset(a, b) for a, b in zip(xs, ys, strict=True)]
    start = get_params(build_model("digits-mlp", seed=3))
    strategy = make_strategy("fedavg", fraction_fit=1.0, local=LocalConfig(batch_size=0, lr=0.5))
    updates = []
    for k, data in enumerate(clients):
        model = build_model("digits-mlp")
        set_params(model, start)
        fit = train_local(model, data, epochs=1, batch_size=0, lr=0.5)
        updates.append(ClientUpdate(f"c{k}", fit.delta, fit.num_examples))
    got, metrics = strategy.aggregate_fit(1, start, updates)
    assert metrics == {}
    want = union_sgd_step(start, TensorDataset(x[: sum(sizes)], y[: sum(sizes)]), lr=0.5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_sampling_takes_a_fraction_with_a_minimum_and_is_seeded():
    s = make_strategy("fedavg", fraction_fit=0.1, min_fit_clients=3)
    clients = [f"c{i}" for i in range(100)]
    chosen, cfg = s.configure_fit(1, clients, random.Random(0))
    assert len(chosen) == 10 and set(chosen) <= set(clients)
    assert chosen == s.configure_fit(1, clients, random.Random(0))[0]
    assert len(s.configure_fit(1, clients[:12], random.Random(0))[0]) == 3
    assert cfg == {"epochs": 1, "batch_size": 10, "lr": 0.1, "prox_mu": 0.0, "clip_norm": None}
    assert (
        make_strategy("fedprox", mu=0.5).configure_fit(1, clients, random.Random(0))[1]["prox_mu"]
        == 0.5
    )


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_server_optimizers_follow_reddi_et_al(name):
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    s = make_strategy(name, server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    x = {"w": torch.tensor([1.0, -2.0, 0.5])}
    deltas = [torch.tensor([0.2, -0.1, 0.0]), torch.tensor([-0.3, 0.4, 0.1])]
    m, v, want = torch.zeros(3), torch.full((3,), tau**2), x["w"].clone()
    for d in deltas:
        x = s.apply(x, {"w": d})
        m = b1 * m + (1 - b1) * d
        if name == "fedadagrad":
            v = v + d * d
        elif name == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        else:
            v = v - (1 - b2) * d * d * torch.sign(v - d * d)
        want = want + lr * m / (v.sqrt() + tau)
    torch.testing.assert_close(x["w"], want)
    restored = make_strategy(name, server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    restored.load_state_dict(s.state_dict())
    assert torch.equal(restored.apply(x, {"w": d})["w"], s.apply(x, {"w": d})["w"])


def updates_of(*vectors):
    return [ClientUpdate(f"c{i}", {"w": torch.tensor(v)}, 1) for i, v in enumerate(vectors)]


def test_median_and_trimmed_mean_ignore_the_outlier():
    ups = updates_of([1.0, 0.0], [2.0, 1.0], [3.0, 2.0], [100.0, -50.0], [4.0, 3.0])
    assert make_strategy("median").combine(ups)["w"].tolist() == [3.0, 1.0]
    assert make_strategy("median").combine(ups[:4])["w"].tolist() == [2.5, 0.5]
    trimmed = make_strategy("trimmed-mean", beta=0.2).combine(ups)["w"]
    assert trimmed.tolist() == [3.0, 1.0]  # drops one high and one low per coordinate


def test_krum_picks_from_the_honest_cluster_and_multi_krum_averages_it():
    honest = [[1.0, 1.0], [1.1, 0.9], [0.9, 1.1], [1.0, 1.2], [1.05, 0.95]]
    ups = updates_of(*honest, [-10.0, -10.0], [9.0, -9.0])
    chosen = make_strategy("krum", byzantine=2).combine(ups)["w"].tolist()
    assert chosen in honest
    multi = make_strategy("multi-krum", byzantine=2).combine(ups)["w"]
    torch.testing.assert_close(multi, torch.tensor(honest).mean(0))
    with pytest.raises(ValueError, match="needs more than 3 updates"):
        make_strategy("krum", byzantine=1).combine(ups[:3])


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("fedmagic", {}, "unknown strategy 'fedmagic'"),
        ("fedavg", {"fraction_fit": 0}, "fraction_fit must be in"),
        ("krum", {"m": 0}, "Krum needs"),
        ("fedavg", {"mu": 1}, "strategy fedavg:"),
        ("trimmed-mean", {"beta": 0.5}, r"beta must be in \[0, 0.5\)"),
    ],
)
def test_bad_strategy_settings_are_refused(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_strategy(name, **kwargs)


def test_aggregate_evaluate_leaves_out_results_that_are_not_evaluations():
    results = [
        {"loss": 1.0, "accuracy": 0.5, "num_examples": 30},
        {"accuracy": 0.9, "num_examples": 10},
        {"loss": 3.0, "accuracy": 0.1},
    ]
    assert make_strategy("fedavg").aggregate_evaluate(results) == {"loss": 1.0, "accuracy": 0.5}
