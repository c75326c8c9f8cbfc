"""The base of the strategies that wrap another (differential privacy, secure aggregation), as
Flower's ``DifferentialPrivacyClientSideFixedClipping(strategy, ...)`` wraps a strategy: the
server asks the wrapper what it would ask any strategy, and the wrapper changes only the answers
its own concern touches.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from distml.federated.strategy import ClientUpdate, RoundStages, Strategy
from distml.federated.task import Params


class StrategyWrapper(Strategy):
    """A strategy around another: each question goes to the inner strategy unless the wrapper
    answers it itself. Its name is the inner one's; its state is the inner one's plus its own."""

    def __init__(self, strategy: Strategy):
        self.inner = strategy

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def weighs_examples(self) -> bool:  # type: ignore[override]
        return self.inner.weighs_examples

    def configure_fit(
        self, server_round: int, available: list[str], rng: random.Random
    ) -> tuple[list[str], dict[str, Any]]:
        return self.inner.configure_fit(server_round, available, rng)

    def open_stages(
        self, server_round: int, selected: list[str], params: Params
    ) -> RoundStages | None:
        return self.inner.open_stages(server_round, selected, params)

    def aggregate_fit(
        self, server_round: int, params: Params, updates: list[ClientUpdate]
    ) -> tuple[Params, dict[str, float]]:
        return self.inner.aggregate_fit(server_round, params, updates)

    def aggregate_sum(
        self, server_round: int, params: Params, total: Params, weight: float
    ) -> tuple[Params, dict[str, float]]:
        return self.inner.aggregate_sum(server_round, params, total, weight)

    def combine(self, updates: list[ClientUpdate]) -> Params:
        return self.inner.combine(updates)

    def apply(self, params: Params, delta: Params) -> Params:
        return self.inner.apply(params, delta)

    def aggregate_evaluate(self, results: list[dict[str, float]]) -> dict[str, float]:
        return self.inner.aggregate_evaluate(results)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)
