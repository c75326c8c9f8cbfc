"""Federated strategies: small objects that answer whom to ask and with what settings
(``configure_fit``), and what to make of the answers (``aggregate_fit``), as in Flower.

Aggregation is two steps, so that rules compose: ``combine`` turns the clients' deltas into one
delta (a weighted mean, a median, Krum's choice...), and ``apply`` moves the global model by it
(plainly, or with a server optimizer). ``aggregate_sum`` is the same from the weighted sum of the
deltas alone, which is all that secure aggregation reveals.

Differential privacy and secure aggregation are not strategies of their own but wrappers around
any one (:mod:`distml.federated.wrapper`), as Flower's DP wrappers are:
:class:`~distml.federated.privacy.ClientLevelDP` replaces the mean by a noisy one and keeps the
inner ``apply``; :class:`~distml.federated.secure_aggregation.SecureAggregation` opens the
stages through which a round's masked updates arrive (``open_stages``) and hands the unmasked
sum to the strategy it wraps. The server asks whatever it is given the same questions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, Field

from distml.federated.task import Params


@dataclass
class ClientUpdate:
    client: str
    delta: Params
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


class LocalConfig(BaseModel):
    """What each selected client does in a round: E epochs of batch B at learning rate lr."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(10, ge=0, description="0: the whole local data in one batch")
    lr: float = Field(0.1, gt=0)
    prox_mu: float = Field(0.0, ge=0)
    clip_norm: float | None = Field(None, gt=0)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


class RoundStages(Protocol):
    """The stages through which a round's answers reach the server in place of plain updates
    (secure aggregation's; :class:`~distml.federated.secure_round.SecureRound`). The server
    relays each client's messages and views, and closes a stage once every client it expects
    has answered or its deadline has passed."""

    @property
    def done(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def training(self) -> bool:
        """The open stage is the one in which the clients train (it gets the round's timeout)."""
        ...

    @property
    def stage_timeout_s(self) -> float: ...

    def task(self, name: str) -> dict[str, Any]: ...

    def complete(self) -> bool: ...

    def close_stage(self) -> None: ...

    def receive(self, name: str, stage: str, payload: Any) -> None: ...

    def leave(self, name: str) -> None:
        """``name`` has left: no stage waits for it any longer."""
        ...

    def view(self, name: str, stage: str) -> Any: ...

    def survivors(self) -> int: ...


class Strategy:
    """FedAvg's life cycle (McMahan et al. 2017): sample a fraction C of the available clients,
    at least ``min_fit_clients``; average their deltas weighted by example counts."""

    name = "fedavg"
    needs_individual_updates = False  # robust rules must see each update: no secure aggregation
    weighs_examples = True  # a client's weight in the mean is its example count

    def __init__(
        self,
        fraction_fit: float = 0.1,
        min_fit_clients: int = 2,
        local: LocalConfig | None = None,
        server_lr: float = 1.0,
    ):
        if not 0 < fraction_fit <= 1:
            raise ValueError(f"fraction_fit must be in (0, 1], got {fraction_fit}")
        if min_fit_clients < 1:
            raise ValueError(f"min_fit_clients must be >= 1, got {min_fit_clients}")
        self.fraction_fit = fraction_fit
        self.min_fit_clients = min_fit_clients
        self.local = local or LocalConfig()
        self.server_lr = server_lr

    # -- fit --------------------------------------------------------------------------------
    def num_fit_clients(self, available: int) -> int:
        return min(available, max(self.min_fit_clients, round(self.fraction_fit * available)))

    def configure_fit(
        self, server_round: int, available: list[str], rng: random.Random
    ) -> tuple[list[str], dict[str, Any]]:
        """The clients to train this round, and what they are to do."""
        chosen = rng.sample(sorted(available), self.num_fit_clients(len(available)))
        return sorted(chosen), self.local.to_dict()

    def open_stages(
        self, server_round: int, selected: list[str], params: Params
    ) -> RoundStages | None:
        """The stages through which this round's answers arrive, or None: plain updates."""
        del server_round, selected, params
        return None

    def aggregate_fit(
        self, server_round: int, params: Params, updates: list[ClientUpdate]
    ) -> tuple[Params, dict[str, float]]:
        """The new global parameters from the round's updates, and metrics for its record."""
        del server_round
        return self.apply(params, self.combine(updates)), {}

    def aggregate_sum(
        self, server_round: int, params: Params, total: Params, weight: float
    ) -> tuple[Params, dict[str, float]]:
        """As :meth:`aggregate_fit`, from the weighted sum of the deltas and the sum of the
        weights alone: their weighted mean, applied."""
        del server_round
        mean = {name: (t / weight).to(params[name].dtype) for name, t in total.items()}
        return self.apply(params, mean), {}

    def combine(self, updates: list[ClientUpdate]) -> Params:
        total = sum(u.num_examples for u in updates)
        return {
            name: sum(u.delta[name] * (u.num_examples / total) for u in updates)
            for name in updates[0].delta
        }

    def apply(self, params: Params, delta: Params) -> Params:
        return {name: params[name] + self.server_lr * delta[name] for name in params}

    # -- evaluate ---------------------------------------------------------------------------
    def aggregate_evaluate(self, results: list[dict[str, float]]) -> dict[str, float]:
        """Clients' evaluations of the global model on their own data, weighted by examples;
        a result without its loss, accuracy or example count is no evaluation and is left out."""
        keys = ("loss", "accuracy", "num_examples")
        results = [r for r in results if all(k in r for k in keys)]
        total = sum(r["num_examples"] for r in results)
        if not total:
            return {}
        return {
            key: sum(r[key] * r["num_examples"] for r in results) / total
            for key in ("loss", "accuracy")
        }

    # -- server state (checkpointed every round) --------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        del state


class FedAvg(Strategy):
    pass


class FedProx(Strategy):
    """FedAvg whose clients add mu/2 ||w - w_global||^2 to their loss (Li et al. 2020)."""

    name = "fedprox"

    def __init__(self, mu: float = 0.01, **kwargs: Any):
        super().__init__(**kwargs)
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.local.prox_mu = mu


class FedOpt(Strategy):
    """Adaptive server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization",
    Algorithm 2): the mean delta is a pseudo-gradient; m and v are kept on the server."""

    def __init__(
        self,
        server_lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        **kwargs: Any,
    ):
        super().__init__(server_lr=server_lr, **kwargs)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.m: Params = {}
        self.v: Params = {}

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, params: Params, delta: Params) -> Params:
        out = {}
        for name, d in delta.items():
            m = self.m.get(name, torch.zeros_like(d))
            # Reddi et al. start v at tau^2 (so the first step is bounded by lr / tau).
            v = self.v.get(name, torch.full_like(d, self.tau**2))
            self.m[name] = self.beta1 * m + (1 - self.beta1) * d
            self.v[name] = self.second_moment(v, d * d)
            out[name] = params[name] + self.server_lr * self.m[name] / (
                self.v[name].sqrt() + self.tau
            )
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"m/{n}": t for n, t in self.m.items()} | {f"v/{n}": t for n, t in self.v.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.m = {k[2:]: t for k, t in state.items() if k.startswith("m/")}
        self.v = {k[2:]: t for k, t in state.items() if k.startswith("v/")}


class FedAdagrad(FedOpt):
    name = "fedadagrad"

    def second_moment(self, v, d2):
        return v + d2


class FedAdam(FedOpt):
    name = "fedadam"

    def second_moment(self, v, d2):
        return self.beta2 * v + (1 - self.beta2) * d2


class FedYogi(FedOpt):
    name = "fedyogi"

    def second_moment(self, v, d2):
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)


