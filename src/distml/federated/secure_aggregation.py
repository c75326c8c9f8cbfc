"""Secure aggregation as a wrapper around any strategy that averages: the server sees the sum of
the round's updates and no single one (the protocol is in :mod:`distml.federated.secagg`, a
round's stages in :mod:`distml.federated.secure_round`).

Each round the wrapper opens the stages through which the masked updates arrive; once the last
stage has closed, the sum is unmasked and handed to the wrapped strategy's ``aggregate_sum``,
which turns it into the weighted mean (or, under :class:`~distml.federated.privacy.ClientLevelDP`,
into the noisy one). Rules that must see each update (the median, Krum...) cannot be wrapped.

>>> strategy = SecureAggregation(make_strategy("fedavg"), threshold=0.6)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from distml.federated.secure_round import SecureRound
from distml.federated.strategy import ClientUpdate, Strategy
from distml.federated.task import Params, unflatten
from distml.federated.wrapper import StrategyWrapper


class SecAggSettings(BaseModel):
    """A round's protocol settings: t as a fraction of the clients asked, the fixed-point range
    and precision of a coordinate, the examples that weigh 1, the key stages' deadline."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(0.6, gt=0, le=1, description="t as a fraction of selected")
    clip: float = Field(1.0, gt=0, description="quantisation range of a coordinate")
    frac_bits: int = Field(20, ge=0, le=30)
    weight_scale: float = Field(100.0, gt=0, description="examples for weight 1")
    stage_timeout_s: float = Field(30.0, gt=0, description="deadline of a key stage")


class SecureAggregation(StrategyWrapper):
    """Secure aggregation around ``strategy``, with the settings of :class:`SecAggSettings`."""

    def __init__(self, strategy: Strategy, **settings: Any):
        if strategy.needs_individual_updates:
            raise ValueError(
                f"secure aggregation shows only the sum; the {strategy.name} rule needs each update"
            )
        self.settings = SecAggSettings(**settings)  # a ValidationError names a bad one
        super().__init__(strategy)
        self._open: tuple[int, SecureRound] | None = None

    def open_stages(self, server_round: int, selected: list[str], params: Params) -> SecureRound:
        s = self.settings
        length = sum(p.numel() for p in params.values()) + 1  # the weight rides along
        protocol = SecureRound.params_for(
            len(selected), length, s.threshold, clip=s.clip, frac_bits=s.frac_bits
        )
        # Weighted by examples, each weight is bounded to stay within the quantisation range.
        scale = s.weight_scale if self.inner.weighs_examples else None
        stages = SecureRound(
            selected, protocol, weight_scale=scale, stage_timeout_s=s.stage_timeout_s
        )
        self._open = (server_round, stages)
        return stages

    def aggregate_fit(
        self, server_round: int, params: Params, updates: list[ClientUpdate]
    ) -> tuple[Params, dict[str, float]]:
        """The unmasked sum ``[sum w * delta, sum w]`` of the round, to the wrapped strategy."""
        if updates:
            raise ValueError(f"round {server_round}: secure aggregation takes no plain updates")
        opened, stages = self._open if self._open is not None else (None, None)
        if opened != server_round or stages is None or stages.total is None:
            raise ValueError(f"round {server_round} has no unmasked sum")
        vector = stages.total.double()
        total = unflatten(vector[:-1], {name: p.double() for name, p in params.items()})
        return self.inner.aggregate_sum(server_round, params, total, float(vector[-1]))
