"""Client-level differential privacy: DP-FedAvg (McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models").

Each client clips its delta to L2 norm ``clip_norm`` (the server checks the bound and refuses an
update above it); the server sums the clipped deltas, adds Gaussian noise of standard deviation
``noise_multiplier * clip_norm`` and divides by the number of clients the round asked for, so a
client's presence moves the result by at most ``clip_norm / m``. Every example weighs the same
here: example counts would leak.

Privacy is counted by opacus' RDP accountant, one step per round at sampling rate
q = clients asked / clients registered. That accountant assumes Poisson sampling; a round samples
a fixed number without replacement, the usual approximation in the FL literature.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
from opacus.accountants import RDPAccountant

from distml.federated.task import Params


class ClientLevelDP:
    def __init__(
        self,
        noise_multiplier: float,
        clip_norm: float,
        delta: float = 1e-5,
        seed: int | None = None,
    ):
        if noise_multiplier < 0 or clip_norm <= 0 or not 0 < delta < 1:
            raise ValueError(
                f"DP needs noise_multiplier >= 0, clip_norm > 0 and 0 < delta < 1; got "
                f"{noise_multiplier}, {clip_norm}, {delta}"
            )
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.delta = delta
        self.accountant = RDPAccountant()
        seed = secrets.randbits(63) if seed is None else seed
        self._gen = torch.Generator().manual_seed(seed)

    def noisy_mean(self, total: Params, expected_clients: int) -> Params:
        """(sum of clipped deltas + N(0, (sigma C)^2)) / m."""
        std = self.noise_multiplier * self.clip_norm
        return {
            name: (t + std * torch.randn(t.shape, generator=self._gen, dtype=t.dtype))
            / expected_clients
            for name, t in total.items()
        }

    def account_round(self, sample_rate: float) -> None:
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)

    def epsilon(self) -> float:
        if not self.accountant.history:
            return 0.0
        return float(self.accountant.get_epsilon(self.delta))

    def state(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.accountant.history]}

    def load_state(self, state: dict[str, Any]) -> None:
        self.accountant.history = [tuple(h) for h in state.get("history", [])]