# -- robust rules: each update is one vote, whatever its example count ------------------------
class _Robust(Strategy):
    needs_individual_updates = True

    def combine(self, updates: list[ClientUpdate]) -> Params:
        names = list(updates[0].delta)
        stacked = {n: torch.stack([u.delta[n] for u in updates]) for n in names}
        return self.combine_stacked(stacked, len(updates))

    def combine_stacked(self, stacked: Params, n: int) -> Params:
        raise NotImplementedError


class Median(_Robust):
    """Coordinate-wise median (Yin et al. 2018)."""

    name = "median"

    def combine_stacked(self, stacked, n):
        # quantile(0.5) is the median, the mean of the two middle values when n is even.
        return {k: t.quantile(0.5, dim=0) for k, t in stacked.items()}


class TrimmedMean(_Robust):
    """Coordinate-wise mean after dropping the ``beta`` fraction largest and smallest values
    (Yin et al. 2018)."""

    name = "trimmed-mean"

    def __init__(self, beta: float = 0.2, **kwargs: Any):
        super().__init__(**kwargs)
        if not 0 <= beta < 0.5:
            raise ValueError(f"trimmed mean beta must be in [0, 0.5), got {beta}")
        self.beta = beta

    def combine_stacked(self, stacked, n):
        cut = int(math.floor(self.beta * n))
        return {k: t.sort(0).values[cut : n - cut].mean(0) for k, t in stacked.items()}


class Krum(_Robust):
    """Krum (Blanchard et al. 2017): the update whose n - f - 2 nearest neighbours are closest;
    Multi-Krum averages the ``m`` best-scored updates."""

    name = "krum"

    def __init__(self, byzantine: int = 1, m: int | None = 1, **kwargs: Any):
        super().__init__(**kwargs)
        if byzantine < 0 or (m is not None and m < 1):
            raise ValueError(f"Krum needs byzantine >= 0 and m >= 1, got {byzantine}, {m}")
        self.byzantine, self.m = byzantine, m

    def scores(self, flat: torch.Tensor) -> torch.Tensor:
        """Each update's sum of squared distances to its n - f - 2 nearest others."""
        n = flat.shape[0]
        neighbours = n - self.byzantine - 2
        if neighbours < 1:
            raise ValueError(f"Krum with f = {self.byzantine} needs more than {n} updates")
        d2 = torch.cdist(flat.double(), flat.double()).pow(2)
        d2.fill_diagonal_(float("inf"))
        return d2.sort(1).values[:, :neighbours].sum(1)

    def combine_stacked(self, stacked, n):
        flat = torch.cat([t.reshape(n, -1) for t in stacked.values()], dim=1)
        m = self.m if self.m is not None else n - self.byzantine
        best = self.scores(flat).argsort()[: min(m, n)]
        return {k: t[best].mean(0) for k, t in stacked.items()}


class MultiKrum(Krum):
    """Multi-Krum: by default the mean of the n - f best-scored updates (Blanchard et al.)."""

    name = "multi-krum"

    def __init__(self, byzantine: int = 1, m: int | None = None, **kwargs: Any):
        super().__init__(byzantine=byzantine, m=m, **kwargs)


FL_STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedProx,
        FedAdagrad,
        FedAdam,
        FedYogi,
        Median,
        TrimmedMean,
        Krum,
        MultiKrum,
    )  # fmt: skip
}
FL_STRATEGIES["fedsgd"] = FedAvg  # FedAvg with E = 1, B = all (set by the local config)


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """The federated strategy called ``name`` (see :data:`FL_STRATEGIES`); options a strategy
    does not take are refused with their names."""
    if name not in FL_STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(FL_STRATEGIES)}")
    cls = FL_STRATEGIES[name]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"strategy {name}: {exc}") from None
