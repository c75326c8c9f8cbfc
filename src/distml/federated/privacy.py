"""Client-level differential privacy: DP-FedAvg (McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models"), as a wrapper around any strategy that averages.

Each client clips its delta to L2 norm ``clip_norm`` (the round's settings say so, and the server
refuses an update above it); the server sums the clipped deltas, adds Gaussian noise of standard
deviation ``noise_multiplier * clip_norm`` and divides by the number of clients the round asked
for, so a client's presence moves the result by at most ``clip_norm / m``. The wrapped strategy
then applies that mean (plainly, or with its server optimizer). Every example weighs the same
here: example counts would leak. Under secure aggregation the sum comes unmasked, and the noise is
added to it the same way.

Privacy is counted by opacus' RDP accountant, one step per round at sampling rate
q = clients asked / clients available when the round sampled them. That accountant assumes
Poisson sampling; a round samples a fixed number without replacement, the usual approximation in
the FL literature. The accountant's ledger is part of the strategy's state: it is checkpointed
with the model and rolled back with a failed round.

>>> strategy = ClientLevelDP(make_strategy("fedavg"), 1.0, 0.5)  # doctest: +SKIP
"""

from __future__ import annotations

import random
import secrets
from typing import Any

import torch

from distml.federated.secure_aggregation import SecureAggregation
from distml.federated.strategy import ClientUpdate, Strategy
from distml.federated.task import Params
from distml.federated.wrapper import StrategyWrapper

# The accountant's history, (noise multiplier, sample rate, steps) rows, as one float64 tensor of
# the strategy's state: float64 holds each of them exactly.
LEDGER = "dp/ledger"


class ClientLevelDP(StrategyWrapper):
    """DP-FedAvg around ``strategy``: the round asks its clients to clip to ``clip_norm``, and
    the mean the strategy applies is the noisy one of the module's formula."""

    weighs_examples = False  # type: ignore[assignment]

    def __init__(
        self,
        strategy: Strategy,
        noise_multiplier: float,
        clip_norm: float,
        delta: float = 1e-5,
        seed: int | None = None,
    ):
        if strategy.needs_individual_updates:
            raise ValueError(f"DP-FedAvg noises a mean; the {strategy.name} rule needs each update")
        if isinstance(strategy, SecureAggregation):  # it would hand this wrapper no updates
            raise ValueError(
                "secure aggregation goes around differential privacy: "
                "SecureAggregation(ClientLevelDP(strategy, ...), ...)"
            )
        if noise_multiplier < 0 or clip_norm <= 0 or not 0 < delta < 1:
            raise ValueError(
                f"DP needs noise_multiplier >= 0, clip_norm > 0 and 0 < delta < 1; got "
                f"{noise_multiplier}, {clip_norm}, {delta}"
            )
        super().__init__(strategy)
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.delta = delta
        from opacus.accountants import RDPAccountant  # slow to import: only runs with DP pay

        self.accountant = RDPAccountant()
        seed = secrets.randbits(63) if seed is None else seed
        self._gen = torch.Generator().manual_seed(seed)
        self._sampled: dict[int, tuple[int, int]] = {}  # round -> (clients asked, available)

    def configure_fit(
        self, server_round: int, available: list[str], rng: random.Random
    ) -> tuple[list[str], dict[str, Any]]:
        selected, config = self.inner.configure_fit(server_round, available, rng)
        self._sampled = {server_round: (len(selected), max(len(available), len(selected)))}
        return selected, config | {"clip_norm": self.clip_norm}

    def aggregate_fit(
        self, server_round: int, params: Params, updates: list[ClientUpdate]
    ) -> tuple[Params, dict[str, float]]:
        total = {name: sum(u.delta[name] for u in updates) for name in params}
        return self._private(server_round, params, total)

    def aggregate_sum(
        self, server_round: int, params: Params, total: Params, weight: float
    ) -> tuple[Params, dict[str, float]]:
        del weight  # every client weighs 1: the weight is the number that answered
        return self._private(
            server_round, params, {name: t.to(params[name].dtype) for name, t in total.items()}
        )

    def _private(
        self, server_round: int, params: Params, total: Params
    ) -> tuple[Params, dict[str, float]]:
        if server_round not in self._sampled:
            raise ValueError(f"round {server_round} was not sampled by this strategy")
        asked, available = self._sampled[server_round]
        mean = self.noisy_mean(total, asked)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=asked / available)
        return self.inner.apply(params, mean), {"epsilon": self.epsilon()}

    def noisy_mean(self, total: Params, expected_clients: int) -> Params:
        """(sum of clipped deltas + N(0, (sigma C)^2)) / m."""
        std = self.noise_multiplier * self.clip_norm
        return {
            name: (t + std * torch.randn(t.shape, generator=self._gen, dtype=t.dtype))
            / expected_clients
            for name, t in total.items()
        }

    def epsilon(self) -> float:
        if not self.accountant.history:
            return 0.0
        return float(self.accountant.get_epsilon(self.delta))

    # -- the ledger rides in the strategy's state -------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = self.inner.state_dict()
        if self.accountant.history:
            state[LEDGER] = torch.tensor(self.accountant.history, dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict({k: t for k, t in state.items() if k != LEDGER})
        rows = state[LEDGER].tolist() if LEDGER in state else []
        self.accountant.history = [(noise, rate, int(steps)) for noise, rate, steps in rows]


def ledger_of(history: list[list[float]]) -> dict[str, torch.Tensor]:
    """The strategy state that holds an accountant ``history`` (as checkpoints before the ledger
    moved into the strategy's state wrote it, in their JSON)."""
    return {LEDGER: torch.tensor(history, dtype=torch.float64)} if history else {}
