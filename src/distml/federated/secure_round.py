"""A federated round under secure aggregation: the four stages of
:mod:`distml.federated.secagg`, each closed when every expected client has answered or its
deadline passes, driven by the server's round loop (the round's stages that
:class:`~distml.federated.secure_aggregation.SecureAggregation` opens).

What a client masks is ``[w * delta, w]``, its flattened delta scaled by its weight and the
weight itself as a last coordinate: the unmasked sum then gives the weighted mean as
``sum[:-1] / sum[-1]`` without the server seeing any client's count or update. The weight is
``min(1, examples / weight_scale)`` (FedAvg's example weighting, bounded so that the masked
values stay within the quantisation range), or 1 for every client under differential privacy.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from distml.federated.secagg import SecAggError, SecAggParams, SecAggServer

STAGES = ("advertise", "share_keys", "masked_input", "unmask")


class StageError(ValueError):
    """A secure-aggregation message the round cannot take (answered 4xx)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


class SecureRound:
    def __init__(
        self,
        names: list[str],
        params: SecAggParams,
        *,
        weight_scale: float | None = None,
        stage_timeout_s: float = 30.0,
    ):
        self.ids = {name: i for i, name in enumerate(sorted(names))}
        self.params = params
        self.weight_scale = weight_scale  # None: every client weighs 1
        self.stage_timeout_s = stage_timeout_s  # the key stages' deadline
        self.server = SecAggServer(params, list(self.ids.values()))
        self.stage = 0  # index into STAGES; len(STAGES) once the sum is unmasked
        self.failure: str | None = None
        self.total: torch.Tensor | None = None

    @staticmethod
    def params_for(clients: int, length: int, threshold: float, **options: Any) -> SecAggParams:
        """Parameters for ``clients`` selected clients masking ``length`` values; t is the
        ``threshold`` fraction of them (at least 2)."""
        t = max(2, math.ceil(threshold * clients))
        return SecAggParams(threshold=min(t, clients), length=length, **options)

    def task(self, name: str) -> dict[str, Any]:
        return {
            "id": self.ids[name],
            "params": self.params.model_dump(),
            "weight_scale": self.weight_scale,
        }

    @property
    def done(self) -> bool:
        return self.failure is not None or self.stage == len(STAGES)

    @property
    def training(self) -> bool:
        """The open stage is the masked input: the clients train before they answer it."""
        return not self.done and STAGES[self.stage] == "masked_input"

    def complete(self) -> bool:
        """Every client the open stage expects has answered."""
        return self.done or not self.server.waiting_for()

    def receive(self, name: str, stage: str, payload: Any) -> None:
        if self.failure is not None:
            raise StageError(f"the round has failed: {self.failure}", 409)
        if self.done or STAGES[self.stage] != stage:
            raise StageError(f"{stage}: the open stage is {self.open_stage()}", 409)
        receive = {
            "advertise": self.server.receive_advertisement,
            "share_keys": self.server.receive_shares,
            "masked_input": self.server.receive_masked,
            "unmask": self.server.receive_unmask,
        }[stage]
        try:
            receive(self.ids[name], payload)
        except SecAggError as exc:
            raise StageError(str(exc)) from None

    def leave(self, name: str) -> None:
        self.server.leave(self.ids[name])

    def survivors(self) -> int:
        """How many clients' masked inputs are in the sum (0 before that stage closed)."""
        return len(self.server.survivors()) if self.stage > 2 else 0

    def open_stage(self) -> str:
        return "done" if self.done else STAGES[self.stage]

    def close_stage(self) -> None:
        """Fix the set of clients of the open stage (or unmask the sum, after the last); a stage
        with fewer than t clients fails the round."""
        try:
            if self.stage == 0:
                self.server.public_keys()
            elif self.stage == 1:
                self.server.close_shares()
            elif self.stage == 2:
                self.server.survivors()
            else:
                self.total = self.server.aggregate()
        except (SecAggError, ValueError) as exc:  # a client's bad shares fail this round only
            self.failure = str(exc)
            return
        self.stage += 1

    def view(self, name: str, stage: str) -> Any:
        """What ``name`` needs for ``stage``, once the stage before it has closed: the public
        keys, its inbox of shares, or the survivors; None while that stage is still open."""
        needs = {"share_keys": 1, "masked_input": 2, "unmask": 3}
        if stage not in needs:
            raise StageError(f"no view for stage {stage!r}", 404)
        if self.failure is not None:
            raise StageError(f"the round has failed: {self.failure}", 409)
        if self.stage < needs[stage]:
            return None
        try:
            if stage == "share_keys":
                return self.server.public_keys()
            if stage == "masked_input":
                return self.server.shares_for(self.ids[name])
            return self.server.survivors()
        except SecAggError as exc:  # a client the stage left out
            raise StageError(str(exc), 409) from None
